"""A short seeded slice of the fuzzer (`make fuzz` runs the long one), the regression corpus, and AddressSanitizer.

Every step of every case must end ok or in a one-line error: no traceback, signal, hang, memory blow-up or
AddressSanitizer report. The ASan tests fail (not skip) when a C compiler exists but cannot build or load
the instrumented kernel; they skip only without a compiler.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvlab.fuzz.formats import GGUFLayout
from kvlab.fuzz.mutate import Case, Seeds, kinds, make_case, materialize
from kvlab.fuzz.run import FuzzConfig, death_record, load_corpus, run_canary, run_cases
from kvlab.fuzz.worker import classify_exit

CORPUS = Path(__file__).parent / "fuzz_corpus"
SEED = 0
# the descriptors run again under ASan: the heap corruptions of issue 10 on SmolLM2 and their tiny twins
ASAN_CASES = ("heap-smollm2-q-1152-rows", "heap-smollm2-head-count-12", "heap-q-rows-doubled", "heap-ffn-down-swapped", "heap-attn-output-cols-doubled",
              "heap-head-count-8", "heap-ff-length-96", "heap-key-length-8")


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> Seeds:
    return Seeds.build(tmp_path_factory.mktemp("fuzz-seeds"))


def failures(results) -> str:
    lines = []
    for r in results:
        for step, outcome in r.steps.items():
            if outcome["kind"] not in ("ok", "error"):
                what = " ".join(str(outcome.get(k) or "") for k in ("exception", "message"))[:160]
                lines.append(f"{outcome['kind']:>10} {r.case.target}:{r.case.seed}:{r.case.index} [{r.case.label}] "
                             f"{step}: {what} at {outcome.get('where')}")
    return "\n".join(lines)


def assert_all_pass(results) -> None:
    assert results and all(r.steps for r in results)
    bad = failures(results)
    assert not bad, f"{len([r for r in results if not r.passed])} of {len(results)} cases failed:\n{bad}"


# -- the mutator itself (fast) ------------------------------------------------------------------------------------

def test_an_unedited_gguf_is_written_back_byte_for_byte(seeds, tmp_path):
    path = materialize(Case("tiny-gguf", "none", "no edit", []), seeds, tmp_path)
    assert path.read_bytes() == seeds.tiny_gguf.read_bytes()


def test_cases_replay_from_seed_and_index_and_cover_every_kind(seeds):
    for target in ("tiny-gguf", "tiny-hf"):
        names = kinds(target)
        cases = [make_case(target, SEED, i, seeds) for i in range(len(names))]
        assert [c.kind for c in cases] == names
        again = [make_case(target, SEED, i, seeds) for i in range(len(names))]
        assert [c.edits for c in cases] == [c.edits for c in again]
        assert Case.from_json(json.loads(json.dumps(cases[0].to_json()))) == cases[0]


def test_edits_reach_the_written_header(seeds, tmp_path):
    case = Case("tiny-gguf", "kv_value", "heads", [
        {"op": "set_kv", "key": "llama.attention.head_count", "type": "u32", "value": 12},
        {"op": "tensor", "name": "blk.0.attn_q.weight", "shape": [64, 128]},
        {"op": "nest_kv", "key": "general.fuzz", "depth": 3},
    ])
    layout = GGUFLayout.read(materialize(case, seeds, tmp_path))
    assert layout.value("llama.attention.head_count") == 12
    assert next(t for t in layout.tensors if t.name == "blk.0.attn_q.weight").shape == [64, 128]
    assert layout.type_name("general.fuzz") == "arr"


def test_outcomes_are_classified():
    assert classify_exit(0, "")["kind"] == "ok"
    assert classify_exit(2, "warning: x\nerror: bad head count\n")["kind"] == "error"
    assert classify_exit(2, "Traceback (most recent call last):\nerror: x\n")["kind"] == "unclear-error"
    assert classify_exit(1, "")["kind"] == "unclear-error"
    assert death_record(-11, None, 'Fatal Python error: Segmentation fault\n  File "/x/src/kvlab/model/fused.py", line 9 in step\n') == {
        "kind": "signal", "message": "SIGSEGV Fatal Python error: Segmentation fault", "where": "kvlab/model/fused.py:step:9",
        "python_where": "kvlab/model/fused.py:step:9"}
    assert death_record(-9, "hang", "")["kind"] == "hang"
    assert death_record(-9, "memory", "")["kind"] == "memory"
    report = "==1==ERROR: AddressSanitizer: heap-buffer-overflow\n    #0 0x7f in matvec /k/decode.c:185\nSUMMARY: AddressSanitizer: x\n"
    assert death_record(-6, None, report)["kind"] == "asan"


# -- the slice and the corpus (subprocesses) ---------------------------------------------------------------------

def test_seeded_slice_ends_in_ok_or_one_line_errors(seeds, tmp_path):
    """Every GGUF mutation kind and every HF-folder mutation kind once (seed 0)."""
    cases = [make_case("tiny-gguf", SEED, i, seeds) for i in range(len(kinds("tiny-gguf")))]
    cases += [make_case("tiny-hf", SEED, i, seeds) for i in range(len(kinds("tiny-hf")))]
    assert_all_pass(run_cases(cases, seeds, FuzzConfig(tmp_path, batch_size=len(cases))))


def test_regression_corpus_ends_in_ok_or_one_line_errors(seeds, tmp_path):
    """The crashing cases of issue 10 and of fuzz runs on main (tests/fuzz_corpus/*.json: edits, replayable
    without the seed). The SmolLM2 ones (seconds each) run under ASan below."""
    cases = [case for case in load_corpus(CORPUS) if case.target != "smollm2"]
    assert len(cases) >= 25
    assert_all_pass(run_cases(cases, seeds, FuzzConfig(tmp_path, batch_size=len(cases))))


def _asan_config(tmp_path) -> FuzzConfig:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: there is no kernel to instrument")
    return FuzzConfig(tmp_path, asan=True)  # FuzzSetupError (a failure) when cc cannot build or load it


def test_asan_catches_a_deliberate_out_of_bounds_write(tmp_path):
    """Without this, 'AddressSanitizer reports nothing' would mean nothing."""
    outcome = run_canary(_asan_config(tmp_path))
    assert outcome["kind"] == "asan", outcome
    assert "heap-buffer-overflow" in outcome["message"] and "blockgemv.c" in outcome["message"]


@pytest.mark.slow
def test_heap_corruption_cases_are_clean_under_asan(seeds, tmp_path):
    cfg = _asan_config(tmp_path)
    cases = [Case.from_json(json.loads((CORPUS / f"{name}.json").read_text())) for name in ASAN_CASES]
    assert_all_pass(run_cases(cases, seeds, cfg))
