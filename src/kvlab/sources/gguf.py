"""GGUF files: read the header (metadata + tensor table) without touching tensor data.

`open_gguf(path)` parses the header with `struct` over an mmap of the file, so only the header's
pages are ever read: a 40 GB file opens as fast as a 4 MB one. Tensor data is reachable lazily
through `GGUFTensor.data` (a read-only numpy memmap view, shaped like `gguf.GGUFReader`'s), so the
model runtime can dequantize from the same object. Nothing is ever unpickled or executed.

Every failure (missing file, not GGUF, truncated, corrupt header) is one `ModelFileError` line.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from ..errors import ConfigError, ModelFileError
from ..spec import LinearAttentionFacts, ModelSpec, MoEFacts, RuntimeFacts, TensorInfo
from .native import native_weight_bytes
from .layers import (FIXED_WINDOWS, LayerFacts, as_float, as_int, build_layers, check_number_keys, interval_kinds, layer_count, pattern_kinds, per_layer,
                     per_layer_flags, short, ssm_state_elements)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_MAX_COUNT = 1 << 32  # more keys/tensors/array items than any real file: the header is corrupt
_MAX_DEPTH = 4        # arrays of arrays nested deeper than this: a corrupt or hostile header
_MAX_DIMS = 8

# GGUF value type id -> struct format (scalars); 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_DTYPES = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY = 8, 9

# Tensor types whose data GGUFReader exposes as typed arrays (all others: raw bytes of blocks).
_PLAIN_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class _Truncated(Exception):
    """Internal: a read ran past the end of the file."""


class _Corrupt(Exception):
    """Internal: the header holds something no valid GGUF holds (open_gguf adds the path)."""


class FileBytes:
    """A GGUF file's bytes, mapped on first use: what its tensors read their data from. The tensors hold this, not
    the GGUFFile, so no reference cycle keeps the header (a vocabulary of Python strings) alive after its last use."""

    def __init__(self, path: Path):
        self.path = path

    @cached_property
    def memmap(self) -> np.memmap:
        return np.memmap(self.path, mode="r", dtype=np.uint8)


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table (attribute names follow gguf.ReaderTensor)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]          # GGUF order: fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int                # absolute offset in the file
    _file: FileBytes = field(repr=False, compare=False)

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes as a read-only memmap view (numpy order: dims reversed).

        Plain types (F32, F16, I8, ...) come typed; quantized ones as uint8 rows of whole blocks,
        exactly as gguf.GGUFReader exposes them, ready for gguf.quants.dequantize.
        """
        raw = self._file.memmap[self.data_offset:self.data_offset + self.n_bytes]
        return self._typed(raw)

    def read(self) -> np.ndarray:
        """The tensor's bytes read from the file into a new writable array, shaped and typed like `data`.

        Nothing is mapped: once the copy is made the file's pages are not part of this process's memory,
        where reading through `data` keeps every page it touched resident (counted in its RSS) while the
        mapping lives, next to the copy.
        """
        out = np.empty(self.n_bytes, dtype=np.uint8)
        with open(self._file.path, "rb") as fh:
            fh.seek(self.data_offset)
            got = fh.readinto(memoryview(out))
        if got != self.n_bytes:
            raise ModelFileError(f"{self._file.path} is truncated: tensor {self.name!r} has {got:,} of its {self.n_bytes:,} bytes")
        return self._typed(out)

    def _typed(self, raw: np.ndarray) -> np.ndarray:
        """The tensor's bytes (uint8) viewed in numpy order: plain types typed, quantized ones as rows of blocks."""
        np_shape = tuple(reversed(self.shape))
        dtype = _PLAIN_TENSOR_DTYPES.get(self.tensor_type)
        if dtype is None:
            np_shape = quant_shape_to_byte_shape(np_shape, self.tensor_type)
            dtype = np.uint8
        return raw.view(dtype).reshape(np_shape)


@dataclass
class GGUFFile:
    """A parsed GGUF header: `metadata` (decoded Python values) and `tensors` (the table)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int               # where tensor data starts
    file_size: int
    header_bytes: int = 0          # bytes parsed: key/values + tensor table

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor(self, name: str) -> GGUFTensor:
        for tensor in self.tensors:
            if tensor.name == name:
                return tensor
        raise ModelFileError(f"{self.path}: no tensor named {name!r}")

    @property
    def tensor_bytes(self) -> int:
        """Bytes of all tensor data (the weights as stored)."""
        return sum(t.n_bytes for t in self.tensors)


class _HeaderReader:
    """Sequential little/big-endian reads over a buffer, raising _Truncated past its end."""

    def __init__(self, buffer, size: int, endian: str = "<"):
        self.buffer, self.size, self.endian, self.pos = buffer, size, endian, 0

    def unpack(self, fmt: str) -> Any:
        s = struct.Struct(self.endian + fmt)
        if self.pos + s.size > self.size:
            raise _Truncated
        (value,) = s.unpack_from(self.buffer, self.pos)
        self.pos += s.size
        return value

    def count(self, what: str, min_item_bytes: int = 1) -> int:
        """A count read from the header, bounded by the bytes left: each item takes at least `min_item_bytes`."""
        n = self.unpack("Q")
        if n >= _MAX_COUNT or n * min_item_bytes > self.size - self.pos:
            raise _Corrupt(f"is truncated or corrupt: GGUF header {what} count {n:,} does not fit in the {self.size - self.pos:,} bytes left")
        return n

    def raw(self, n: int) -> bytes:
        if self.pos + n > self.size:
            raise _Truncated
        data = self.buffer[self.pos:self.pos + n]
        self.pos += n
        return data

    def string(self) -> str:
        return bytes(self.raw(self.count("string length"))).decode("utf-8", errors="replace")

    def _strings(self, n: int) -> list[str]:
        """n strings in a row (tokenizer vocabularies: the hot loop of header parsing)."""
        length = struct.Struct(self.endian + "Q")
        buffer, size, pos, out = self.buffer, self.size, self.pos, []
        for _ in range(n):
            if pos + 8 > size:
                raise _Truncated
            (k,) = length.unpack_from(buffer, pos)
            pos += 8
            if pos + k > size:
                raise _Truncated
            out.append(buffer[pos:pos + k].decode("utf-8", errors="replace"))
            pos += k
        self.pos = pos
        return out

    def value(self, type_id: int, depth: int = 0) -> Any:
        fmt = _SCALAR_FORMATS.get(type_id)
        if fmt is not None:
            return self.unpack(fmt)
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            if depth >= _MAX_DEPTH:
                raise _Corrupt(f"is corrupt: GGUF header: arrays nested more than {_MAX_DEPTH} deep")
            item_type = self.unpack("I")
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type]).newbyteorder(self.endian)
                n = self.count("array", dtype.itemsize)
                return np.frombuffer(self.raw(n * dtype.itemsize), dtype=dtype).tolist()
            if item_type == _STRING:
                return self._strings(self.count("string array", 8))
            if item_type != _ARRAY:
                raise _Corrupt(f"is corrupt: GGUF header: unknown array item type {item_type}")
            n = self.count("nested array", 12)  # each item: its own item type + count
            return [self.value(item_type, depth + 1) for _ in range(n)]
        raise _Corrupt(f"is corrupt: GGUF header: unknown value type {type_id}")


def _parse(path: Path, buffer, size: int) -> GGUFFile:
    if size < 4 or buffer[:4] != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (starts with {bytes(buffer[:4])!r}, expected b'GGUF')")
    reader = _HeaderReader(buffer, size)
    reader.pos = 4
    version = reader.unpack("I")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        reader.endian = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(f"{path}: GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
    n_tensors = reader.count("tensor", 8 + 4 + 4 + 8)   # name length, dims, type, offset
    n_kv = reader.count("metadata key", 8 + 4)           # key length, value type

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.unpack("I"))

    table, names = [], set()
    for _ in range(n_tensors):
        name = reader.string()
        if name in names:
            raise ModelFileError(f"{path}: tensor {name[:80]!r} is listed twice")
        names.add(name)
        n_dims = reader.unpack("I")
        if n_dims > _MAX_DIMS:
            raise _Corrupt(f"is corrupt: GGUF header: tensor {name[:80]!r} has {n_dims} dimensions")
        shape = tuple(reader.unpack("Q") for _ in range(n_dims))
        raw_type = reader.unpack("I")
        offset = reader.unpack("Q")
        try:
            tensor_type = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        except (ValueError, KeyError):
            raise ModelFileError(f"{path}: tensor {name[:80]!r} has unknown type id {raw_type}") from None
        n_elements = 1
        for dim in shape:  # Python ints: a product that would overflow 64 bits is caught below, not wrapped
            n_elements *= dim
        if shape and shape[0] % block_size:
            raise ModelFileError(f"{path}: tensor {name[:80]!r} of type {tensor_type.name} has rows of {shape[0]} values, "
                                 f"not whole {block_size}-value blocks")
        n_bytes = n_elements // block_size * type_size
        if n_bytes > size:
            raise ModelFileError(f"{path}: tensor {name[:80]!r} of shape {shape} needs {n_bytes:,} bytes, "
                                 f"more than the whole file ({size:,} bytes)")
        table.append((name, tensor_type, shape, n_elements, n_bytes, offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(f"{path}: general.alignment={alignment!r} is not a power of two")
    header_bytes = reader.pos
    data_offset = -(-reader.pos // alignment) * alignment

    gguf_file = GGUFFile(path, version, metadata, [], alignment, data_offset, size, header_bytes)
    data = FileBytes(path)
    for name, tensor_type, shape, n_elements, n_bytes, offset in table:
        end = data_offset + offset + n_bytes
        if offset % alignment:
            raise ModelFileError(f"{path}: tensor {name[:80]!r} starts at offset {offset:,}, not a multiple of the alignment {alignment}")
        if end > size:
            raise ModelFileError(
                f"{path} is truncated: tensor {name!r} ends at byte {end:,} but the file has {size:,} bytes"
            )
        gguf_file.tensors.append(GGUFTensor(name, tensor_type, shape, n_elements, n_bytes, data_offset + offset, data))
    return gguf_file


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header; tensor data stays on disk (see GGUFTensor.data).

    Raises ModelFileError (one line) for a missing file, a file that is not GGUF, a truncated
    file, or a header that cannot be parsed.
    """
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if not path.is_file():
        raise ModelFileError(f"{path} is not a file")
    try:
        size = path.stat().st_size
        if size == 0:
            raise ModelFileError(f"{path} is empty, not a GGUF file")
        if size < 24:  # magic + version + two counts
            with open(path, "rb") as fh:
                head = fh.read(4)
            if head != GGUF_MAGIC:
                raise ModelFileError(f"{path} is not a GGUF file (starts with {head!r}, expected b'GGUF')")
            raise ModelFileError(f"{path} is truncated: {size} bytes is shorter than a GGUF header")
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return _parse(path, view, size)
    except _Truncated:
        raise ModelFileError(f"{path} is truncated: the GGUF header runs past the end of the file") from None
    except _Corrupt as exc:
        raise ModelFileError(f"{path} {exc}") from None
    except (OSError, ValueError, UnicodeDecodeError, OverflowError, struct.error, MemoryError, RecursionError) as exc:
        raise ModelFileError(f"{path}: unreadable GGUF header ({type(exc).__name__}: {str(exc)[:200]})") from None


def gguf_metadata(gguf_file: Any) -> dict[str, Any]:
    """The decoded metadata of a GGUFFile (or of a gguf.GGUFReader: strings decoded, arrays as lists)."""
    if isinstance(gguf_file, GGUFFile):
        return dict(gguf_file.metadata)
    fields = getattr(gguf_file, "fields", None)
    if fields is None:
        raise TypeError(f"expected a GGUFFile or gguf.GGUFReader, got {type(gguf_file).__name__}")
    return {key: f.contents() for key, f in fields.items() if not key.startswith("GGUF.")}


# -- ModelSpec from the metadata ------------------------------------------------------------------

#: What llama.cpp assumes when a GGUF lacks a key (it hard-codes these per architecture):
#: the sliding-window period (0 = llama.cpp ignores the window), the full-attention interval of
#: hybrid DeltaNet models, and the layers that own KV in Gemma 3n. Keys in the file always win.
LLAMA_CPP_KEY_DEFAULTS: dict[str, dict[str, int]] = {
    "gemma2": {"sliding_window_pattern": 2, "sliding_window": 4096},
    "gemma3": {"sliding_window_pattern": 6},
    "gemma3n": {"sliding_window_pattern": 5, "kv_layers": 20},
    "cohere2": {"sliding_window_pattern": 4},
    "gpt-oss": {"sliding_window_pattern": 2},
    "exaone4": {"sliding_window_pattern": 4},
    "llama4": {"sliding_window_pattern": 4},
    "qwen3next": {"full_attention_interval": 4},
    "qwen35": {"full_attention_interval": 4},
    "qwen35moe": {"full_attention_interval": 4},
}
#: Architectures whose llama.cpp loader never reads a sliding window (the key, if any, is ignored).
_NO_SWA = {"llama", "qwen2", "qwen3", "qwen3moe", "mistral3", "deepseek2", "phi3"}


def _window(md: dict[str, Any], arch: str) -> int:
    """The sliding window llama.cpp uses for `arch` (0: none)."""
    stated = md.get(f"{arch}.attention.sliding_window")
    if arch in FIXED_WINDOWS:
        return 0 if stated == 0 else FIXED_WINDOWS[arch]
    return int(stated or LLAMA_CPP_KEY_DEFAULTS.get(arch, {}).get("sliding_window") or 0)


def _gguf_kinds(md: dict[str, Any], arch: str, n_layers: int, kv_heads: list[int], n_ff: list[int]) -> list[str]:
    """Per-layer kinds from the standard keys (see LLAMA_CPP_KEY_DEFAULTS for absent keys)."""
    key = lambda name: md.get(f"{arch}.{name}")  # noqa: E731
    defaults = LLAMA_CPP_KEY_DEFAULTS.get(arch, {})
    has_ssm = key("ssm.state_size") is not None or key("wkv.head_size") is not None or key("shortconv.l_cache") is not None
    recurrent_layers = key("attention.recurrent_layers")
    interval = key("full_attention_interval") or (defaults.get("full_attention_interval") if has_ssm else None)
    if isinstance(recurrent_layers, list):
        kinds = ["recurrent" if r else "full" for r in per_layer_flags(recurrent_layers, n_layers, "attention.recurrent_layers")]
    elif has_ssm and interval:
        kinds = interval_kinds(n_layers, int(interval))
    elif has_ssm:
        # a layer without KV heads is recurrent (or MLP-only when it has a feed-forward: Nemotron-H)
        hybrid_mlp = any(n_ff) and any(kv == 0 and ff > 0 for kv, ff in zip(kv_heads, n_ff)) and any(
            kv == 0 and ff == 0 for kv, ff in zip(kv_heads, n_ff))
        kinds = ["full" if kv > 0 else ("none" if hybrid_mlp and ff > 0 else "recurrent") for kv, ff in zip(kv_heads, n_ff)]
    else:
        kinds = ["full"] * n_layers

    window = _window(md, arch)
    if window and arch not in _NO_SWA:
        pattern = key("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            swa = per_layer_flags(pattern, n_layers, "attention.sliding_window_pattern")
        else:
            period = pattern if pattern is not None else defaults.get("sliding_window_pattern", 1)
            swa = [k == "sliding" for k in pattern_kinds(n_layers, int(period))] if period else [False] * n_layers
        kinds = ["sliding" if s and k == "full" else k for s, k in zip(swa, kinds)]

    shared = key("attention.shared_kv_layers")
    kv_layers = n_layers - int(shared) if shared else defaults.get("kv_layers")
    if kv_layers:
        kinds = [k if i < kv_layers else "none" for i, k in enumerate(kinds)]
    return kinds


def _gguf_state_elements(md: dict[str, Any], arch: str, n_embd: int, n_heads: int) -> int:
    key = lambda name, default=0: md.get(f"{arch}.{name}", default)  # noqa: E731
    if key("wkv.head_size"):  # RWKV: token shift + wkv state
        return int(key("token_shift_count", 2)) * n_embd + n_embd * int(key("wkv.head_size"))
    if key("shortconv.l_cache"):  # LFM2 short convolution
        return n_embd * (int(key("shortconv.l_cache")) - 1)
    if key("ssm.state_size"):
        return ssm_state_elements(int(key("ssm.conv_kernel")), int(key("ssm.inner_size")),
                                  int(key("ssm.state_size")), int(key("ssm.group_count")))
    return 0


#: Integer keys (after "<arch>.") and whether a per-layer list is allowed; checked before any is used.
_INT_KEYS = {
    "block_count": False, "context_length": False, "embedding_length": False, "vocab_size": False,
    "feed_forward_length": True, "attention.head_count": True, "attention.head_count_kv": True,
    "attention.key_length": False, "attention.value_length": False, "attention.sliding_window": False,
    "attention.key_length_swa": False, "attention.value_length_swa": False, "attention.kv_lora_rank": False,
    "attention.key_length_mla": False, "attention.value_length_mla": False, "attention.shared_kv_layers": False,
    "rope.dimension_count": False, "expert_count": False, "expert_used_count": False,
    "full_attention_interval": False, "ssm.state_size": False, "ssm.conv_kernel": False, "ssm.inner_size": False,
    "ssm.group_count": False, "wkv.head_size": False, "shortconv.l_cache": False, "token_shift_count": False,
    "ssm.time_step_rank": False, "expert_feed_forward_length": False, "expert_shared_feed_forward_length": False,
}
_FLOAT_KEYS = ("rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.factor", "rope.freq_base_swa",
               "final_logit_softcapping")
#: llama.cpp's Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5) and its Gemma 3
DELTANET_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
#: llama.cpp's Gemma 3 27B (62 layers) scales queries by 1/sqrt(n_embd / n_head), the others by 1/sqrt(head_dim)
_GEMMA3_27B_LAYERS = 62
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "eot_token_id", "unknown_token_id", "padding_token_id")


def _checked_metadata(md: dict[str, Any], arch: str, source: str) -> None:
    """Every key this reader uses holds what it should: one line naming the key otherwise."""
    check_number_keys(md, _INT_KEYS, _FLOAT_KEYS, source, prefix=f"{arch}.")
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None and (not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens)):
        raise ConfigError(f"{source}: tokenizer.ggml.tokens must be an array of strings")
    merges = md.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)):
        raise ConfigError(f"{source}: tokenizer.ggml.merges must be an array of strings")
    types = md.get("tokenizer.ggml.token_type")
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in types)):
        raise ConfigError(f"{source}: tokenizer.ggml.token_type must be an array of integers")
    for suffix in _TOKEN_ID_KEYS:
        key = f"tokenizer.ggml.{suffix}"
        if md.get(key) is not None:
            as_int(md[key], f"{source}: {key}")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template", "general.name"):
        if md.get(key) is not None and not isinstance(md[key], str):
            raise ConfigError(f"{source}: {key} must be a string, got {short(md[key])}")


def _vocab_size(md: dict[str, Any], arch: str, source: str) -> int:
    """llama.cpp's n_vocab: the vocab_size key, else the tokenizer's token count; never fewer than the tokens."""
    tokens = md.get("tokenizer.ggml.tokens") or []
    vocab = as_int(md.get(f"{arch}.vocab_size") or len(tokens), f"{source}: {arch}.vocab_size")
    if len(tokens) > vocab:
        raise ConfigError(f"{source}: the tokenizer lists {len(tokens):,} tokens but {arch}.vocab_size is {vocab:,}")
    return vocab


def _runtime_facts(gguf_file: GGUFFile, arch: str, vocab: int, n_ff: list[int]) -> RuntimeFacts:
    md, source = gguf_file.metadata, str(gguf_file.path)
    key = lambda name, default=None: md.get(f"{arch}.{name}", default)  # noqa: E731
    names = {t.name for t in gguf_file.tensors}
    ids = {}
    for suffix in _TOKEN_ID_KEYS[:3]:
        value = md.get(f"tokenizer.ggml.{suffix}")
        if value is not None and vocab and not 0 <= value < vocab:
            raise ModelFileError(f"{source}: tokenizer.ggml.{suffix}={value} is outside the vocabulary of {vocab:,} tokens")
        ids[suffix] = value
    factors = None
    if "rope_freqs.weight" in names:  # Llama 3.x: long-context RoPE factors, one per rotated pair
        tensor = gguf_file.tensor("rope_freqs.weight")
        if tensor.tensor_type != GGMLQuantizationType.F32 or len(tensor.shape) != 1:
            raise ModelFileError(f"{source}: tensor 'rope_freqs.weight' must be a 1-D F32 vector, "
                                 f"got {tensor.tensor_type.name} of shape {tensor.shape}")
        factors = tuple(float(f) for f in tensor.data.astype("float64"))
    scaling = key("rope.scaling.type")
    family: dict[str, Any] = {"hidden_act": "gelu_tanh" if arch == "gemma3" else "silu"}
    if arch == "gemma3":
        n_layers, n_embd, n_head = int(key("block_count")), int(key("embedding_length", 0)), key("attention.head_count")
        head_dim = int(key("attention.key_length", 0) or (n_embd // max(per_layer(n_head, n_layers, "head_count"))))
        first_heads = per_layer(n_head, n_layers, "head_count")[0]
        family["rope_theta_local"] = as_float(key("rope.freq_base_swa", 10000.0), f"{source}: {arch}.rope.freq_base_swa")
        family["query_pre_attn_scalar"] = float(n_embd // first_heads if n_layers == _GEMMA3_27B_LAYERS else head_dim)
        if scaling == "linear":
            family["rope_scaling_factor"] = as_float(key("rope.scaling.factor", 1.0), f"{source}: {arch}.rope.scaling.factor")
            scaling = None
    if key("final_logit_softcapping") is not None:
        family["final_logit_softcap"] = as_float(key("final_logit_softcapping"), f"{source}: {arch}.final_logit_softcapping")
    if arch in DELTANET_ARCHS:
        family["attn_output_gate"] = True
        if key("ssm.state_size") is not None and key("ssm.inner_size") is not None:
            k_heads = as_int(key("ssm.group_count", 0), f"{source}: {arch}.ssm.group_count", 1)
            v_heads = as_int(key("ssm.time_step_rank", k_heads), f"{source}: {arch}.ssm.time_step_rank", 1)
            inner = as_int(key("ssm.inner_size"), f"{source}: {arch}.ssm.inner_size", 1)
            if inner % v_heads:
                raise ConfigError(f"{source}: {arch}.ssm.inner_size={inner} is not a multiple of ssm.time_step_rank={v_heads}")
            family["linear_attention"] = LinearAttentionFacts(
                k_heads=k_heads, v_heads=v_heads, k_dim=as_int(key("ssm.state_size"), f"{source}: {arch}.ssm.state_size", 1),
                v_dim=inner // v_heads, conv_kernel=as_int(key("ssm.conv_kernel", 4), f"{source}: {arch}.ssm.conv_kernel", 1))
        if key("expert_count"):
            what = lambda name: f"{source}: {arch}.{name}"  # noqa: E731
            family["moe"] = MoEFacts(
                n_experts=as_int(key("expert_count"), what("expert_count"), 1),
                top_k=as_int(key("expert_used_count", 1), what("expert_used_count"), 1),
                d_ff_expert=as_int(key("expert_feed_forward_length"), what("expert_feed_forward_length"), 1),
                d_ff_shared=as_int(key("expert_shared_feed_forward_length", 0), what("expert_shared_feed_forward_length")))
    return RuntimeFacts(
        format="gguf",
        d_ff=n_ff[0] if len(set(n_ff)) == 1 else tuple(n_ff),
        rope_theta=as_float(key("rope.freq_base", 10000.0), f"{source}: {arch}.rope.freq_base"),
        rope_scaling_type=None if scaling in (None, "none") else str(scaling),
        rope_dim=int(key("rope.dimension_count", 0)),
        rope_freq_factors=factors,
        rms_eps=as_float(key("attention.layer_norm_rms_epsilon", 1e-5), f"{source}: {arch}.attention.layer_norm_rms_epsilon"),
        tie_embeddings="output.weight" not in names,
        qk_norm=any(name.endswith(".attn_q_norm.weight") for name in names),   # layer 0 may be recurrent
        qkv_bias=any(name.endswith(".attn_q.bias") for name in names),
        bos_id=ids["bos_token_id"],
        eos_ids=tuple(sorted({i for i in (ids["eos_token_id"], ids["eot_token_id"]) if i is not None})),
        tensors={t.name: TensorInfo(t.name, tuple(reversed(t.shape)), t.tensor_type.name) for t in gguf_file.tensors},
        **family,
    )


def spec_from_gguf(gguf_file: GGUFFile) -> ModelSpec:
    """A ModelSpec from GGUF metadata keys; weights_bytes are the tensor table's exact bytes.

    The spec carries the runtime's facts (RuntimeFacts: RoPE, norms, biases, tied head, token ids, the
    tensor table): this is the only parse of a GGUF's metadata.
    """
    try:
        return _spec_from_gguf(gguf_file)
    except (ValueError, TypeError, KeyError, OverflowError) as exc:  # a value of an unexpected kind the checks missed
        raise ConfigError(f"{gguf_file.path}: malformed GGUF metadata ({type(exc).__name__}: {str(exc)[:200]})") from None


def _spec_from_gguf(gguf_file: GGUFFile) -> ModelSpec:
    md, source = gguf_file.metadata, str(gguf_file.path)
    arch = gguf_file.architecture
    if not arch:
        raise ConfigError(f"{source}: no general.architecture in the GGUF metadata")
    key = lambda name, default=None: md.get(f"{arch}.{name}", default)  # noqa: E731
    n_layers = key("block_count")
    if n_layers is None:
        raise ConfigError(f"{source}: no {arch}.block_count in the GGUF metadata")
    n_layers = layer_count(n_layers, f"{source}: {arch}.block_count")
    _checked_metadata(md, arch, source)
    n_embd = int(key("embedding_length", 0))
    head_count = key("attention.head_count")
    if head_count is None:
        raise ConfigError(f"{source}: no {arch}.attention.head_count in the GGUF metadata")
    n_heads = per_layer(head_count, n_layers, f"{source}: {arch}.attention.head_count")
    kv_heads = per_layer(key("attention.head_count_kv", head_count), n_layers, f"{source}: {arch}.attention.head_count_kv")
    n_ff = per_layer(key("feed_forward_length", 0), n_layers, f"{source}: {arch}.feed_forward_length")
    max_heads = max(n_heads)
    head_dim_k = int(key("attention.key_length", n_embd // max_heads if max_heads else 0))
    head_dim_v = int(key("attention.value_length", n_embd // max_heads if max_heads else 0))

    kinds = _gguf_kinds(md, arch, n_layers, kv_heads, n_ff)
    facts = LayerFacts(
        n_layers, kinds, n_heads, kv_heads, head_dim_k, head_dim_v,
        window=_window(md, arch) or None,
        head_dim_k_swa=key("attention.key_length_swa"),
        head_dim_v_swa=key("attention.value_length_swa"),
    )
    if key("attention.key_length_mla") and key("attention.value_length_mla"):
        # llama.cpp's MLA cache: K only, key_length values per KV head (latent + RoPE key)
        rank = int(key("attention.kv_lora_rank", 0))
        facts.kinds = ["mla" if k == "full" else k for k in facts.kinds]
        facts.kv_lora_rank = rank
        facts.rope_dim = head_dim_k * max(kv_heads) - rank
    if "recurrent" in facts.kinds:
        facts.state_elements = _gguf_state_elements(md, arch, n_embd, max_heads)
    layers = build_layers(facts, source)
    vocab = _vocab_size(md, arch, source)
    return ModelSpec(
        name=str(md.get("general.name") or gguf_file.path.stem),
        arch=arch,
        layers=layers,
        d_model=n_embd,
        vocab_size=vocab,
        context_length=int(key("context_length", 0)),
        n_params=sum(t.n_elements for t in gguf_file.tensors),
        weights_bytes=gguf_file.tensor_bytes,
        source=source,
        extra={"n_ff": max(n_ff), "n_expert": int(key("expert_count", 0)), "n_expert_used": int(key("expert_used_count", 0)),
               "file_size": gguf_file.file_size, "dtype": "gguf",
               # what kvlab's native weights hold of this file (sources/native.py), for the planner
               "native_weight_bytes": native_weight_bytes({t.name: t for t in gguf_file.tensors}, len(layers))},
        runtime=_runtime_facts(gguf_file, arch, vocab, n_ff),
    )


# -- writing (test fixtures, the oracle's tiny models, benchmarks) ---------------------------------

def _value_type(value: Any):
    from gguf import GGUFValueType as T

    if isinstance(value, bool):
        return T.BOOL
    if isinstance(value, int):
        return T.UINT32 if 0 <= value < 1 << 32 else T.INT64
    if isinstance(value, float):
        return T.FLOAT32
    if isinstance(value, str):
        return T.STRING
    raise ValueError(f"cannot store {type(value).__name__} in GGUF metadata")


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write a GGUF with `metadata` (plain Python values) and optional f32/f16 tensors.

    ints are stored as uint32 (int64 when out of range), floats as float32, lists as arrays of
    their first item's type. `general.architecture` must be in `metadata`.
    """
    from gguf import GGUFValueType, GGUFWriter

    path = Path(path)
    writer = GGUFWriter(path, str(metadata["general.architecture"]))
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, (list, tuple)):
            items = list(value)
            item_type = _value_type(items[0]) if items else GGUFValueType.UINT32
            if item_type == GGUFValueType.UINT32 and any(v < 0 for v in items):
                item_type = GGUFValueType.INT32
            writer.add_key_value(key, items, GGUFValueType.ARRAY, sub_type=item_type)
        else:
            writer.add_key_value(key, value, _value_type(value))
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
