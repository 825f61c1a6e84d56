"""Engine: continuous batching over one block pool. add_request · step · abort · generate.

Each step is three lines: the scheduler picks tokens (decodes of every running sequence, prefill chunks
under the token budget), the runner runs them as one batch, the scheduler records the results. The
engine adds what a caller sees: request ids, stop conditions, text deltas, logprobs and stats.
A request with n > 1 choices is one sequence until its prompt is prefilled; its first sample draws n
tokens from that row and n - 1 forks of it (the block manager's fork: the prompt's blocks shared,
copied on write) go on as sequences of their own, so the prompt is prefilled once.
The Engine is not thread-safe: one thread owns it and calls step().
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from ..cache import CacheGeometry, CacheSpec
from ..cache.capacity import LayerGroups
from ..errors import ConfigError, KvlabError, RequestTooLargeError, StoreFileError
from ..limits import parse_size
from ..model.layer_caches import RecurrentState
from .blocks import BlockManager, CapacityPlan
from .coded import make_pool
from .grammar import GrammarState, GrammarTokenizer
from .kv_store import (KVStore, Snapshot, StoredFile, block_bytes, check_servable, fill_parts, parts_bytes, read_file,
                       store_identity)
from .runner import Runner
from .sampling import Draw, SamplingParams, TextStream, TokenCounts
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .state_slots import StateSlots

#: why a model with recurrent layers serves without prefix caching (logged, in the stats, in docs/serve.md)
PREFIX_OFF_RECURRENT = ("prefix caching is off for models with recurrent layers: a cached prefix's K/V blocks do not "
                        "hold the recurrent state after it, so every prompt is prefilled from its first token")


@dataclass
class RequestOutput:
    """One per request that changed in a step."""

    request_id: str
    new_token_ids: list[int]       # tokens produced this step (usually 1; 0 when just finished by abort)
    text_delta: str                # newly decoded text (UTF-8 safe, stop strings removed)
    finished: bool                 # this choice has ended
    finish_reason: str | None      # "stop" (EOS / stop id / stop string) | "length" | "abort" | None
    prompt_tokens: int
    cached_prompt_tokens: int      # prompt tokens served from the prefix cache
    completion_tokens: int         # tokens this choice generated so far
    index: int = 0                 # which choice (0 .. n - 1)
    all_finished: bool = False     # every choice of the request has ended: nothing more will come
    logprobs: list[Draw] | None = None   # with sampling.logprobs set: one Draw per new token


@dataclass
class EngineStats:
    """A snapshot, cheap to take."""

    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_free: int               # not referenced by any sequence (cached blocks included)
    block_size: int
    kv_bytes_total: int
    kv_bytes_used: int
    prefix_queries_tokens: int
    prefix_hit_tokens: int         # hit rate = hit / queried
    prompt_tokens: int
    generated_tokens: int
    preemptions: int
    steps: int
    computed_tokens: int = 0       # tokens run through the model (prefill chunks, recomputes and decodes)
    kv_bytes_peak: int = 0         # the most kv_bytes_used has been
    state_bytes_total: int = 0     # the recurrent layers' state slots (max_batch of them; 0 without recurrent layers)
    prefix_caching: bool = True    # False when asked off, or switched off for recurrent layers (Engine.prefix_caching_off)


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_prompt_tokens: int = 0


def _with_recipe(cache: str, loaded) -> str:
    """`tq4+halloc`: the recipe calibrated for the loaded model spelled out (eval/calibrate.resolve, from disk after the
    first time); any other name as it is."""
    if not CacheSpec.parse(str(cache), "pool").compressed:
        return cache
    from ..quality.calibrate import resolve                  # the calibration (and the corpus) load for compressed names only

    return resolve(str(cache), loaded)


def capacity_for(config, cache: str, kv_budget: int | str, block_size: int = 16, max_batch: int = 16,
                 step_tokens: int = 512, free_window: bool = True) -> CapacityPlan:
    """What `kv_budget` buys the engine for a model of `config` (DecoderConfig): its attention layers' blocks in layer
    groups (sliding groups freeing blocks behind the window unless `free_window` is off) and, for recurrent layers,
    a state slot per batch row. The planner's `--engine kvlab --kv-budget` builds the same plan from the model file."""
    groups = LayerGroups.build(config.layer_kinds, config.sliding_window, free_window)
    if len(set(config.layer_kinds)) > 1:                # Gemma 3, Qwen3.5: what CacheSpec.supports allows
        CacheSpec.parse(str(cache), "pool").check("layered-pool")
    state = RecurrentState.expected_nbytes(config, 1) if config.layers_of("recurrent") else 0
    return CapacityPlan.build(CacheGeometry.for_model(config), cache, kv_budget, block_size, max_batch, groups, state,
                              step_tokens)


class Engine:
    def __init__(self, model, tokenizer=None, *, cache: str = "dense", kv_budget: int | str = "512MiB",
                 max_batch: int = 16, block_size: int = 16, max_step_tokens: int = 512, prefix_caching: bool = True,
                 use_kernel: bool = True, free_window: bool = True, kv_store: str | None = None,
                 kv_store_bytes: int | str = "4GiB"):
        if hasattr(model, "tokenizer") and hasattr(model, "model"):     # a LoadedModel
            tokenizer = tokenizer if tokenizer is not None else model.tokenizer
            cache = _with_recipe(cache, model)
            model = model.model
        for name, value in (("max_batch", max_batch), ("max_step_tokens", max_step_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if max_step_tokens < max_batch:
            raise ConfigError(f"max_step_tokens ({max_step_tokens}) must be at least max_batch ({max_batch}): "
                              "every running sequence decodes a token each step")
        self.model, self.tokenizer = model, tokenizer
        self.config = model.config
        device = next(model.parameters()).device
        cfg = self.config
        self.capacity = capacity_for(cfg, cache, kv_budget, block_size, max_batch, max_step_tokens, free_window)
        self.groups = self.capacity.groups
        recurrent = bool(cfg.layers_of("recurrent"))
        geometry = replace(CacheGeometry.for_model(cfg), n_layers=self.groups.size)
        self.pool = make_pool(geometry, self.capacity, device, model, tokenizer)
        self.state = StateSlots(cfg, max_batch, device) if recurrent else None
        #: why prefix caching is off though asked for (None: it runs as asked)
        self.prefix_caching_off = PREFIX_OFF_RECURRENT if recurrent and prefix_caching else None
        self.store = None                                # the prefix cache on disk (kv_store.py)
        if kv_store is not None:
            check_servable(cfg, self.pool, prefix_caching, len(self.groups.windows))
            self.store = KVStore(kv_store, store_identity(model, self.pool, block_size), self.pool,
                                 parse_size(kv_store_bytes, "--kv-store-max", "8GiB"))
        self.blocks = BlockManager(self.capacity.n_blocks, block_size, prefix_caching and not recurrent,
                                   on_copy=self.pool.copy_block, on_free=self._release, on_fork=self._fork_state,
                                   prefix_state=getattr(self.pool, "holds_prefix_state", None),
                                   windows=self.groups.windows,
                                   window_caps=tuple(w and self.capacity.window_blocks(w) for w in self.groups.windows),
                                   root=self.store.identity.root if self.store else b"", store=self.store)
        self.scheduler = Scheduler(self.blocks, max_batch, max_step_tokens)
        self.runner = Runner(model, self.pool, use_kernel, groups=self.groups, state=self.state)
        self.eos_ids = tuple(tokenizer.eos_ids) if tokenizer is not None else ()
        self.grammar_tokenizer = GrammarTokenizer(tokenizer) if tokenizer is not None else None   # built on first use
        self.requests: dict[str, list[Sequence]] = {}    # request id -> its live choices
        self._aborted: list[RequestOutput] = []
        self._ids = itertools.count()
        self._counts = dict(prompt_tokens=0, generated_tokens=0, steps=0, computed_tokens=0, kv_bytes_peak=0)
        self.last_tokens: list[int] = []                 # the computed tokens of the choice that finished last

    def _release(self, seq: Sequence) -> None:
        """The sequence holds no blocks any more: its per-sequence pool rows and state slot go back."""
        self.pool.release(seq)
        if self.state is not None:
            self.state.release(seq)

    def _fork_state(self, parent: Sequence, child: Sequence) -> None:
        self.pool.fork(parent, child)
        if self.state is not None:
            self.state.fork(parent, child)

    @property
    def pool_nbytes(self) -> int:
        """Every byte the engine holds for sequences: the blocks, the pool's shared and per-sequence rows, and the
        recurrent state slots (= capacity.pool_bytes, the planner's number)."""
        return self.pool.nbytes + (self.state.nbytes if self.state is not None else 0)

    @classmethod
    def from_model_path(cls, path=None, *, dtype: str = "fp32", device: str = "cpu", weights: str = "auto", **kw) -> "Engine":
        """Load a model like `kvlab generate` does (default: the embedded SmolLM2) and serve it."""
        from ..session import cached_model

        return cls(cached_model(None if path is None else str(path), dtype, device, weights), **kw)

    # -- requests -----------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ConfigError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        ids = list(prompt_ids)
        vocab = self.config.vocab_size
        if not ids:
            raise ConfigError("prompt must hold at least one token id")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ConfigError(f"prompt token ids must be integers in [0, {vocab})")
        if sampling.n > self.scheduler.max_batch:
            raise ConfigError(f"n={sampling.n} choices exceed the {self.scheduler.max_batch} sequences decoded together")
        total = len(ids) + sampling.max_tokens
        if total > self.config.max_seq_len:
            raise RequestTooLargeError(f"request of {len(ids)} prompt + {sampling.max_tokens} new tokens exceeds the "
                                       f"model's context of {self.config.max_seq_len} tokens")
        if total > self.capacity.tokens:
            raise RequestTooLargeError(f"request of {len(ids)} prompt + {sampling.max_tokens} new tokens exceeds the KV pool "
                                       f"of {self.capacity.tokens} tokens ({self.capacity.n_blocks} blocks of "
                                       f"{self.capacity.block_size}); raise kv_budget")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        grammar = None
        if sampling.grammar is not None:
            if self.grammar_tokenizer is None:
                raise ConfigError("a grammar needs the engine's tokenizer")
            grammar = GrammarState(sampling.grammar, self.grammar_tokenizer)
        seq = Sequence(request_id, ids, sampling, generator=sampling.generator(self.runner.device),
                       text=self._text_stream(sampling), pending_forks=sampling.n - 1,
                       counts=TokenCounts(vocab, ids, self.runner.device) if sampling.counts_tokens else None,
                       grammar=grammar)
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)
        self._counts["prompt_tokens"] += len(ids)
        return request_id

    def _text_stream(self, sampling: SamplingParams) -> TextStream | None:
        return TextStream(self.tokenizer, sampling.stop) if self.tokenizer is not None else None

    def abort(self, request_id: str) -> None:
        """Free the request's blocks now; the next step() reports each choice finished with reason "abort"."""
        choices = self.requests.pop(str(request_id), None)
        for i, seq in enumerate(choices or ()):
            self.scheduler.remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
            self._aborted.append(self._output(seq, [], seq.text.flush() if seq.text else "",
                                              all_finished=i == len(choices) - 1))

    @property
    def max_request_tokens(self) -> int:
        """The most prompt + new tokens one request may ask for: the model's context or the whole pool, the less."""
        return min(self.config.max_seq_len, self.capacity.tokens)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted)

    # -- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        draws = self.runner.run(batch)
        self.scheduler.update(batch, [None if d is None else d[0].token for d in draws])
        sampled = [(chunk.seq, d[0]) for chunk, d in zip(batch, draws) if d is not None]
        for chunk, d in zip(batch, draws):
            if d is not None and len(d) > 1:
                sampled += self._fork(chunk.seq, d[1:])
        return self._after_step(batch, sampled)

    def _fork(self, parent: Sequence, draws: list[Draw]) -> list[tuple[Sequence, Draw]]:
        """The parent's other choices, forked now that its prompt is in the pool: each shares the parent's blocks
        (copied on write) and takes its own first token from the same logits."""
        children = []
        for k, draw in enumerate(draws, start=1):
            sampling = parent.sampling
            seed = None if sampling.seed is None else sampling.seed + k
            child = Sequence(parent.request_id, [], sampling, n_prompt=parent.n_prompt, index=parent.index + k,
                             generator=None if seed is None else torch.Generator(self.runner.device).manual_seed(seed),
                             text=self._text_stream(sampling), status=Status.RUNNING, admissions=1,
                             cached_prompt_tokens=parent.cached_prompt_tokens,
                             counts=parent.counts.copy() if parent.counts is not None else None,   # before its token
                             grammar=parent.grammar.copy() if parent.grammar is not None else None)
            self.blocks.fork(parent, child)                  # its token ids, block table, computed count
            child.token_ids[-1] = draw.token                 # its own first token, not the parent's
            self.scheduler.running.append(child)
            self.requests[parent.request_id].append(child)
            children.append((child, draw))
        parent.pending_forks = 0
        return children

    def _after_step(self, batch, sampled: list[tuple[Sequence, Draw]]) -> list[RequestOutput]:
        """Stop conditions and outputs of the sequences that got a token; counters."""
        outputs, self._aborted = self._aborted, []
        self._counts["steps"] += 1
        self._counts["computed_tokens"] += sum(c.n_tokens for c in batch)
        self._counts["kv_bytes_peak"] = max(self._counts["kv_bytes_peak"], self.blocks.n_used * self.capacity.block_bytes)
        for seq, draw in sampled:
            token = draw.token
            self._counts["generated_tokens"] += 1
            if seq.counts is not None:
                seq.counts.add(token)
            if seq.grammar is not None:
                seq.grammar.consume(token)
            delta, hit_stop = seq.text.push(token) if seq.text is not None else ("", False)
            if hit_stop or (token in self.eos_ids and not seq.sampling.ignore_eos) or token in seq.sampling.stop_token_ids \
                    or (seq.grammar is not None and seq.grammar.done):   # the grammar's output is complete
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= seq.sampling.max_tokens:
                seq.finish_reason = "length"
            last = False
            if seq.finish_reason is not None:
                delta += seq.text.flush() if seq.text is not None and not hit_stop else ""
                self._finished(seq)
                seq.status = Status.FINISHED
                self.scheduler.remove(seq)
                last = self._forget(seq)
            logprobs = [draw] if seq.sampling.logprobs is not None else None
            outputs.append(self._output(seq, [token], delta, all_finished=last, logprobs=logprobs))
        return outputs

    def _finished(self, seq: Sequence) -> None:
        """Before its blocks are freed: remember its tokens (POST /kv/save's default) and store its full blocks."""
        self.last_tokens = seq.token_ids[:seq.num_computed]
        if self.store is not None:
            blocks = [self.blocks.blocks[b] for b in seq.block_table[:seq.num_hashed]]
            self.store.save([(b.key, b.token_ids, b.id) for b in blocks], self._prefix_state(seq.token_ids))

    # -- conversations saved and restored on request (POST /kv/save, /kv/restore) ------------------------
    def _prefix_state(self, token_ids) -> bytes | None:
        """The bytes of what the pool keeps per prefix besides its blocks (+sinkN rows: b"" for other pools), None if
        it does not hold them for these tokens now."""
        parts = self.pool.prefix_state_parts(token_ids) if hasattr(self.pool, "prefix_state_parts") else []
        return None if parts is None else parts_bytes(parts)

    def snapshot_prefix(self, token_ids: list[int]) -> Snapshot:
        """The full blocks of `token_ids` the prefix cache holds now, copied out of the pool (write it off the
        engine thread: Snapshot.write)."""
        self._need_store()
        state = self._prefix_state(token_ids)
        held = self.blocks.cached_prefix(token_ids) if state is not None else []
        blocks = [block_bytes(self.pool, b.id) for b in held]
        return Snapshot(self.store.identity, list(token_ids[:len(held) * self.blocks.block_size]),
                        [state, *blocks] if held and self.store.identity.state_parts else blocks)

    def read_saved(self, path) -> StoredFile:
        """A saved conversation's file, checked (StoreFileError, one line); safe off the engine thread."""
        self._need_store()
        stored = read_file(path, self.store.identity)
        if not stored.first:
            raise StoreFileError(f"{path}: holds blocks from the middle of a conversation")
        return stored

    def restore_prefix(self, stored: StoredFile) -> int:
        """Put the blocks of a file read by `read_saved` into the prefix cache (those it lacks, while free blocks
        last) with the pool's prefix state; returns the tokens it now holds of them."""
        tokens, bs, nbytes = stored.tokens, self.blocks.block_size, self.store.identity.block_nbytes
        if stored.state_at is not None:
            parts = self.pool.prefix_state_parts(tokens, adopt=True)
            if parts is None:                            # every entry is in use by a running sequence
                return 0
            fill_parts(parts, stored.data, stored.state_at)
        at, key = {}, self.blocks.root
        for i in range(len(tokens) // bs):
            key = self.blocks.chain_key(key, tuple(tokens[i * bs:(i + 1) * bs]))
            at[key] = stored.blocks_at + i * nbytes
        pool = self.pool

        class Saved:                                     # hold_prefix's source: the file's blocks
            has = at.__contains__

            @staticmethod
            def load(key, parent_key, ids, block) -> bool:
                fill_parts(pool.block_parts(block), stored.data, at[key])
                return True

        held = self.blocks.hold_prefix(tokens, len(tokens) // bs, Saved)
        self.blocks.release(held)
        return len(held) * bs

    def _need_store(self) -> None:
        if self.store is None:
            raise ConfigError("saving and restoring KV needs the server started with --kv-store DIR")

    def close(self) -> None:
        """Write what the store still has queued (at shutdown)."""
        if self.store is not None:
            self.store.close()

    def _forget(self, seq: Sequence) -> bool:
        """Drop a finished choice; True if it was its request's last one."""
        choices = self.requests.get(seq.request_id, [])
        if seq in choices:
            choices.remove(seq)
        if choices or seq.pending_forks:
            return False
        self.requests.pop(seq.request_id, None)
        return True

    def _output(self, seq: Sequence, new: list[int], delta: str, all_finished: bool = False,
                logprobs: list[Draw] | None = None) -> RequestOutput:
        return RequestOutput(seq.request_id, new, delta, seq.finished, seq.finish_reason, seq.n_prompt,
                             seq.cached_prompt_tokens, len(seq.output_ids), seq.index, all_finished, logprobs)

    def stats(self) -> EngineStats:
        s, b, c = self.scheduler, self.blocks, self._counts
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting), blocks_total=b.n_blocks, blocks_used=b.n_used,
            blocks_free=b.n_free, block_size=b.block_size, kv_bytes_total=self.pool.nbytes,
            kv_bytes_used=b.n_used * self.capacity.block_bytes, prefix_queries_tokens=s.prefix_query_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens, prompt_tokens=c["prompt_tokens"], generated_tokens=c["generated_tokens"],
            preemptions=s.preemptions, steps=c["steps"], computed_tokens=c["computed_tokens"], kv_bytes_peak=c["kv_bytes_peak"],
            state_bytes_total=self.state.nbytes if self.state is not None else 0, prefix_caching=b.prefix_caching)

    # -- offline use --------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = True) -> list[GenerationOutput]:
        """Run every prompt to the end (continuous batching); results in the prompts' order."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if any(p is not None and p.n > 1 for p in params):
            raise ConfigError("generate() returns one text per prompt: give n > 1 choices to add_request")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.add_request(prompt, p))
        except KvlabError:
            for rid in ids:                          # all or nothing: no half-submitted batch left behind
                self.abort(rid)
            self._aborted = [o for o in self._aborted if o.request_id not in ids]
            raise
        prompt_of = dict(zip(ids, prompts))
        tokens = {i: [] for i in ids}
        texts = {i: [] for i in ids}
        results: dict[str, GenerationOutput] = {}
        with _progress(progress, len(ids)) as bar:
            while self.has_unfinished():
                for out in self.step():
                    if out.request_id not in tokens:
                        continue
                    tokens[out.request_id] += out.new_token_ids
                    texts[out.request_id].append(out.text_delta)
                    if out.finished:
                        results[out.request_id] = GenerationOutput(
                            out.request_id, list(prompt_of[out.request_id]), tokens[out.request_id],
                            "".join(texts[out.request_id]), out.finish_reason, out.cached_prompt_tokens)
                        bar.advance(self.stats())
        return [results[i] for i in ids]


class _progress:
    """A rich progress bar over finished requests with generated tokens/s (nothing when off)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.fields[info]}"), transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("generate", total=self.total, info="")
            self.start = _now()
        return self

    def advance(self, stats: EngineStats) -> None:
        if self.enabled:
            rate = stats.generated_tokens / max(_now() - self.start, 1e-9)
            self.bar.update(self.task, advance=1, info=f"{rate:.1f} tokens/s · {stats.running} running")

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
        return False


def _now() -> float:
    import time

    return time.perf_counter()
