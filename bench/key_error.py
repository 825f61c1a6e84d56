"""Where TurboQuant's key error comes from: key-only attention KL on real SmolLM2 queries and keys.

    .venv/bin/python bench/key_error.py      # writes bench/results/key_error.json

Four windows of the compression protocol (Shakespeare, 512 tokens each) run through the dense model
once; every layer's post-RoPE queries and keys are kept. Each key coder then stores one layer's keys
as a cache would — the 64-token prefill first (read by its own queries, so calibrations that need
queries get them), then the rest — and the score is the mean KL between the attention rows over exact
keys and over the coded keys (values exact, causal, query positions 64…511), averaged over KV heads
and windows and summed over the 30 layers. It isolates the keys: the full suite (`compression.py`)
measures what reaches the next-token distribution.

Coders: kvlab caches by name (their keys only), plus a full 64×64 per-head "whitening" transform
before the rotation (the matrix-valued version of the key channel weights) with statistics from the
prefill or, as an upper bound nobody could deploy, from the whole window.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvlab.cache import CacheGeometry, DenseCache, make_cache  # noqa: E402
from kvlab.cache.rotation import Rotation  # noqa: E402
from kvlab.cache.tq_codec import RotatedCodes  # noqa: E402
from kvlab.quality.perplexity import WindowProtocol  # noqa: E402
from kvlab.eval.suite import corpus_windows  # noqa: E402
from kvlab.fileio import write_json  # noqa: E402
from kvlab.session import cached_model  # noqa: E402

OUT = ROOT / "bench" / "results" / "key_error.json"
WINDOWS = (0, 5, 10, 15)
PREFILL = 64
CACHES = ["tq4+center=none+kweights=none", "tq4+kweights=none", "tq4", "tq4+sink1", "tq5+kweights=none", "int4"]


class CapturingCache(DenseCache):
    """A dense cache that also keeps each layer's keys (B, Hkv, T, D) and queries (B, H, T, D)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.keys: dict[int, torch.Tensor] = {}
        self.queries: dict[int, torch.Tensor] = {}

    def append(self, layer, k, v):
        self.keys[layer] = k.clone()
        super().append(layer, k, v)

    def attend(self, layer, q):
        self.queries[layer] = q.clone()
        return super().attend(layer, q)


def attention_kl(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor) -> float:
    """Mean KL(p || p̂) of causal attention rows, q (H, T, D) grouped over k (Hkv, T, D); rows ≥ PREFILL."""
    H, T, D = q.shape
    qg = q.reshape(k.shape[0], -1, T, D)                                    # (Hkv, G, T, D)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    logp = [(qg @ keys[:, None].transpose(-1, -2) / D ** 0.5).masked_fill(~mask, float("-inf")).log_softmax(-1)
            for keys in (k, k_hat)]                                          # (Hkv, G, T, T) each
    kl = (logp[0].exp() * (logp[0] - logp[1]).nan_to_num(0.0)).sum(-1)       # (Hkv, G, T)
    return kl[..., PREFILL:].mean().item()


def cache_keys(name: str, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The keys (Hkv, T, D) as cache `name` stores them: prefill appended and read, then the rest."""
    H, T, D = q.shape
    cache = make_cache(name, CacheGeometry(n_layers=1, n_kv_heads=k.shape[0], head_dim=D, capacity=T, n_heads=H))
    cache.append(0, k[None, :, :PREFILL], k[None, :, :PREFILL])
    cache.attend(0, q[None, :, :PREFILL])
    cache.append(0, k[None, :, PREFILL:], k[None, :, PREFILL:])
    return cache.dequantized(0)[0][0]


def whitened_keys(q: torch.Tensor, k: torch.Tensor, stats_tokens: int, bits: int = 4) -> torch.Tensor:
    """Keys coded as TurboQuant codes of A(k-μ), A = B^½ with B the matrix minimizing tr(BΣk)·tr(B⁻¹Σq)."""
    D = k.shape[-1]
    rotation, codes = Rotation(D, 1), RotatedCodes(D, bits)
    out = torch.empty_like(k)
    for h in range(k.shape[0]):
        mu = k[h, :PREFILL].mean(0)
        centered = k[h] - mu                                                   # (T, D)
        qs = q.reshape(k.shape[0], -1, *q.shape[1:])[h, :, :stats_tokens].reshape(-1, D).double()
        ks = centered[:stats_tokens].double()
        eye = torch.eye(D, dtype=torch.float64)
        sigma_q, sigma_k = qs.T @ qs / len(qs), ks.T @ ks / len(ks)
        sigma_q, sigma_k = sigma_q + 1e-6 * eye * sigma_q.trace() / D, sigma_k + 1e-6 * eye * sigma_k.trace() / D
        root_k, inv_root_k = _sqrtm(sigma_k)
        middle, _ = _sqrtm(root_k @ sigma_q @ root_k)
        a, a_inv = _sqrtm(inv_root_k @ middle @ inv_root_k)
        x = centered @ a.float().T                                             # (T, D)
        norm = x.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        _, y_hat = codes.encode(rotation.apply(x) / norm)
        x_hat = rotation.invert(y_hat / y_hat.norm(dim=-1, keepdim=True)) * norm.half().float()
        out[h] = x_hat @ a_inv.float().T + mu
    return out


def _sqrtm(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M^½, M^-½) of a symmetric positive definite matrix."""
    e, v = torch.linalg.eigh(m)
    e = e.clamp_min(1e-12)
    return (v * e.sqrt()) @ v.T, (v * e.rsqrt()) @ v.T


def main() -> None:
    torch.set_num_threads(1)
    loaded = cached_model(None, "fp32", "cpu")
    windows = corpus_windows(loaded.tokenizer, WindowProtocol())
    coders = {name: (lambda q, k, name=name: cache_keys(name, q, k)) for name in CACHES}
    coders["tq4 + 64×64 whitening (prefill statistics)"] = lambda q, k: whitened_keys(q, k, PREFILL)
    coders["tq4 + 64×64 whitening (whole-window statistics)"] = lambda q, k: whitened_keys(q, k, q.shape[1])
    totals = {name: 0.0 for name in coders}
    n_layers = loaded.config.n_layers
    for w in WINDOWS:
        tokens = windows[w]
        cache = CapturingCache(CacheGeometry.for_model(loaded.config, 1, tokens.shape[1]))
        with torch.no_grad():
            loaded.model(tokens, cache)
        for layer in range(n_layers):
            q, k = cache.queries[layer][0].float(), cache.keys[layer][0].float()
            for name, code in coders.items():
                totals[name] += attention_kl(q, k, code(q, k)) / len(WINDOWS)
        print(f"window {w} done", flush=True)
    reference = totals["tq4+kweights=none"]
    rows = [{"coder": name, "attention_kl_sum_over_layers": round(v, 4), "vs_tq4_without_weights": round(v / reference, 3)}
            for name, v in totals.items()]
    for row in rows:
        print(f"{row['coder']:50s} {row['attention_kl_sum_over_layers']:8.4f}  {row['vs_tq4_without_weights']:.2f}×")
    write_json(OUT, {"what": __doc__.splitlines()[0], "windows": WINDOWS, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
