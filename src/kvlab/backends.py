"""Which runtime runs the model behind `kvlab eval` and `kvlab generate`: `--backend kvlab | transformers`.
("Engine" is the serving engine, kvlab.serve.Engine; these are the two runtimes of a single sequence.)

kvlab      kvlab's Decoder (the families it implements; GGUF blocks kept native), kvlab's caches.
transformers  any causal LM transformers loads from local files (a model folder, a Hub id already in the
           local Hugging Face cache, or a GGUF file through transformers' `gguf_file` loading, which
           dequantizes the blocks exactly as kvlab does), with kvlab's caches as a transformers Cache
           (kvlab.hf.KVLabCache) beside transformers' own caches by name (`hf:dynamic`, `hf:quanto-int4+r128`,
           ...; kvlab.hf_baselines). Its reference row is `hf:dynamic`.

Both runtimes answer the same calls, so the evaluation and generation loops are the same code:
    runtime.loaded.model(tokens (B, T), cache, last_only=False) -> logits (B, T, V)
    runtime.make_cache(name, capacity)                         -> a cache with .nbytes, .length, .persistent
    runtime.bytes_per_token(name, tokens, dtype)               -> (bytes per token, bits per cached value)
`check_backend` is the one validation of the option and of the caches it is asked to hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from .cache import CacheGeometry, CacheSpec, expected_nbytes
from .errors import ConfigError, ModelFileError
from .hf_baselines import Baseline, is_baseline_name

BACKENDS = ("kvlab", "transformers")
REFERENCE = {"kvlab": "dense", "transformers": "hf:dynamic"}


def check_backend(backend: str, caches: Iterable[str] = ()) -> str:
    """The backend's canonical name, after checking every cache name it is asked to hold (one-line ConfigError)."""
    key = (backend or "").strip().lower()
    if key not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose kvlab or transformers")
    if key == "transformers":
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ConfigError("--backend transformers needs transformers: pip install 'kvlab[hf]'") from None
    for name in caches:
        cache_name(key, name)
    return key


def cache_name(backend: str, name: str) -> str:
    """`name` as the backend reports it (hf: names with their residual spelled out); one line if it cannot hold it."""
    if is_baseline_name(name):
        if backend != "transformers":
            raise ConfigError(f"cache {name!r} is one of transformers' own caches; run it with --backend transformers")
        baseline = Baseline.parse(name)
        baseline.check_installed()
        return baseline.name
    if backend == "transformers":
        from .hf import CacheFormat

        return CacheFormat.parse(name).name  # also refuses 'none' (it keeps nothing between forward passes)
    return CacheSpec.parse(name).check("torch").label  # the grammar's options, one line each


# -- kvlab's runtime ----------------------------------------------------------------------------------------

@dataclass
class KvlabRuntime:
    loaded: object                      # kvlab.model.loader.LoadedModel
    name: str = "kvlab"

    @property
    def reference(self) -> str:
        return REFERENCE[self.name]

    def make_cache(self, name: str, capacity: int):
        from .quality.calibrate import resolve
        from .model.layer_caches import model_cache

        name = resolve(name, self.loaded)  # tq-k4v4+alloc: the recipe calibrated for this model, spelled out
        # the llama family: one cache over every layer; Gemma 3 / Qwen3.5: a cache per layer kind (model/layer_caches.py)
        return model_cache(self.loaded.config, name, 1, capacity, self.loaded.dtype, self.loaded.device)

    def bytes_per_token(self, name: str, tokens: int, dtype: torch.dtype, first: int | None = None,
                        chunk: int | None = None) -> tuple[float, float]:
        """By kvlab's formula (its caches preallocate: the chunking does not matter)."""
        return formula_bytes_per_token(name, self.loaded.config, tokens, dtype)


def formula_bytes_per_token(name: str, config, tokens: int, dtype: torch.dtype) -> tuple[float, float]:
    """(bytes per token, bits per cached value) of kvlab cache `name` holding `tokens` tokens in a `dtype` run,
    by kvlab's formula for a DecoderConfig `config` (Gemma 3 / Qwen3.5: every layer kind's cache and the recurrent
    state, over the values of the attention layers' K/V)."""
    kinds = getattr(config, "layer_kinds", ())
    if "recurrent" in kinds or len(set(kinds)) > 1:
        from .model.layer_caches import LayeredCache

        per_token = LayeredCache.expected_nbytes(config, name, 1, tokens, dtype) / tokens
        values = len(config.layers_of("full", "sliding")) * config.n_kv_heads * 2 * config.head_dim
        return per_token, per_token * 8 / values
    geometry = CacheGeometry.for_model(config, batch=1, capacity=tokens)
    per_token = expected_nbytes(name, geometry, dtype, tokens) / tokens
    values = config.n_layers * config.n_kv_heads * 2 * config.head_dim
    return per_token, per_token * 8 / values


# -- transformers ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelFacts:
    """What kvlab's loops read off a model's config: its context (generate.model_context) and the K/V shapes."""

    max_seq_len: int | None
    n_layers: int
    n_kv_heads: int
    head_dim: int


class TransformersLM:
    """A transformers causal LM called the way kvlab calls its Decoder: (tokens, cache) -> logits (B, T, V)."""

    def __init__(self, hf_model):
        self.hf = hf_model
        text = hf_model.config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        context = getattr(text, "max_position_embeddings", None)
        self.config = ModelFacts(
            max_seq_len=context if isinstance(context, int) and context > 0 else None,
            n_layers=text.num_hidden_layers,
            n_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        )

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, cache: "TransformersCache", last_only: bool = False) -> torch.Tensor:
        out = self.hf(input_ids=tokens, cache=cache.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        return out.logits                                                # (B, T, V) or (B, 1, V)


class TransformersCache:
    """A transformers Cache (KVLabCache or one of transformers' own) as kvlab's loops drive it.

    Neither kind has a capacity: `geometry.capacity` is the bound the loops check, the model's context.
    """

    persistent = True

    def __init__(self, name: str, cache, geometry: CacheGeometry):
        self.name, self.cache, self.geometry = name, cache, geometry

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def nbytes(self) -> int:
        """KVLabCache: kvlab's own count; transformers' caches: every tensor the object holds."""
        from .hf import KVLabCache
        from .hf_baselines import held_nbytes

        return self.cache.nbytes if isinstance(self.cache, KVLabCache) else held_nbytes(self.cache)


@dataclass
class TransformersLoaded:
    """LoadedModel's fields for a transformers model: the adapter, kvlab's tokenizer for the same files."""

    model: TransformersLM
    tokenizer: object
    config: ModelFacts
    path: Path
    dtype: torch.dtype
    device: torch.device
    weights: str = "dense"              # transformers dequantizes a GGUF's blocks when it loads them


@dataclass
class TransformersRuntime:
    loaded: TransformersLoaded
    name: str = "transformers"

    @property
    def reference(self) -> str:
        return REFERENCE[self.name]

    def make_cache(self, name: str, capacity: int) -> TransformersCache:
        """`capacity`: the tokens the caller will put in; a KVLabCache starts there (so its bytes are kvlab's
        formula at that capacity) and grows past it."""
        from .hf import KVLabCache

        hf_config = self.loaded.model.hf.config
        if is_baseline_name(name):
            baseline = Baseline.parse(name)
            cache = baseline.build(hf_config)
            name = baseline.name
        else:
            cache = KVLabCache.from_name(name, hf_config, initial_capacity=capacity)
        context = self.loaded.config.max_seq_len or max(capacity, 1)
        facts = self.loaded.config
        geometry = CacheGeometry(n_layers=facts.n_layers, n_kv_heads=facts.n_kv_heads, head_dim=facts.head_dim,
                                 capacity=context)
        return TransformersCache(name, cache, geometry)

    def bytes_per_token(self, name: str, tokens: int, dtype: torch.dtype, first: int | None = None,
                        chunk: int | None = None) -> tuple[float, float]:
        """Measured: `tokens` zero K/V of `dtype` written into every attention layer of a fresh cache (`first`
        tokens, then chunks of `chunk`, as the evaluation feeds them: a residual's fill depends on it), plus the
        recurrent layers' state after one token of the model (Qwen3.5's Gated DeltaNet: transformers' tensors, in
        the model's dtype), bytes per token. The same walk for every cache (a KVLabCache's nbytes is kvlab's formula,
        tested)."""
        from transformers.cache_utils import CacheLayerMixin

        facts = self.loaded.config
        handle = self.make_cache(name, tokens)
        attention = [i for i, layer in enumerate(handle.cache.layers) if isinstance(layer, CacheLayerMixin)]
        first = min(first or tokens, tokens)
        sizes = [first] + [min(chunk or tokens, tokens - s) for s in range(first, tokens, chunk or tokens)]
        for n in sizes:
            for layer in attention:
                k, v = (torch.zeros(1, facts.n_kv_heads, n, facts.head_dim, dtype=dtype, device=self.loaded.device)
                        for _ in range(2))                                  # (B, Hkv, T, D), separate storages
                handle.cache.update(k, v, layer)
        per_token = (handle.nbytes + self._state_nbytes(name)) / tokens
        values = len(attention) * facts.n_kv_heads * 2 * facts.head_dim
        return per_token, per_token * 8 / values

    def _state_nbytes(self, name: str) -> int:
        """Bytes of the recurrent layers' state of cache `name` after one token (0: no recurrent layer)."""
        from transformers.cache_utils import CacheLayerMixin

        from .hf_baselines import held_nbytes

        handle = self.make_cache(name, 1)
        if all(isinstance(layer, CacheLayerMixin) for layer in handle.cache.layers):
            return 0
        self.loaded.model(torch.zeros(1, 1, dtype=torch.long, device=self.loaded.device), handle)
        return sum(held_nbytes(layer) for layer in handle.cache.layers if not isinstance(layer, CacheLayerMixin))


def resolve_model_path(model: str | None) -> Path:
    """A local file or folder, a Hub id already in the local Hugging Face cache, or the bundled SmolLM2 GGUF."""
    from .model.loader import default_model_path

    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.count("/") == 1 and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the local cache (nothing is downloaded)
            raise ModelFileError(f"{model}: no such file or folder, and no local Hugging Face cache copy of that id "
                                 "(kvlab loads local files only)") from None
    raise ModelFileError(f"{path}: no such file or folder")


def load_transformers(model: str | None, dtype: torch.dtype = torch.float32, device: str = "cpu") -> TransformersLoaded:
    """A transformers causal LM from local files, and kvlab's tokenizer for the same files."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from .hf import read_queries
    from .model.loader import _gguf_tokenizer
    from .model.tokenizer import Tokenizer
    from .sources.gguf import open_gguf

    path = resolve_model_path(model)
    hf_logging.disable_progress_bar()   # transformers' loading bars; kvlab prints its own progress
    previous = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"    # and the GGUF conversion's plain tqdm bar
    try:
        if path.is_dir():
            hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
            tokenizer = Tokenizer.from_folder(path)
        else:
            tokenizer = _gguf_tokenizer(open_gguf(path))
            hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                            local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        message = " ".join(str(error).split())
        raise ModelFileError(f"{path}: transformers cannot load it ({type(error).__name__}: {message[:200]})") from None
    finally:
        if previous is None:
            del os.environ["TQDM_DISABLE"]
        else:
            os.environ["TQDM_DISABLE"] = previous
    hf_model = hf_model.to(device).eval()
    read_queries(hf_model)              # TurboQuant's key weights from the queries, as kvlab's runtime
    adapter = TransformersLM(hf_model)
    return TransformersLoaded(adapter, tokenizer, adapter.config, path, dtype, torch.device(device))


def load_runtime(backend: str, model: str | None, dtype: str = "fp32", device: str = "cpu", weights: str = "auto"):
    """The runtime for `backend` (already checked) with its model loaded (once per process for kvlab)."""
    from .model.loader import cached_model, parse_dtype

    if backend == "kvlab":
        return KvlabRuntime(cached_model(model, dtype, device, weights))
    if weights not in ("auto", "dense"):
        raise ConfigError(f"--weights {weights} is kvlab's; transformers dequantizes the weights (use auto or dense)")
    from .limits import check_device

    check_device(device)
    return TransformersRuntime(load_transformers(model, parse_dtype(dtype), device))
