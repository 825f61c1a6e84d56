"""Editable model files for the fuzzer: a GGUF header as spans of raw bytes, a safetensors file as header + data.

`GGUFLayout.read(path)` splits a GGUF file into its preamble, one raw span per metadata key, one parsed entry per
tensor and the offset where tensor data starts; edits replace spans, `header_bytes()` writes them back, and
`write()` appends the original tensor data with an in-kernel copy (the 100 MB SmolLM2 file is never read into
Python). This parser is the fuzzer's own, deliberately independent of kvlab's reader under test.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

# GGUF value types: name -> (type id, struct format); "str" = 8, arrays = 9
SCALARS = {"u8": (0, "B"), "i8": (1, "b"), "u16": (2, "H"), "i16": (3, "h"), "u32": (4, "I"), "i32": (5, "i"),
           "f32": (6, "f"), "bool": (7, "?"), "u64": (10, "Q"), "i64": (11, "q"), "f64": (12, "d")}
SCALAR_BY_ID = {type_id: (name, fmt) for name, (type_id, fmt) in SCALARS.items()}
STRING, ARRAY = 8, 9
PREAMBLE = 24  # magic, version, tensor count, key count


def encode_string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def encode_value(type_name: str, value) -> bytes:
    """A typed value (type id + payload). Types: SCALARS names, "str", "arr:<item type>" (nestable)."""
    return struct.pack("<I", _type_id(type_name)) + _payload(type_name, value)


def _type_id(type_name: str) -> int:
    if type_name == "str":
        return STRING
    if type_name.startswith("arr:"):
        return ARRAY
    return SCALARS[type_name][0]


def _payload(type_name: str, value) -> bytes:
    if type_name == "str":
        return encode_string(str(value))
    if type_name.startswith("arr:"):
        item = type_name[4:]
        head = struct.pack("<IQ", _type_id(item), len(value))
        return head + b"".join(_payload(item, v) for v in value)
    return struct.pack("<" + SCALARS[type_name][1], value)


def nested_array(depth: int, leaf_type: str = "u32", leaf=1) -> bytes:
    """A value of `depth` arrays, each holding the next, the innermost holding one `leaf` (no recursion)."""
    inner = struct.pack("<IQ", _type_id(leaf_type), 1) + _payload(leaf_type, leaf)
    return struct.pack("<I", ARRAY) + struct.pack("<IQ", ARRAY, 1) * (depth - 1) + inner


class _Cursor:
    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def take(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        text = self.data[self.pos:self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return text

    def skip_value(self, type_id: int) -> None:
        if type_id in SCALAR_BY_ID:
            self.pos += struct.calcsize("<" + SCALAR_BY_ID[type_id][1])
        elif type_id == STRING:
            self.pos += 8 + struct.unpack_from("<Q", self.data, self.pos)[0]
        elif type_id == ARRAY:
            item, n = self.take("I"), self.take("Q")
            if item in SCALAR_BY_ID:
                self.pos += n * struct.calcsize("<" + SCALAR_BY_ID[item][1])
            else:
                for _ in range(n):
                    self.skip_value(item)
        else:
            raise ValueError(f"unknown GGUF value type {type_id}")


@dataclass
class TensorInfo:
    name: str
    shape: list[int]     # GGUF order: fastest-varying first
    type_id: int
    offset: int          # relative to the start of tensor data

    def encode(self) -> bytes:
        return (encode_string(self.name) + struct.pack("<I", len(self.shape)) + struct.pack(f"<{len(self.shape)}Q", *self.shape)
                + struct.pack("<IQ", self.type_id, self.offset))


@dataclass
class GGUFLayout:
    """A GGUF file taken apart: the parts edits change, and where the untouched tensor data lives."""

    path: Path
    version: int
    kv: dict[str, bytes]              # key -> typed value bytes (type id + payload), in file order
    tensors: list[TensorInfo]
    data_start: int                   # where tensor data starts in the original file
    file_size: int
    counts: tuple[int, int] | None = None  # (tensors, keys) as written, when an edit overrides them

    @classmethod
    def read(cls, path: Path) -> "GGUFLayout":
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(min(size, 64 << 20))  # headers are a few MB; tensor data is never read
        cur = _Cursor(head)
        if head[:4] != b"GGUF":
            raise ValueError(f"{path} is not GGUF")
        cur.pos = 4
        version, n_tensors, n_kv = cur.take("I"), cur.take("Q"), cur.take("Q")
        kv = {}
        for _ in range(n_kv):
            key = cur.string()
            start = cur.pos
            cur.skip_value(cur.take("I"))
            kv[key] = head[start:cur.pos]
        tensors = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.take("I")
            shape = [cur.take("Q") for _ in range(n_dims)]
            tensors.append(TensorInfo(name, shape, cur.take("I"), cur.take("Q")))
        layout = cls(path, version, kv, tensors, 0, size)
        layout.data_start = _align(cur.pos, layout.alignment())
        return layout

    def value(self, key: str):
        """A scalar or string value (arrays: None)."""
        raw = self.kv.get(key)
        if raw is None:
            return None
        type_id = struct.unpack_from("<I", raw)[0]
        if type_id in SCALAR_BY_ID:
            return struct.unpack_from("<" + SCALAR_BY_ID[type_id][1], raw, 4)[0]
        if type_id == STRING:
            return _Cursor(raw, 4).string()
        return None

    def type_name(self, key: str) -> str | None:
        raw = self.kv.get(key)
        if raw is None:
            return None
        type_id = struct.unpack_from("<I", raw)[0]
        return SCALAR_BY_ID[type_id][0] if type_id in SCALAR_BY_ID else {STRING: "str", ARRAY: "arr"}.get(type_id)

    def array_length(self, key: str) -> int | None:
        raw = self.kv.get(key)
        if raw is None or struct.unpack_from("<I", raw)[0] != ARRAY:
            return None
        return struct.unpack_from("<Q", raw, 8)[0]

    def alignment(self) -> int:
        value = self.value("general.alignment")
        return value if isinstance(value, int) and value > 0 and not isinstance(value, bool) else 32

    def regions(self) -> dict[str, tuple[int, int]]:
        """Byte ranges of the written header: preamble, metadata, tensor table, padding, data."""
        meta_end = PREAMBLE + sum(len(encode_string(k)) + len(v) for k, v in self.kv.items())
        table_end = meta_end + sum(len(t.encode()) for t in self.tensors)
        data = _align(table_end, self.alignment())
        return {"preamble": (0, PREAMBLE), "metadata": (PREAMBLE, meta_end), "tensor_info": (meta_end, table_end),
                "padding": (table_end, data), "data": (data, data + self.file_size - self.data_start)}

    def header_bytes(self) -> bytes:
        n_tensors, n_kv = self.counts or (len(self.tensors), len(self.kv))
        parts = [b"GGUF", struct.pack("<IQQ", self.version, n_tensors, n_kv)]
        parts += [encode_string(k) + v for k, v in self.kv.items()]
        parts += [t.encode() for t in self.tensors]
        header = b"".join(parts)
        return header + b"\0" * (_align(len(header), self.alignment()) - len(header))

    def write(self, target: Path) -> int:
        """header + the original tensor data (copied by the kernel) -> target; returns the file's size."""
        header = self.header_bytes()
        with open(self.path, "rb") as src, open(target, "wb") as dst:
            dst.write(header)
            dst.flush()
            _copy_range(src.fileno(), self.data_start, dst.fileno(), self.file_size - self.data_start)
        return len(header) + self.file_size - self.data_start


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _copy_range(src_fd: int, offset: int, dst_fd: int, count: int) -> None:
    while count > 0:
        copied = os.copy_file_range(src_fd, dst_fd, count, offset_src=offset)
        if copied <= 0:
            raise OSError(f"copy_file_range stopped with {count} bytes left")
        offset += copied
        count -= copied


# -- safetensors -------------------------------------------------------------------------------------------


@dataclass
class SafetensorsFile:
    header: dict                      # the JSON header (tensor name -> dtype/shape/data_offsets, __metadata__)
    data: bytes
    header_length: int | None = None  # the 8-byte length prefix, when an edit overrides it
    header_text: str | None = None    # the header as written, when an edit makes it something other than JSON

    @classmethod
    def build(cls, tensors: dict[str, "object"]) -> "SafetensorsFile":
        """numpy arrays -> a safetensors file (F32/F16/BF16-free: the fuzzer only needs F32)."""
        header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
        for name, array in tensors.items():
            raw = array.astype("<f4").tobytes()
            header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
            chunks.append(raw)
            offset += len(raw)
        return cls(header, b"".join(chunks))

    def to_bytes(self) -> bytes:
        text = self.header_text if self.header_text is not None else json.dumps(self.header)
        raw = text.encode("utf-8", errors="surrogateescape")  # "\udcff" -> a lone 0xFF byte
        raw += b" " * (-len(raw) % 8)
        length = len(raw) if self.header_length is None else self.header_length
        return struct.pack("<Q", length) + raw + self.data


@dataclass
class HFFolder:
    """A Hugging Face model folder held in memory: JSON documents, a safetensors file, raw overrides."""

    json_files: dict[str, object]                            # file name -> parsed JSON
    weights: SafetensorsFile
    raw: dict[str, bytes] = field(default_factory=dict)      # file name -> bytes written instead
    removed: set[str] = field(default_factory=set)

    def file_bytes(self, name: str) -> bytes:
        if name in self.raw:
            return self.raw[name]
        if name == "model.safetensors":
            return self.weights.to_bytes()
        return json.dumps(self.json_files[name], indent=1).encode("utf-8")

    def names(self) -> list[str]:
        return sorted((set(self.json_files) | {"model.safetensors"} | set(self.raw)) - self.removed)

    def write(self, folder: Path) -> int:
        folder.mkdir(parents=True, exist_ok=True)
        total = 0
        for name in self.names():
            data = self.file_bytes(name)
            (folder / name).write_bytes(data)
            total += len(data)
        return total
