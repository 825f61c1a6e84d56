"""Experiment 3: the seed's record table. One GPT, n_kv_head ∈ {8, 4, 2, 1}, trained the same short way.

The lab GPT is kvlab's own decoder (RMSNorm, RoPE, SwiGLU) at d_model 256 with 8 query heads
(head_dim 32); only n_kv_head changes, so 8 = MHA, 4 and 2 = GQA, 1 = MQA. Every variant trains
on the same byte stream (corpus.py), with the same batches, steps, learning-rate schedule and seed.
Weights are saved as safetensors keyed by everything that shaped them, so a second run loads them
and regenerates the table without training.

Columns: cache bytes measured (`cache.nbytes` of a dense cache holding exactly the tokens of a
16-token prompt and `new_tokens` generated ones), the seed's formula
2 × layers × batch × tokens × kv_heads × head_dim × bytes, the ratio to MHA, decode tokens/s
(median over repeats) and the validation loss (nats per byte).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache import make_cache
from ..cache.base import CacheGeometry
from ..errors import ConfigError, ModelFileError
from ..generate import generate
from ..model.config import DecoderConfig
from ..model.llama import Decoder
from .common import Ticker
from ..limits import MAX_REPEATS, check_int
from ..fileio import atomic_path, check_writable_folder, save_figure
from .corpus import VOCAB_SIZE, corpus_digest, decode, encode, splits

KV_HEADS = (8, 4, 2, 1)
PROMPT = "ROMEO:\nBut soft,"  # 16 bytes
MAX_TRAIN_STEPS = 1_000_000  # --steps: a million steps of the lab GPT is days of CPU already


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 200
    batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    eval_batches: int = 16
    n_layers: int = 2
    d_ff: int = 512

    def quick(self) -> "TrainSettings":
        return replace(self, steps=3, batch=4, seq_len=32, warmup=1, eval_batches=2, n_layers=1, d_ff=256)


def lab_gpt_config(n_kv_heads: int, n_layers: int = 2, d_ff: int = 512) -> DecoderConfig:
    """d_model 256, 8 query heads of 32, byte vocabulary; RoPE positions run to 4096 for the speed runs."""
    return DecoderConfig(vocab_size=VOCAB_SIZE, d_model=256, n_layers=n_layers, n_heads=8, n_kv_heads=n_kv_heads,
                         d_ff=d_ff, max_seq_len=4096, name=f"lab-gpt-{n_layers}x256-kv{n_kv_heads}")


def init_weights(model: Decoder, seed: int) -> None:
    """GPT-2 style: every matrix N(0, 0.02) (the tied embedding too), norms at 1."""
    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def forward_all(model: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    """Training / evaluation pass: a no-cache 'cache' (append all, attend with the causal mask)."""
    cfg = model.config
    cache = make_cache("none", CacheGeometry.for_model(cfg, batch=tokens.shape[0], capacity=tokens.shape[1]))
    return model(tokens, cache)                                            # (B, T, V)


def batch_at(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]             # (B, T+1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up, then cosine down to 10%."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def validation_loss(model: Decoder, val: torch.Tensor, s: TrainSettings) -> float:
    """Mean cross-entropy (nats per byte) over `eval_batches` fixed, evenly spaced windows."""
    model.eval()
    n = s.eval_batches * s.batch
    starts = torch.linspace(0, len(val) - s.seq_len - 2, n).long()
    losses = []
    for chunk in starts.split(s.batch):
        x, y = batch_at(val, chunk, s.seq_len)
        logits = forward_all(model, x)
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item())
    return statistics.fmean(losses)


def train(cfg: DecoderConfig, s: TrainSettings, train_data: torch.Tensor, ticker: Ticker) -> tuple[Decoder, list[float]]:
    model = Decoder(cfg)
    init_weights(model, s.seed)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=s.lr, betas=(0.9, 0.95))
    batches = torch.Generator().manual_seed(s.seed)                        # the same batches for every variant
    losses = []
    for step in range(s.steps):
        starts = torch.randint(0, len(train_data) - s.seq_len - 1, (s.batch,), generator=batches)
        x, y = batch_at(train_data, starts, s.seq_len)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        logits = forward_all(model, x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        ticker.advance()
    model.eval()
    return model, losses


# -- saved weights ------------------------------------------------------------------------------------

def default_weights_dir() -> Path:
    from ..paths import cache_dir

    return cache_dir() / "lab"


def weights_key(cfg: DecoderConfig, s: TrainSettings) -> str:
    blob = json.dumps([asdict(cfg), asdict(s), corpus_digest(), "lab-gpt-v1"], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def weights_path(weights_dir: Path, cfg: DecoderConfig, s: TrainSettings) -> Path:
    return Path(weights_dir) / f"{cfg.name}-{weights_key(cfg, s)}.safetensors"


def save_weights(path: Path, model: Decoder, meta: dict) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp),
                  metadata={k: json.dumps(v) for k, v in meta.items()})


def load_weights(path: Path, cfg: DecoderConfig) -> tuple[Decoder, dict]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
        state = load_file(str(path))
    except Exception as exc:  # a truncated or foreign file: say which
        raise ModelFileError(f"cannot read lab weights {path}: {exc}") from None
    model = Decoder(cfg)
    model.load_state_dict(state)
    return model.eval(), meta


def trained_lab_gpt(n_kv_heads: int, s: TrainSettings, weights_dir: Path | None = None, retrain: bool = False,
                    ticker: Ticker | None = None) -> tuple[Decoder, dict]:
    """The trained variant: loaded when its weights exist, else trained and saved. meta: train_seconds, losses."""
    ticker = ticker or Ticker()
    cfg = lab_gpt_config(n_kv_heads, s.n_layers, s.d_ff)
    path = weights_path(weights_dir or default_weights_dir(), cfg, s)
    if path.is_file() and not retrain:
        model, meta = load_weights(path, cfg)
        ticker.advance(s.steps)
        return model, {**meta, "resumed": True, "weights": str(path)}
    train_data, _ = splits()
    t0 = time.perf_counter()
    model, losses = train(cfg, s, train_data, ticker)
    meta = {"train_seconds": round(time.perf_counter() - t0, 2), "final_train_loss": round(losses[-1], 4),
            "train_loss_curve": [round(x, 4) for x in losses], "settings": asdict(s), "corpus_sha256_12": corpus_digest()}
    save_weights(path, model, meta)
    return model, {**meta, "resumed": False, "weights": str(path)}


# -- the table ------------------------------------------------------------------------------------------

@dataclass
class GqaRecord:
    n_kv_head: int
    n_head: int
    cache_bytes: int           # measured: cache.nbytes after generating
    theoretical_bytes: int     # 2 × layers × batch × tokens × kv_heads × head_dim × bytes
    cache_tokens: int
    ratio: float               # cache bytes / MHA cache bytes
    ratio_text: str
    tokens_per_s: float        # decode tokens/s, dense cache, median over repeats
    val_loss: float            # nats per byte on the validation split
    params: int
    train_seconds: float
    resumed: bool
    sample: str

    def record(self) -> dict:
        return {"experiment": "gqa", **asdict(self)}


def theoretical_bytes(cfg: DecoderConfig, batch: int, tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """The seed's formula: 2 (K and V) × layers × batch × tokens × kv_heads × head_dim × bytes per element."""
    return 2 * cfg.n_layers * batch * tokens * cfg.n_kv_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()


def measure_decode(model: Decoder, new_tokens: int, repeats: int) -> tuple[int, int, float, list[int]]:
    """(cache bytes, tokens held, median decode tokens/s, generated ids) for a 16-byte prompt, greedy."""
    prompt = torch.tensor([encode(PROMPT)])
    capacity = prompt.shape[1] + new_tokens - 1                           # the last token is never fed back
    geometry = CacheGeometry.for_model(model.config, batch=1, capacity=capacity)
    speeds, result, cache = [], None, None
    for _ in range(repeats + 1):                                          # the first run is a warm-up
        cache = make_cache("dense", geometry)
        result = generate(model, prompt, cache, new_tokens)
        speeds.append(result.decode_tokens_per_s)
    return cache.nbytes, cache.length, statistics.median(speeds[1:]), result.token_ids[0]


def run_gqa(settings: TrainSettings = TrainSettings(), new_tokens: int = 256, repeats: int = 3,
            weights_dir: Path | None = None, retrain: bool = False, kv_heads: tuple[int, ...] = KV_HEADS,
            ticker: Ticker | None = None) -> list[GqaRecord]:
    if 8 not in kv_heads:
        raise ConfigError("the GQA table needs n_kv_head 8 (MHA) as the baseline of its ratios")
    context = lab_gpt_config(8, settings.n_layers, settings.d_ff).max_seq_len
    prompt_tokens = len(encode(PROMPT))
    check_int(new_tokens, "--new-tokens", 2, context - prompt_tokens + 1,
              f"the lab GPT holds {context:,} tokens, {prompt_tokens} of them the prompt")
    check_int(repeats, "--repeats", 1, MAX_REPEATS)
    check_int(settings.steps, "--steps", 1, MAX_TRAIN_STEPS)
    folder = weights_dir or default_weights_dir()
    if retrain or any(not weights_path(folder, lab_gpt_config(n, settings.n_layers, settings.d_ff), settings).is_file()
                      for n in kv_heads):  # weights will be saved after training: make sure they can be, first
        check_writable_folder(folder, "--weights-dir")
    ticker = ticker or Ticker()
    ticker.reset(len(kv_heads) * (settings.steps + 2), "gqa")
    _, val = splits()
    rows = []
    for n_kv in kv_heads:
        ticker.describe(f"gqa: n_kv_head={n_kv}")
        model, meta = trained_lab_gpt(n_kv, settings, weights_dir, retrain, ticker)
        loss = validation_loss(model, val, settings)
        ticker.advance()
        nbytes, held, speed, ids = measure_decode(model, new_tokens, repeats)
        ticker.advance()
        rows.append((n_kv, model, meta, loss, nbytes, held, speed, ids))
    mha_bytes = next(r[4] for r in rows if r[0] == 8)
    records = []
    for n_kv, model, meta, loss, nbytes, held, speed, ids in rows:
        cfg = model.config
        ratio = Fraction(nbytes, mha_bytes)
        records.append(GqaRecord(
            n_kv_head=n_kv, n_head=cfg.n_heads, cache_bytes=nbytes, theoretical_bytes=theoretical_bytes(cfg, 1, held),
            cache_tokens=held, ratio=float(ratio), ratio_text=str(ratio), tokens_per_s=round(speed, 1),
            val_loss=round(loss, 4), params=sum(p.numel() for p in model.parameters()),
            train_seconds=float(meta.get("train_seconds", 0.0)), resumed=bool(meta.get("resumed")),
            sample=PROMPT + decode(ids[:64]),
        ))
    return records


def gqa_table(records: list[GqaRecord], settings: TrainSettings):
    from rich.table import Table

    s = settings
    table = Table(title=f"GQA record table: d_model 256, 8 query heads, {s.n_layers} block{'s' if s.n_layers != 1 else ''}; "
                        f"{s.steps} steps × {s.batch}×{s.seq_len} bytes, seed {s.seed}")
    for col in ("n_kv_head", "cache bytes (measured)", "theoretical", "vs MHA", "tokens/s", "val loss"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(str(r.n_kv_head), f"{r.cache_bytes:,}", f"{r.theoretical_bytes:,}", r.ratio_text,
                      f"{r.tokens_per_s:,.0f}", f"{r.val_loss:.3f}")
    return table


def gqa_markdown(records: list[GqaRecord]) -> str:
    lines = ["| n_kv_head | cache bytes (measured) | theoretical bytes | vs MHA | tokens/s | validation loss (nats/byte) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r.n_kv_head} | {r.cache_bytes:,} | {r.theoretical_bytes:,} | {r.ratio_text} "
                     f"| {r.tokens_per_s:,.0f} | {r.val_loss:.3f} |")
    return "\n".join(lines)


def plot_gqa(records: list[GqaRecord], path) -> None:
    from ..measure import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    xs = [r.n_kv_head for r in records]
    ax.bar([str(x) for x in xs], [r.cache_bytes / 1024 for r in records], color="C0", alpha=0.7, label="cache KiB (measured)")
    ax.plot([str(x) for x in xs], [r.theoretical_bytes / 1024 for r in records], "k_", markersize=30, label="theoretical")
    ax.set_xlabel("n_kv_head (8 = MHA, 1 = MQA)")
    ax.set_ylabel(f"KV cache KiB ({records[0].cache_tokens} tokens)")
    ax2 = ax.twinx()
    ax2.plot([str(x) for x in xs], [r.val_loss for r in records], "o-", color="C3", label="validation loss")
    ax2.set_ylabel("validation loss (nats/byte)", color="C3")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax2.margins(y=0.4)                                                     # small loss gaps, not a cliff
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right")
    ax.set_title("KV cache bytes and validation loss against n_kv_head")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
