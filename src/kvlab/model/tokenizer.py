"""Tokenizer: byte-level BPE or SentencePiece from GGUF metadata, or a tokenizer.json, plus the model's chat
template."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

from ..errors import ConfigError, ModelFileError
from . import spm as _spm

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre` (the regexes the original tokenizer.json used).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_CONTROL = 3  # llama.cpp token type for special/control tokens


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> the byte it stands for (printable bytes as themselves, the
    others shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


def _byte_level_pre_tokenizer(pre: str):
    if pre in ("smollm", "starcoder", "refact", "gpt2", "default", ""):
        digits = [pre_tokenizers.Digits(individual_digits=True)] if pre in ("smollm", "starcoder", "refact") else []
        return pre_tokenizers.Sequence(digits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    pattern = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if pattern is None:
        raise ModelFileError(f"GGUF tokenizer pre-tokenizer {pre!r} is not supported; use the model's tokenizer.json")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _read_json(path: Path) -> dict:
    """A small JSON file of a model folder, or {} when absent; a broken one is a one-line error."""
    import json

    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelFileError(f"{path}: not valid JSON ({str(exc).splitlines()[0] or 'nested too deeply'})") from None
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: must hold a JSON object, not {type(value).__name__}")
    return value


def _chat_template(value, folder: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates (the "default" one)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise ModelFileError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                         f"named templates with a \"default\" one, not {type(value).__name__}")


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    add_bos: bool = False
    chat_template: str | None = None
    spm: _spm.SpmVocab | None = None  # a SentencePiece vocabulary encodes and decodes here, not in `backend`

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind == "llama":
            return cls._from_sentencepiece(meta)
        if kind != "gpt2":
            raise ModelFileError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2' and "
                                 f"SentencePiece 'llama'); use the model's tokenizer.json")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type", [])
        specials = [tokens[i] for i, t in enumerate(types) if t == _GGUF_CONTROL]
        backend.add_special_tokens(specials)
        return cls(
            backend=backend,
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_ids=_eos_ids(meta),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def _from_sentencepiece(cls, meta: dict) -> "Tokenizer":
        """A SentencePiece vocabulary, encoded by kvlab.model.spm exactly as llama.cpp does; llama.cpp's defaults
        for what the file leaves out (BOS 1, EOS 2, add BOS, a space prefix)."""
        vocab = _spm.SpmVocab.from_gguf_metadata(meta)
        n = len(vocab.tokens)
        ids = {}
        for key, default in (("bos", 1), ("eos", 2), ("eot", None)):
            name = f"tokenizer.ggml.{key}_token_id"
            value = meta.get(name, default if default is not None and default < n else None)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n):
                raise ModelFileError(f"GGUF {name} {value!r} is not a token id below the vocabulary size {n}")
            ids[key] = value
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        if add_bos and ids["bos"] is None:
            raise ModelFileError("GGUF SentencePiece vocabulary asks for a BOS token but has none")
        return cls(
            backend=_spm_backend(vocab),
            bos_id=ids["bos"],
            eos_ids=tuple(sorted({i for i in (ids["eos"], ids["eot"]) if i is not None})),
            add_bos=add_bos,
            chat_template=meta.get("tokenizer.chat_template"),
            spm=vocab,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer":
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelFileError(f"{folder}: no tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises bare Exceptions with multi-line text
            raise ModelFileError(f"{path}: not a valid tokenizer.json ({str(exc).splitlines()[0]})") from None
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")

        def token_id(entry) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            if text is not None and not isinstance(text, str):
                raise ModelFileError(f"{folder / 'tokenizer_config.json'}: special token {text!r} is not a string")
            return backend.token_to_id(text) if text else None

        eos = generation.get("eos_token_id", token_id(config.get("eos_token")))
        eos_ids = tuple(sorted(set(eos if isinstance(eos, list) else [eos]) - {None}))
        vocab = backend.get_vocab_size()
        for eos_id in eos_ids:
            if not isinstance(eos_id, int) or isinstance(eos_id, bool) or not 0 <= eos_id < vocab:
                raise ModelFileError(f"{folder}: eos_token_id {eos_id!r} is not a token id below the vocabulary size {vocab}")
        template = _chat_template(config.get("chat_template"), folder)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(errors="replace")
        return cls(
            backend=backend,
            bos_id=token_id(config.get("bos_token")),
            eos_ids=eos_ids,
            add_bos=False,  # tokenizer.json's post-processor adds BOS itself where the model wants it
            chat_template=template,
        )

    # -- use --------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.spm.tokens) if self.spm is not None else self.backend.get_vocab_size()

    def id_to_token(self, token_id: int) -> str | None:
        if self.spm is not None:
            return self.spm.tokens[token_id] if 0 <= token_id < len(self.spm.tokens) else None
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        check_unicode(text, "text")
        if self.spm is not None:
            ids = self.spm.encode(text)
        else:
            ids = self.backend.encode(text, add_special_tokens=add_special).ids
        if add_special and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        if self.spm is not None:
            return self.spm.decode([int(i) for i in ids], skip_special)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold half a UTF-8 character, which decode()
        would turn into U+FFFD)."""
        if self.spm is not None:
            return self.spm.token_bytes(int(token_id))
        piece = self.backend.id_to_token(int(token_id)) or ""
        if isinstance(self.backend.decoder, decoders.ByteLevel) and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return self.decode([token_id]).encode("utf-8")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, deadline: float | None = None) -> str:
        """Render the model's own Jinja chat template, bounded in time, memory and size (kvlab.model.chat_template);
        `tools` reach the template as its `tools` variable, `deadline` (time.monotonic()) ends the render early."""
        if not self.chat_template:
            raise ModelFileError("this model has no chat template (use plain completion: drop --chat, or /v1/completions)")
        from .chat_template import render_chat_template

        id_to_token = self.id_to_token
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=(id_to_token(self.bos_id) or "") if self.bos_id is not None else "",
            eos_token=(id_to_token(self.eos_ids[0]) or "") if self.eos_ids else "",
            tools=tools,
            deadline=deadline,
        )


def _eos_ids(meta: dict) -> tuple[int, ...]:
    """The end-of-generation ids a GGUF names: its EOS and its end-of-turn token."""
    return tuple(sorted({meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot")} - {None}))


def _spm_backend(vocab: _spm.SpmVocab) -> HFTokenizer:
    """A `tokenizers` view of a SentencePiece vocabulary for the libraries that read one (llguidance's grammar
    engine): the vocabulary with byte fallback, '▁' for ' ', the special tokens whole. It holds no merges, so
    kvlab never encodes with it (SpmVocab does)."""
    vocab_map = {}
    for i, text in enumerate(vocab.tokens):
        vocab_map.setdefault(text, i)
    unk = next((vocab.tokens[i] for i, t in enumerate(vocab.types) if t == _spm.UNKNOWN), None)
    backend = HFTokenizer(models.BPE(vocab=vocab_map, merges=[], unk_token=unk, byte_fallback=bool(vocab.byte_ids)))
    steps = [normalizers.Prepend(_spm.SPACE)] if vocab.add_space_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", _spm.SPACE)])
    backend.decoder = decoders.Sequence([decoders.Replace(_spm.SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False)
                                for i, t in enumerate(vocab.types) if t in (_spm.CONTROL, _spm.UNKNOWN)])
    backend.add_tokens([AddedToken(vocab.tokens[i], special=False, normalized=False)
                        for i, t in enumerate(vocab.types) if t == _spm.USER_DEFINED])
    return backend


def check_unicode(text: str, what: str) -> None:
    """A str that UTF-8 cannot hold (a lone surrogate such as "\\ud800", which JSON's escapes can carry) is a one-line
    ConfigError naming `what` and the position, not a TypeError from the tokenizer."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"{what} is not valid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} at character "
                          f"{exc.start}") from None


class StreamDecoder:
    """Turns token ids into text pieces as they arrive, holding back incomplete UTF-8 sequences.

    Each push decodes only the tokens since the last emitted piece, plus the piece before them as
    context (so a tokenizer that treats a leading space specially still joins correctly): the cost per
    token stays constant instead of re-decoding the whole text.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_at = 0   # ids[prefix_at:read_at] were emitted last time: the context of the next piece
        self.read_at = 0     # ids[read_at:] are not emitted yet

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix_at:self.read_at], skip_special=True)
        text = self.tokenizer.decode(self.ids[self.prefix_at:], skip_special=True)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is not complete yet
        self.prefix_at, self.read_at = self.read_at, len(self.ids)
        return text[len(before):]
