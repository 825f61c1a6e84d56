"""Seed-robust evaluation: per-seed values, mean ± spread, bootstrap intervals, passkey counts, calibration text."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.errors import KvlabError
from kvlab.quality.agreement import kl_divergence
from kvlab.quality.corpus import CALIBRATION_PLAYS, FILLER_PLAY, PLAYS, shared_spans
from kvlab.eval.needle import MIN_TRIALS, PRIME, PasskeyProtocol, key_margin, passkey_prompt, passkey_trials
from kvlab.quality.perplexity import WindowProtocol, run_window, window_nll
from kvlab.eval.plot import plot_quality
from kvlab.eval.run import EvalSettings, quality_table
from kvlab.eval.stats import WindowSums, summarize
from kvlab.eval.suite import CacheQuality, calibration_windows, corpus_windows, perplexity_suite, seed_variants

from .conftest import cli_error, tiny_model


def _sums(nll, count, kl=None, top1=None) -> WindowSums:
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return WindowSums(t(nll), t(kl or [0.0] * len(nll)), t(top1 or count), t(count))


@pytest.fixture(scope="module")
def gguf_tokenizer():
    from kvlab.model.loader import _gguf_tokenizer, default_model_path, read_model

    _, gguf_file = read_model(default_model_path())
    return _gguf_tokenizer(gguf_file)


# -- statistics ----------------------------------------------------------------------------------------

def test_per_seed_values_mean_and_spread_follow_the_window_sums():
    dense = _sums([100.0, 120.0, 90.0], [50, 50, 50])
    seed_a = _sums([101.0, 121.0, 92.0], [50, 50, 50], kl=[1.0, 2.0, 3.0], top1=[45, 40, 50])
    seed_b = _sums([103.0, 120.5, 91.0], [50, 50, 50], kl=[2.0, 2.0, 2.0], top1=[50, 50, 50])
    out = summarize([seed_a, seed_b], dense)
    expect = [100 * (math.exp((sum(s.nll.tolist()) - 310.0) / 150) - 1) for s in (seed_a, seed_b)]
    assert out["ppl_delta_pct"].per_seed == pytest.approx(expect)
    assert out["ppl_delta_pct"].mean == pytest.approx(sum(expect) / 2)
    assert out["ppl_delta_pct"].sd == pytest.approx(abs(expect[0] - expect[1]) / math.sqrt(2))
    assert out["kl"].per_seed == pytest.approx([6 / 150, 6 / 150])
    assert out["top1"].per_seed == pytest.approx([135 / 150, 1.0])
    assert out["ppl"].per_seed[0] == pytest.approx(math.exp(314 / 150))
    lo, hi = out["ppl_delta_pct"].ci
    assert lo < out["ppl_delta_pct"].mean < hi                 # windows disagree: an interval of positive width


def test_bootstrap_interval_collapses_when_every_window_agrees_and_is_paired_with_dense():
    dense = _sums([100.0, 300.0, 50.0, 80.0], [40, 40, 40, 40])
    shifted = _sums([104.0, 304.0, 54.0, 84.0], [40, 40, 40, 40])   # the same excess NLL in every window
    out = summarize([shifted], dense)
    delta = out["ppl_delta_pct"]
    assert delta.sd == 0.0 and delta.ci == pytest.approx((delta.mean, delta.mean))
    assert delta.mean == pytest.approx(100 * (math.exp(4 / 40) - 1))
    same = summarize([dense], dense)["ppl_delta_pct"]
    assert same.mean == 0.0 and same.ci == (0.0, 0.0)


def test_the_interval_is_reproducible_and_widens_with_disagreeing_windows():
    dense = _sums([100.0] * 8, [40] * 8)
    calm = _sums([101.0, 102.0] * 4, [40] * 8)
    wild = _sums([100.0, 103.0] * 4, [40] * 8)
    width = lambda s: s.ci[1] - s.ci[0]  # noqa: E731
    assert summarize([calm], dense)["ppl_delta_pct"].ci == summarize([calm], dense)["ppl_delta_pct"].ci
    assert width(summarize([wild], dense)["ppl_delta_pct"]) > width(summarize([calm], dense)["ppl_delta_pct"]) > 0


# -- seeds in the suite --------------------------------------------------------------------------------

def test_seed_variants_only_multiply_turboquant_caches_without_their_own_seed():
    assert seed_variants("tq-k4v4", (0, 1, 2)) == [(0, "tq-k4v4+seed0"), (1, "tq-k4v4+seed1"), (2, "tq-k4v4+seed2")]
    assert seed_variants("tq-k3v3+sink1", (4,)) == [(4, "tq-k3v3+sink1+seed4")]
    assert seed_variants("tq-k4v4+seed7", (0, 1)) == [(None, "tq-k4v4+seed7")]
    for name in ("dense", "int4", "int8+g8"):
        assert seed_variants(name, (0, 1, 2)) == [(None, name)]
    assert seed_variants("tq-k4v4", ()) == [(None, "tq-k4v4")]


def test_suite_reports_each_seed_and_their_mean_on_a_tiny_model():
    model = tiny_model(head_dim=0)
    protocol = WindowProtocol(length=40, prefill=8, chunk=8, n_windows=3)
    gen = torch.Generator().manual_seed(3)
    token_windows = [torch.randint(0, 97, (1, 40), generator=gen) for _ in range(3)]
    loaded = SimpleNamespace(model=model, config=model.config, dtype=torch.float32, device="cpu")
    calls = []
    records = perplexity_suite(loaded, ["int8+g8", "tq-k3v3"], protocol, lambda: calls.append(1), token_windows, seeds=(0, 1))
    dense, int8, tq3 = records
    assert len(calls) == 3 * (1 + 1 + 2)                                   # windows × (dense, int8, tq-k3v3 × 2 seeds)
    assert dense.ppl_delta_pct == 0.0 and dense.ppl_delta_ci == (0.0, 0.0) and dense.seeds == []
    assert int8.seeds == [] and len(int8.per_seed) == 1 and int8.ppl_delta_sd == 0.0
    assert tq3.seeds == [0, 1] and [p["seed"] for p in tq3.per_seed] == [0, 1]
    assert tq3.per_seed[0]["ppl"] != tq3.per_seed[1]["ppl"]                # the rotation seed matters
    assert tq3.ppl_delta_pct == pytest.approx(sum(p["ppl_delta_pct"] for p in tq3.per_seed) / 2)
    assert tq3.ppl_delta_ci[0] <= tq3.ppl_delta_ci[1] and tq3.kl_ci[0] <= tq3.kl <= tq3.kl_ci[1] + 1e-12
    # seed 1's numbers are those of the cache `tq-k3v3+seed1` computed directly
    geometry = CacheGeometry.for_model(model.config, 1, 40)
    nll, kl, n = 0.0, 0.0, 0
    for tokens in token_windows:
        reference, _ = run_window(model, tokens, lambda: make_cache("dense", geometry), protocol)
        logits, _ = run_window(model, tokens, lambda: make_cache("tq-k3v3+seed1", geometry), protocol)
        scored = window_nll(torch.cat([logits, logits[-1:]]), tokens, protocol.prefill)
        nll, n = nll + scored.sum().item(), n + scored.numel()
        kl += kl_divergence(reference, logits).sum().item()
    assert tq3.per_seed[1]["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-9)
    assert tq3.per_seed[1]["kl"] == pytest.approx(kl / n, rel=1e-9)
    record = tq3.to_json()
    assert record["per_seed"][1]["seed"] == 1 and record["seeds"] == [0, 1] and len(record["ppl_delta_ci"]) == 2


def test_table_and_plot_show_spread_interval_and_passkey_count(tmp_path):
    dense = CacheQuality("dense", 23040, 16, 30.0, 0.0, 0.0, 1.0, 1.0, 100, ppl_delta_ci=(0.0, 0.0), kl_ci=(0.0, 0.0),
                    passkey_found=9, passkey_total=9)
    tq4 = CacheQuality("tq-k4v4", 6160, 4.3, 30.9, 3.1, 0.02, 0.93, 7 / 9, 100, seeds=[0, 1, 2], ppl_delta_sd=0.6,
                  ppl_delta_ci=(2.2, 4.0), kl_ci=(0.015, 0.025), passkey_found=7, passkey_total=9,
                  passkey_margin=(2.5, -0.4))
    table = quality_table([dense, tq4])
    cells = {column.header: list(column.cells) for column in table.columns}
    assert cells["ΔPPL"][1] == "+3.10% ± 0.60" and cells["ΔPPL interval"][1] == "[+2.20, +4.00]"
    assert cells["passkey"] == ["9/9", "7/9"] and cells["seeds"] == ["1", "3"]
    assert cells["key margin"] == ["—", "2.50 / -0.40"]
    assert plot_quality([dense, tq4], tmp_path / "q.png").stat().st_size > 1000


def test_the_plot_groups_transformers_caches_apart_from_kvlabs():
    from kvlab.eval.plot import _family

    assert [_family(n) for n in ("dense", "hf:dynamic", "int4", "tq-k4v4+sink1", "hf:hqq-4+r128", "hf:quanto-int4+r0")] == [
        "dense", "dense", "int (KIVI-style)", "TurboQuant", "transformers' caches", "transformers' caches"]


# -- settings and the CLI ------------------------------------------------------------------------------

def test_default_and_quick_settings_run_at_least_nine_passkey_trials_and_three_seeds():
    full = EvalSettings.build("tq-k4v4", quick=False, windows=None, passkey=True, passkey_lengths="1000,3000,6000")
    quick = EvalSettings.build("tq-k4v4", quick=True, windows=None, passkey=True, passkey_lengths="1000,3000,6000")
    assert full.seeds == (0, 1, 2) and quick.seeds == (0,)
    assert full.passkey.trials >= MIN_TRIALS and quick.passkey.trials >= MIN_TRIALS
    assert quick.passkey.lengths == (1000,) and len(quick.passkey.depths) == 3
    assert PasskeyProtocol.covering((500, 700)).trials >= MIN_TRIALS
    chosen = EvalSettings.build("tq-k4v4", False, None, False, "1000", seeds="3, 5,3")
    assert chosen.seeds == (3, 5) and chosen.passkey is None
    wide = EvalSettings.build("tq-k4v4", False, None, True, "1000,3000,6000", passkey_repeats=3)
    assert wide.passkey.trials == 27 and wide.passkey.prime and full.passkey.prime
    unprimed = EvalSettings.build("tq-k4v4", False, None, True, "1000", passkey_prime=False)
    assert not unprimed.passkey.prime and unprimed.passkey.trials == MIN_TRIALS
    assert "--passkey-repeats" in cli_error(["eval", "--passkey-repeats", "0"])


@pytest.mark.parametrize("seeds, message", [("a,b", "comma-separated integers"), (",", "at least one seed"),
                                            ("-1", "--seeds")])
def test_bad_seeds_are_one_line_errors(seeds, message):
    with pytest.raises(KvlabError, match=message):
        EvalSettings.build("tq-k4v4", False, None, False, "1000", seeds=seeds)
    assert message in cli_error(["eval", "--seeds", seeds])


# -- passkey trials ------------------------------------------------------------------------------------

def test_passkey_trials_are_counted_over_positions_keys_and_seeds(gguf_tokenizer):
    model = tiny_model(vocab_size=gguf_tokenizer.vocab_size, max_seq_len=256, head_dim=0)
    loaded = SimpleNamespace(model=model, config=model.config, dtype=torch.float32, device="cpu", tokenizer=gguf_tokenizer)
    protocol = PasskeyProtocol.covering((40,))
    variants = seed_variants("tq-k4v4", (0, 1, 2))
    ticks = []
    trials = passkey_trials(loaded, "tq-k4v4", protocol, lambda: ticks.append(1), variants)
    assert len(trials) == len(ticks) == protocol.trials >= MIN_TRIALS
    assert [t["seed"] for t in trials] == [0, 1, 2] * (len(trials) // 3)
    assert sorted({t["depth"] for t in trials}) == [0.25, 0.5, 0.75]
    assert len({t["key"] for t in trials}) == len(trials)                    # a new key every trial
    assert all(t["found"] == (str(t["key"]) in t["answer"]) and t["answer"].startswith(PRIME) for t in trials)
    assert all(isinstance(t["key_margin"], float) and (t["key_margin"] < 0 or t["found"]) for t in trials)
    plain = passkey_trials(loaded, "tq-k4v4", PasskeyProtocol(lengths=(40,), depths=(0.5,), prime=False))
    assert plain[0]["key_margin"] is None and not plain[0]["answer"].startswith(PRIME)


def test_a_primed_passkey_prompt_asks_for_the_number_and_knows_its_tokens(gguf_tokenizer):
    primed = passkey_prompt(gguf_tokenizer, 60, 0.5, 65125)
    plain = passkey_prompt(gguf_tokenizer, 60, 0.5, 65125, prime=False)
    assert plain.key_ids is None and primed.ids[:len(plain.ids)] == plain.ids      # the same turn, opened with PRIME
    assert gguf_tokenizer.decode(primed.ids[len(plain.ids):]).strip() == PRIME
    assert gguf_tokenizer.decode(primed.key_ids) == " 65125"
    assert gguf_tokenizer.decode(primed.ids).count("65125") == 2                   # the needle's two mentions only


def test_the_key_margin_is_the_smallest_lead_while_the_answer_follows_the_key():
    def logits(scores: dict) -> torch.Tensor:
        row = torch.zeros(8)
        for token, score in scores.items():
            row[token] = score
        return row

    key = [5, 6, 7]
    steps = [logits({5: 3.0, 1: 1.0}), logits({6: 2.0, 2: 1.5}), logits({7: 4.0})]
    assert key_margin(steps, [5, 6, 7], key) == pytest.approx(0.5)                 # 2.0 - 1.5 at the second token
    left = [logits({5: 3.0, 1: 1.0}), logits({6: 1.0, 2: 2.5}), logits({7: -9.0})]
    assert key_margin(left, [5, 2, 3], key) == pytest.approx(-1.5)                 # left the key there; the rest is not read
    assert key_margin(steps[:1], [5], key) == pytest.approx(2.0)                   # an answer cut short (EOS): what it read
    assert key_margin(steps, [5, 6, 7], None) is None and key_margin([], [], key) is None


# -- calibration text ----------------------------------------------------------------------------------

def test_calibration_text_never_overlaps_the_evaluation_or_passkey_text(gguf_tokenizer):
    assert not set(CALIBRATION_PLAYS) & set(PLAYS) and FILLER_PLAY not in CALIBRATION_PLAYS
    protocol = WindowProtocol()                                             # the default 16 windows × 512 tokens
    evaluation = [w[0].tolist() for w in corpus_windows(gguf_tokenizer, protocol)]
    calibration = [w[0].tolist() for w in calibration_windows(gguf_tokenizer, protocol)]
    assert not shared_spans(evaluation, calibration)
    assert shared_spans(evaluation[:2], [evaluation[1][100:300]])           # the check does find a shared span


# -- long runs: saved as they go, progress without a terminal ------------------------------------------

def test_run_eval_checkpoints_each_stage_and_prints_plain_progress_without_a_terminal(gguf_tokenizer, monkeypatch):
    import io

    from rich.console import Console

    import kvlab.backends as backends
    from kvlab.eval import run as eval_run

    model = tiny_model(vocab_size=gguf_tokenizer.vocab_size, max_seq_len=256, head_dim=0)
    loaded = SimpleNamespace(model=model, config=model.config, dtype=torch.float32, device="cpu", tokenizer=gguf_tokenizer)
    monkeypatch.setattr(backends, "load_runtime", lambda *a, **k: backends.KvlabRuntime(loaded))
    stderr = io.StringIO()
    monkeypatch.setattr(eval_run.sys, "stderr", stderr)
    settings = EvalSettings(("int8",), WindowProtocol(length=40, prefill=8, chunk=8, n_windows=2),
                            PasskeyProtocol.covering((40,)), seeds=(0,))
    saved = []
    console = Console(file=io.StringIO(), force_terminal=False)                  # a log file, not a terminal
    records = eval_run.run_eval(settings, console, checkpoint=lambda rs: saved.append([r.to_json() for r in rs]))
    assert len(saved) == 1 + len(records) == 3                                 # perplexity, then each cache's passkey
    assert [r["passkey_total"] for r in saved[0]] == [None, None]              # perplexity pass saved before passkeys
    assert [r["passkey_total"] for r in saved[1]] == [settings.passkey.trials, None]
    assert saved[1][0]["passkey_protocol"] == "filler 40 × depths 0.25,0.5,0.75 × 3 keys, answer primed, 12 new tokens"
    assert saved[-1] == [r.to_json() for r in records]
    lines = stderr.getvalue().splitlines()
    assert "perplexity (windows × cache runs): 4/4" in " ".join(lines)         # the completed tasks are always printed
    assert any(line.startswith(f"passkey (trials × caches): {2 * settings.passkey.trials}/") for line in lines)
