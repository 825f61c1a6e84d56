"""A small model of a ggml compute graph and of the buffer ggml's graph allocator reserves for it.

llama.cpp sizes a compute buffer by handing the graph of the largest batch (or image) to `ggml_gallocr`
(ggml/src/ggml-alloc.c), which walks the graph in order and places every tensor that no buffer holds yet in one
virtual buffer: the largest offset it ever reaches is the buffer's size. This module reproduces that walk for a
graph built from the few ops a vision tower uses, with what decides the result:

- the graph's order: ggml_build_forward_expand's depth-first visit of each tensor's sources, left to right, a
  tensor entering the graph after its sources (leaves: tensors without an op);
- sizes: ggml_nbytes of each contiguous result, rounded up to the buffer type's alignment (32 bytes on the CPU);
  views (reshape, permute, transpose, view) take no memory of their own; weights already lie in their buffer;
- reuse in place: an op ggml allows to write over its source (add, mul, unary, soft_max, rms_norm, ...) takes the
  memory of its first source that the allocator owns, that has no other consumer left and no view, and has the
  same type and shape;
- lifetimes: a tensor is freed once its last consumer has been placed (a view's memory once its source's last
  view and consumer are done); freed memory merges with neighbouring free blocks;
- placement: the smallest free block that fits (of equal ones, the last), else the end of the buffer.
Inputs (ggml_set_input) are placed before any op. One backend only: ggml_backend_sched then passes the graph
unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TYPE_SIZE = {"f32": 4, "f16": 2, "bf16": 2}
#: ggml_op_can_inplace (ggml-alloc.c), of the ops this model builds
INPLACE_OPS = frozenset({"add", "mul", "scale", "unary", "soft_max", "rms_norm"})
VIEW_OPS = frozenset({"view", "reshape", "permute", "transpose"})


@dataclass(eq=False)
class Tensor:
    """A ggml tensor as the allocator sees it: its op (None: a leaf), type, shape (ne, innermost first), sources."""

    op: str | None
    type: str
    ne: tuple[int, int, int, int]
    src: list[Tensor] = field(default_factory=list)
    view_src: Tensor | None = None    # the tensor whose memory a view shares (never itself a view)
    held: bool = False                  # already in a buffer (a weight): never placed by the allocator
    input: bool = False                 # ggml_set_input: placed first

    @property
    def nbytes(self) -> int:
        return math.prod(self.ne) * TYPE_SIZE[self.type]


def _ne(*ne: int) -> tuple[int, int, int, int]:
    return tuple(ne) + (1,) * (4 - len(ne))  # type: ignore[return-value]


# -- tensors and ops (ggml.c's shape rules) --

def weight(ne: tuple[int, ...], type_: str = "f32") -> Tensor:
    return Tensor(None, type_, _ne(*ne), held=True)


def input_tensor(ne: tuple[int, ...], type_: str = "f32") -> Tensor:
    return Tensor(None, type_, _ne(*ne), input=True)


def new(op: str, type_: str, ne: tuple[int, ...], *src: Tensor | None) -> Tensor:
    return Tensor(op, type_, _ne(*ne), [s for s in src if s is not None])


def same(op: str, a: Tensor, *src: Tensor | None) -> Tensor:
    """An op whose result has its first source's type and shape (ggml_dup_tensor): add, mul, norm, unary, ..."""
    return new(op, a.type, a.ne, a, *src)


def view(op: str, a: Tensor, ne: tuple[int, ...]) -> Tensor:
    return Tensor(op, a.type, _ne(*ne), [a], view_src=a.view_src or a)


def reshape(a: Tensor, *ne: int) -> Tensor:
    assert math.prod(ne) == math.prod(a.ne), (ne, a.ne)
    return view("reshape", a, ne)


def permute(a: Tensor, *axes: int) -> Tensor:
    ne = [0] * 4
    for i, axis in enumerate(axes):
        ne[axis] = a.ne[i]
    return view("permute", a, tuple(ne))


def transpose(a: Tensor) -> Tensor:
    return view("transpose", a, (a.ne[1], a.ne[0], a.ne[2], a.ne[3]))


def cont(a: Tensor, *ne: int) -> Tensor:
    return new("cont", a.type, ne or a.ne, a)


def cast(a: Tensor, type_: str) -> Tensor:
    """ggml_cast: a copy whose second source is itself (as ggml_cpy_impl's destination)."""
    result = new("cpy", type_, a.ne, a)
    result.src.append(result)
    return result


def mul_mat(a: Tensor, b: Tensor) -> Tensor:
    return new("mul_mat", "f32", (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), a, b)


def conv_2d(kernel: Tensor, image: Tensor, stride: int) -> Tensor:
    """ggml_conv_2d without padding or dilation: im2col (f16 for an f32/f16 kernel), one matmul, a permute."""
    kw, kh, channels, out = kernel.ne
    ow, oh = (image.ne[0] - kw) // stride + 1, (image.ne[1] - kh) // stride + 1
    cols = new("im2col", "f32" if kernel.type == "bf16" else "f16", (channels * kh * kw, ow, oh, image.ne[3]), kernel, image)
    result = mul_mat(reshape(cols, cols.ne[0], ow * oh * image.ne[3]), reshape(kernel, kw * kh * channels, out))
    result = reshape(result, ow, oh, image.ne[3], out)
    return cont(permute(result, 0, 1, 3, 2))


def pool_2d(a: Tensor, kernel: int) -> Tensor:
    """ggml_pool_2d with stride = kernel and no padding."""
    def side(n: int) -> int:
        return (n - kernel) // kernel + 1

    return new("pool_2d", "f32", (side(a.ne[0]), side(a.ne[1]), a.ne[2], a.ne[3]), a)


def flash_attn_ext(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return new("flash_attn_ext", "f32", (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), q, k, v)


# -- the graph (ggml_visit_parents_graph) --

@dataclass
class Graph:
    nodes: list[Tensor] = field(default_factory=list)
    leafs: list[Tensor] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set)

    def expand(self, t: Tensor) -> None:
        """ggml_build_forward_expand / ggml_build_forward_order: `t` and its unseen sources, sources first."""
        stack: list[tuple[Tensor, int]] = [(t, 0)]
        self._seen.add(id(t))
        while stack:
            node, i = stack.pop()
            if i < len(node.src):
                stack.append((node, i + 1))
                s = node.src[i]
                if id(s) not in self._seen:
                    self._seen.add(id(s))
                    stack.append((s, 0))
            else:
                (self.nodes if node.op is not None else self.leafs).append(node)


# -- the allocator (ggml_dyn_tallocr and ggml_gallocr_alloc_graph_impl, one chunk) --

class _Blocks:
    """Free blocks sorted by offset; the last one is the unbounded end of the buffer."""

    END = 1 << 62

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.free: list[list[int]] = [[0, self.END]]     # [offset, size]
        self.max_size = 0

    def _align(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    def alloc(self, size: int) -> int:
        size = self._align(size)
        best, best_size = len(self.free) - 1, None
        for i, (_, block) in enumerate(self.free[:-1]):
            if block >= size and (best_size is None or block <= best_size):
                best, best_size = i, block
        offset = self.free[best][0]
        self.free[best][0] += size
        self.free[best][1] -= size
        if self.free[best][1] == 0:
            del self.free[best]
        self.max_size = max(self.max_size, offset + size)
        return offset

    def release(self, offset: int, size: int) -> None:
        size = self._align(size)
        for i, block in enumerate(self.free):
            if block[0] + block[1] == offset:
                block[1] += size
                if i + 1 < len(self.free) and block[0] + block[1] == self.free[i + 1][0]:
                    block[1] += self.free.pop(i + 1)[1]
                return
            if offset + size == block[0]:
                block[0] = offset
                block[1] += size
                if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == block[0]:
                    self.free[i - 1][1] += self.free.pop(i)[1]
                return
        at = next((i for i, block in enumerate(self.free) if block[0] >= offset), len(self.free))
        self.free.insert(at, [offset, size])


@dataclass
class _Slot:
    children: int = 0
    views: int = 0
    owned: bool = False
    offset: int = -1


def compute_buffer(graph: Graph, alignment: int = 32) -> int:
    """Bytes ggml_gallocr_reserve gives `graph` on one backend of this alignment."""
    blocks = _Blocks(alignment)
    slots: dict[int, _Slot] = {}

    def slot(t: Tensor) -> _Slot:
        return slots.setdefault(id(t), _Slot())

    def place(t: Tensor) -> None:
        s = slot(t)
        if t.held or s.owned or t.view_src is not None:
            return
        s.owned = True
        if t.op in INPLACE_OPS:
            for parent in t.src:
                p = slot(parent)
                if not p.owned or parent.type != t.type or parent.ne != t.ne:
                    continue     # not the allocator's, or another layout (views are never owned)
                if p.children == 1 and p.views == 0:
                    s.offset, p.owned = p.offset, False
                    return
        s.offset = blocks.alloc(t.nbytes)

    def release(t: Tensor) -> None:
        blocks.release(slot(t).offset, t.nbytes)
        slot(t).owned = False

    for leaf in graph.leafs:
        place(leaf)
    for node in graph.nodes:
        if node.view_src is not None:
            slot(node.view_src).views += 1
        if node.input:
            place(node)
        for s in node.src:
            slot(s).children += 1
            if s.input:
                place(s)
    for node in graph.nodes:
        for parent in node.src:
            place(parent)
        place(node)
        for parent in node.src:
            p = slot(parent)
            p.children -= 1
            if p.children or p.views:
                continue
            if parent.view_src is not None:
                root = slot(parent.view_src)
                root.views -= 1
                if root.views == 0 and root.children == 0 and root.owned:
                    release(parent.view_src)
            elif p.owned:
                release(parent)
    return blocks.max_size
