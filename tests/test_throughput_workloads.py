"""The seeded workloads of `kvlab bench throughput`: the same requests every run, sized as documented."""

from __future__ import annotations

import pytest

from kvlab.bench.throughput import SIZES, workload
from kvlab.errors import ConfigError


class CountingTokenizer:
    """A stand-in tokenizer: one id per character (the workloads only slice token windows)."""

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        return [ord(c) % 1000 for c in text]


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("name", sorted(SIZES))
def test_independent_workloads_are_seeded_and_in_range(name, quick):
    count, (p_lo, p_hi), (o_lo, o_hi) = SIZES[name][quick]
    requests = workload(name, CountingTokenizer(), quick)
    assert len(requests) == count
    assert all(p_lo <= len(r.prompt) <= p_hi and o_lo <= r.max_tokens <= o_hi for r in requests)
    again = workload(name, CountingTokenizer(), quick)
    assert [(r.prompt, r.max_tokens) for r in again] == [(r.prompt, r.max_tokens) for r in requests]
    assert workload(name, CountingTokenizer(), quick, seed=1)[0].prompt != requests[0].prompt


def test_chat_is_decode_bound_and_shared_shares_its_prefix():
    chat = workload("chat", CountingTokenizer(), quick=False)
    assert sum(r.max_tokens for r in chat) > sum(len(r.prompt) for r in chat)
    reach = [len(r.prompt) + r.max_tokens for r in workload("long-decode", CountingTokenizer(), quick=False)]
    assert all(2048 <= n <= 3584 for n in reach)                  # contexts of 2k-4k tokens, 512 of them decoded
    shared = workload("shared", CountingTokenizer(), quick=True)
    assert len({tuple(r.prompt[:200]) for r in shared}) == 1


def test_an_unknown_workload_is_one_line():
    with pytest.raises(ConfigError, match="unknown workload 'batch'; choose mixed, shared, chat, long or long-decode"):
        workload("batch", CountingTokenizer(), quick=True)
