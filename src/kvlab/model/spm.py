"""SentencePiece vocabularies from GGUF metadata (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral, Gemma),
tokenized exactly as llama.cpp's SPM tokenizer does.

Encoding: the text is cut at special tokens (control, user-defined and unknown tokens, longest first, each
matched whole), every other fragment gets ' ' -> '▁' (and a leading '▁' when `add_space_prefix` and the fragment
starts the text or follows a special token), is split into characters, and adjacent symbols are merged
greedily: always the pair whose concatenation is the vocabulary token of highest score, the leftmost on a tie.
A final symbol that is not a token becomes its UTF-8 bytes as <0xXX> byte tokens.
Decoding is the inverse: '▁' -> ' ', byte tokens -> their bytes, special tokens as their text.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass, field

from ..errors import ModelFileError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # GGUF tokenizer.ggml.token_type
SPACE = "\u2581"
_BYTE_TEXT = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass
class SpmVocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    add_space_prefix: bool = True
    token_to_id: dict[str, int] = field(init=False, repr=False)
    byte_ids: dict[int, int] = field(init=False, repr=False)      # byte value -> its <0xXX> token
    specials: list[tuple[str, int]] = field(init=False, repr=False)  # matched whole, longest first

    def __post_init__(self):
        self.token_to_id = {}
        for i, text in enumerate(self.tokens):
            self.token_to_id[text] = i  # a repeated text maps to its last id, as in llama.cpp
        self.byte_ids = {}
        for b in range(256):
            token = self.token_to_id.get(f"<0x{b:02X}>")
            if token is not None:
                self.byte_ids[b] = token
        special = [i for i, t in enumerate(self.types) if t in (CONTROL, USER_DEFINED, UNKNOWN) and self.tokens[i]]
        special.sort(key=lambda i: -len(self.tokens[i].encode("utf-8")))
        self.specials = [(self.tokens[i], i) for i in special]

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "SpmVocab":
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ModelFileError("GGUF SentencePiece vocabulary: tokenizer.ggml.tokens must be a non-empty list of strings")
        n = len(tokens)
        scores = meta.get("tokenizer.ggml.scores", [0.0] * n)
        if not isinstance(scores, list) or len(scores) != n:
            raise ModelFileError(f"GGUF SentencePiece vocabulary: tokenizer.ggml.scores has "
                                 f"{len(scores) if isinstance(scores, list) else 'no list of'} scores for {n} tokens")
        for i, s in enumerate(scores):
            if isinstance(s, bool) or not isinstance(s, (int, float)) or math.isnan(s):
                raise ModelFileError(f"GGUF SentencePiece vocabulary: score {s!r} of token {i} is not a number")
        types = meta.get("tokenizer.ggml.token_type", [NORMAL] * n)
        if not isinstance(types, list) or len(types) != n:
            raise ModelFileError(f"GGUF SentencePiece vocabulary: tokenizer.ggml.token_type has "
                                 f"{len(types) if isinstance(types, list) else 'no list of'} types for {n} tokens")
        for i, t in enumerate(types):
            if t not in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) or isinstance(t, bool):
                raise ModelFileError(f"GGUF SentencePiece vocabulary: token {i} {tokens[i]!r} has unknown type {t!r} "
                                     f"(known: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)")
            if t == BYTE and not _BYTE_TEXT.fullmatch(tokens[i]):
                raise ModelFileError(f"GGUF SentencePiece vocabulary: byte token {i} is {tokens[i]!r}, not <0xXX>")
        vocab = cls(tokens=tokens, scores=[float(s) for s in scores], types=[int(t) for t in types],
                    add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        if vocab.byte_ids and len(vocab.byte_ids) < 256:
            missing = next(b for b in range(256) if b not in vocab.byte_ids)
            raise ModelFileError(f"GGUF SentencePiece vocabulary has {len(vocab.byte_ids)} of the 256 byte tokens "
                                 f"(no <0x{missing:02X}>): text outside the vocabulary cannot be encoded")
        return vocab

    # -- encoding -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special-token text becomes those tokens; no BOS/EOS is added here)."""
        ids: list[int] = []
        prev_special = True
        for fragment, token in self._partition(text):
            if token is not None:
                ids.append(token)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                fragment = " " + fragment
            ids += self._merge(fragment.replace(" ", SPACE))
            prev_special = False
        return ids

    def _partition(self, text: str) -> list[tuple[str, int | None]]:
        """`text` cut at special tokens: (text, None) fragments and (token text, id) pieces, in order. Like
        llama.cpp, each special token in turn (longest first) splits every fragment left by the ones before."""
        parts: list[tuple[str, int | None]] = [(text, None)] if text else []
        for special, token in self.specials:
            if special not in text:
                continue
            cut: list[tuple[str, int | None]] = []
            for part, part_token in parts:
                if part_token is not None or special not in part:
                    cut.append((part, part_token))
                    continue
                pieces = part.split(special)
                for k, piece in enumerate(pieces):
                    if k:
                        cut.append((special, token))
                    if piece:
                        cut.append((piece, None))
            parts = cut
        return parts

    def _merge(self, text: str) -> list[int]:
        """llama.cpp's llm_tokenizer_spm_session.tokenize on one escaped fragment."""
        sym = list(text)                      # sym[i]: the text of the symbol starting at character i ("" once merged away)
        n = len(sym)
        nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
        prv = [i - 1 for i in range(n)]
        queue: list[tuple[float, int, int, int]] = []  # (-score, left, right, length of the pair)
        token_to_id, scores = self.token_to_id, self.scores

        def add(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            pair = sym[left] + sym[right]
            token = token_to_id.get(pair)
            if token is not None:
                heapq.heappush(queue, (-scores[token], left, right, len(pair)))

        for i in range(1, n):
            add(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
                continue  # one side was merged into something else since
            sym[left] += sym[right]
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            add(prv[left], left)
            add(left, nxt[left])
        ids: list[int] = []
        i = 0 if n else -1
        while i != -1:
            token = token_to_id.get(sym[i])
            if token is not None:
                ids.append(token)
            else:
                for b in sym[i].encode("utf-8"):
                    if b not in self.byte_ids:
                        raise ModelFileError(f"GGUF SentencePiece vocabulary has no token for {sym[i]!r} and no byte "
                                             f"token <0x{b:02X}> to spell it")
                    ids.append(self.byte_ids[b])
            i = nxt[i]
        return ids

    # -- decoding -------------------------------------------------------------------------------
    def token_bytes(self, token: int, skip_special: bool = False) -> bytes:
        """The bytes one token stands for: a byte token's byte, a special token's text (none when skipped), an
        unused token nothing, any other token its text with '▁' as ' '."""
        kind, text = self.types[token], self.tokens[token]
        if kind == BYTE:
            return bytes([int(text[3:5], 16)])
        if kind in (CONTROL, UNKNOWN):
            return b"" if skip_special else text.encode("utf-8")
        if kind == USER_DEFINED:
            return text.encode("utf-8")
        if kind == UNUSED:
            return b""
        return text.replace(SPACE, " ").encode("utf-8")

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """The text of `ids`; the space `add_space_prefix` put before the text (at the start, or after a special
        token) is taken off again, so decode(encode(text)) == text."""
        out = bytearray()
        prev_special = True
        for token in ids:
            kind = self.types[token]
            piece = self.token_bytes(token, skip_special)
            if kind in (CONTROL, UNKNOWN, USER_DEFINED):
                prev_special = True
            elif piece:
                if self.add_space_prefix and prev_special and piece.startswith(b" "):
                    piece = piece[1:]
                prev_special = False
            out += piece
        return out.decode("utf-8", errors="replace")
