"""The house's layering, read from the source (no module is imported): no import circle between kvlab's modules,
and every import points down the layers docs/architecture.md draws. Imports inside functions count too (they
still make the dependency); imports under `if TYPE_CHECKING:` do not (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: lowest first; a module may import its own layer's modules and any layer below, never one above.
#: A name is a top-level module or package of kvlab.
LAYERS: list[tuple[str, set[str]]] = [
    ("ground", {"errors", "limits", "fileio", "spec", "rope", "paths", "bitplanes", "terminal", "heap", "measure", "kernels"}),
    ("formats and readers", {"cache", "sources"}),
    ("planner", {"plan"}),
    ("model", {"model"}),
    ("runs", {"generate", "hf", "hf_baselines", "quality"}),
    ("runtimes", {"backends", "session"}),
    ("serving", {"serve"}),
    ("commands", {"eval", "lab", "bench", "fuzz", "demo", "cli"}),
]
LAYER_OF = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "kvlab").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the kvlab modules it imports (a `from package import name` counts as package.name where that is a
    module, else as the package)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            if _type_checking_only(node, parents):
                continue
            targets.update(name for name in names if name in modules and name != module)
        graph[module] = targets
    return graph


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


GRAPH = _imports(_modules())


def test_every_module_has_a_layer():
    unplaced = sorted({_top(m) for m in GRAPH if _top(m) and _top(m) not in LAYER_OF} - {"__main__"})
    assert not unplaced, f"modules of kvlab with no layer in LAYERS: {unplaced}"


def test_imports_point_down():
    upward = [f"{module} -> {target} ({LAYERS[LAYER_OF[_top(module)]][0]} -> {LAYERS[LAYER_OF[_top(target)]][0]})"
              for module, targets in sorted(GRAPH.items()) if _top(module) in LAYER_OF
              for target in sorted(targets) if _top(target) in LAYER_OF and LAYER_OF[_top(target)] > LAYER_OF[_top(module)]]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_between_modules():
    cycles = _cycles(GRAPH)
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_circle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        packages.setdefault(_top(module), set()).update(_top(t) for t in targets if _top(t) != _top(module))
    cycles = _cycles(packages)
    assert not cycles, "packages that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("cycle, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_cycle_finder_finds_cycles(cycle, expected):
    assert _cycles(cycle) == expected
