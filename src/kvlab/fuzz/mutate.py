"""Seeded mutations of model files, written as lists of plain edits (JSON) so every case can be saved and replayed.

A case is `make_case(target, seed, index)`: the mutation kind cycles with the index (any run of len(kinds)
consecutive indices covers every kind) and its parameters come from random.Random(f"{target}:{seed}:{index}").
`materialize(case, seeds, folder)` writes the mutated file or folder and returns the path kvlab is given.
Edits, not the random stream, are what a corpus descriptor stores: a saved case replays even after the
mutators change.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .formats import GGUFLayout, HFFolder, TensorInfo, encode_value, nested_array

GGUF_TARGETS = ("tiny-gguf", "smollm2")
TARGETS = (*GGUF_TARGETS, "tiny-hf")


@dataclass
class Case:
    target: str                       # tiny-gguf | smollm2 | tiny-hf
    kind: str                         # the mutation kind (one of KINDS[target])
    label: str                        # what was done, in words
    edits: list[dict]
    seed: int | None = None
    index: int | None = None
    steps: tuple[str, ...] = ("info", "plan", "generate", "api")
    chat: bool = False                # generate with --chat (the case edits a chat template)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> "Case":
        fields = {k: record[k] for k in cls.__dataclass_fields__ if k in record}
        fields["steps"] = tuple(fields.get("steps", cls.steps))
        return cls(**fields)


# -- interesting values ----------------------------------------------------------------------------------------

INTS = [0, 1, -1, 2, 3, 7, 12, 32, 1000, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63 - 1, -(2**31)]
FLOATS = [9.5, 0.0, -1.0, 1e30, math.nan, math.inf, 1e-45]
TEMPLATES = {
    "syntax error": "{% for m in messages %}{{ m['content'] }",
    "endless loop": "{% for i in range(10**12) %}x{% endfor %}",
    "huge output": "{{ 'x' * 10**10 }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "undefined index": "{{ messages[7]['content'] }}",
    "raises": "{{ raise_exception('no') }}",
    "sandbox escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "empty": "",
}


def _int_type(value: int, usual: str) -> str:
    if value < 0:
        return "i32" if value >= -(2**31) else "i64"
    if value >= 2**32:
        return "u64"
    return usual if usual in ("u32", "i32", "u64", "i64") and (usual != "i32" or value < 2**31) else "u32"


# -- GGUF mutators: (rng, layout) -> (label, edits, chat) ---------------------------------------------------

def _hyper_keys(layout: GGUFLayout) -> list[str]:
    arch = layout.value("general.architecture") or "llama"
    suffixes = ("attention.head_count", "attention.head_count_kv", "embedding_length", "block_count",
                "feed_forward_length", "context_length", "attention.key_length", "attention.value_length",
                "rope.dimension_count", "vocab_size", "attention.sliding_window")
    return [f"{arch}.{s}" for s in suffixes] + [
        "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "general.alignment"]


def _float_keys(layout: GGUFLayout) -> list[str]:
    arch = layout.value("general.architecture") or "llama"
    return [f"{arch}.rope.freq_base", f"{arch}.attention.layer_norm_rms_epsilon"]


def gguf_truncate(rng, layout):
    region = rng.choice(["preamble", "metadata", "tensor_info", "padding", "data", "data end"])
    regions = layout.regions()
    if region == "data end":
        at = regions["data"][1] - rng.randint(1, 64)
    else:
        start, end = regions[region]
        at = rng.randrange(start, max(end, start + 1))
    return f"truncate at byte {at:,} ({region})", [{"op": "truncate", "at": at}]


def gguf_flip_header(rng, layout):
    start, end = layout.regions()["metadata"]
    keys = list(layout.kv)
    edits = []
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.3:
            at = rng.randrange(0, 24)                     # magic, version, counts
        elif rng.random() < 0.6:                           # a length, type id or count field of one entry
            key = rng.choice(keys)
            at = _kv_offset(layout, key) + rng.randrange(0, min(24, 8 + len(key.encode()) + 16))
        else:
            at = rng.randrange(start, end)
        edits.append({"op": "flip", "at": at, "xor": rng.choice([1, 0x80, 0xFF, 1 << rng.randrange(8)])})
    return f"{len(edits)} byte flips in the preamble/metadata", edits


def gguf_flip_tensor_info(rng, layout):
    start, end = layout.regions()["tensor_info"]
    edits = [{"op": "flip", "at": rng.randrange(start, end), "xor": rng.choice([1, 2, 0x40, 0x80, 0xFF])}
             for _ in range(rng.randint(1, 4))]
    return f"{len(edits)} byte flips in the tensor table", edits


def gguf_kv_value(rng, layout):
    if rng.random() < 0.2:
        key = rng.choice(_float_keys(layout))
        value = rng.choice(FLOATS)
        return f"{key} = {value} (f32)", [{"op": "set_kv", "key": key, "type": "f32", "value": value}]
    key = rng.choice(_hyper_keys(layout))
    usual = layout.type_name(key) or "u32"
    current = layout.value(key)
    if key.startswith("tokenizer.ggml.") and rng.random() < 0.6:  # ids just past / far beyond the vocab
        vocab = layout.array_length("tokenizer.ggml.tokens") or 0
        value = rng.choice([vocab, vocab + 1, 2**31 - 1, -1])
    elif isinstance(current, int) and current > 0 and rng.random() < 0.5:  # plausible, but not what the tensors say
        value = rng.choice([current * 2, current // 2, current + 1, current - 1, current + 32, current * 3 // 4])
    else:
        value = rng.choice(INTS)
    kind = _int_type(value, usual)
    return f"{key} = {value} ({kind})", [{"op": "set_kv", "key": key, "type": kind, "value": value}]


def gguf_kv_type(rng, layout):
    key = rng.choice(_hyper_keys(layout) + _float_keys(layout))
    current = layout.value(key)
    number = current if isinstance(current, (int, float)) and not isinstance(current, bool) else 9
    kind, value = rng.choice([
        ("str", str(number)), ("f32", float(number) + 0.5), ("arr:u32", [int(number)] * 3), ("bool", True),
        ("arr:str", ["x"]), ("i64", -int(number) - 1), ("f64", float(number)), ("arr:arr:u32", [[1], [2, 3]]),
        ("u8", 255), ("str", ""),
    ])
    return f"{key} retyped to {kind} = {str(value)[:30]}", [{"op": "set_kv", "key": key, "type": kind, "value": value}]


def gguf_kv_nest(rng, layout):
    key = rng.choice(_hyper_keys(layout)[:4] + ["general.fuzz", "tokenizer.ggml.merges"])
    depth = rng.choice([3, 900, 2000, 50000])
    return f"{key} = arrays nested {depth} deep", [{"op": "nest_kv", "key": key, "depth": depth}]


def gguf_kv_count(rng, layout):
    choice = rng.randrange(5)
    if choice == 0:  # the preamble's counts
        tensors, keys = len(layout.tensors), len(layout.kv)
        which = rng.choice(["tensors", "keys"])
        value = rng.choice([2**32 - 1, 2**31, 10**6, (keys if which == "keys" else tensors) + 1, 0])
        counts = {"tensors": value, "keys": keys} if which == "tensors" else {"tensors": tensors, "keys": value}
        return f"preamble {which} count = {value}", [{"op": "counts", **counts}]
    key = rng.choice(["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "general.fuzz"])
    payloads = [
        ("u8 array declaring 2^31 items", struct.pack("<IIQ", 9, 0, 2**31)),
        ("string declaring 2^31 bytes", struct.pack("<IQ", 8, 2**31)),
        ("str array declaring 10^9 items", struct.pack("<IIQ", 9, 8, 10**9)),
        ("array of arrays declaring 2^30 items", struct.pack("<IIQ", 9, 9, 2**30) + struct.pack("<IQ", 0, 0) * 4),
        ("f64 array declaring 2^28 items", struct.pack("<IIQ", 9, 12, 2**28)),
        ("array of unknown type 77", struct.pack("<IIQ", 9, 77, 3)),
        ("value of unknown type 200", struct.pack("<I", 200)),
    ]
    what, raw = rng.choice(payloads)
    return f"{key}: {what}", [{"op": "raw_kv", "key": key, "hex": raw.hex()}]


def gguf_kv_delete(rng, layout):
    arch = layout.value("general.architecture") or "llama"
    key = rng.choice([f"{arch}.attention.head_count", f"{arch}.embedding_length", f"{arch}.block_count",
                      f"{arch}.feed_forward_length", f"{arch}.context_length", "general.architecture",
                      "tokenizer.ggml.tokens", "tokenizer.ggml.model", "tokenizer.ggml.token_type",
                      f"{arch}.attention.head_count_kv", "tokenizer.ggml.merges"])
    return f"delete {key}", [{"op": "del_kv", "key": key}]


def _matrix(rng, layout, two_d=True) -> TensorInfo:
    pool = [t for t in layout.tensors if (len(t.shape) == 2) == two_d] or layout.tensors
    early = [t for t in pool if not t.name.startswith("blk.") or t.name.startswith("blk.0.")]
    return rng.choice(early or pool)


def gguf_tensor_shape(rng, layout):
    t = _matrix(rng, layout, two_d=rng.random() < 0.8)
    cols, rows = (t.shape + [1, 1])[:2]
    options = {
        "rows doubled": [cols, rows * 2], "rows halved": [cols, max(1, rows // 2)], "cols doubled": [cols * 2, rows],
        "dims swapped": [rows, cols], "one dim": [cols * rows], "three dims": [cols, rows, 1], "0 dims": [],
        "zero rows": [cols, 0], "rows 2^32": [cols, 2**32], "element count overflows": [2**40, 2**40],
        "one row short": [cols, max(0, rows - 1)], "1 row": [cols, 1], "cols + 32": [cols + 32, rows],
    }
    plausible = ["rows doubled", "rows halved", "cols doubled", "dims swapped", "cols + 32"]  # what reaches the kernels
    what = rng.choice(plausible if len(t.shape) == 2 and rng.random() < 0.5 else sorted(options))
    return f"{t.name} shape {t.shape} -> {options[what]} ({what})", [{"op": "tensor", "name": t.name, "shape": options[what]}]


def gguf_tensor_type(rng, layout):
    t = _matrix(rng, layout, two_d=rng.random() < 0.8)
    type_id = rng.choice([0, 1, 2, 3, 8, 12, 14, 24, 26, 30, 99, 2**31])
    return f"{t.name} type {t.type_id} -> {type_id}", [{"op": "tensor", "name": t.name, "type_id": type_id}]


def gguf_tensor_offset(rng, layout):
    t = rng.choice(layout.tensors)
    data_size = layout.file_size - layout.data_start
    other = rng.choice(layout.tensors)
    options = {"another tensor's": other.offset, "misaligned": t.offset + 1, "past the end": data_size,
               "2^63": 2**63, "u64 max": 2**64 - 1, "just before the end": max(0, data_size - 32), "zero": 0}
    what = rng.choice(sorted(options))
    return f"{t.name} offset -> {options[what]} ({what})", [{"op": "tensor", "name": t.name, "offset": options[what]}]


def gguf_tensor_table(rng, layout):
    t = _matrix(rng, layout, two_d=rng.random() < 0.7)
    first = layout.tensors[0]
    options = [
        (f"drop {t.name}", {"op": "del_tensor", "name": t.name}),
        (f"duplicate {t.name}", {"op": "dup_tensor", "name": t.name}),
        (f"rename {t.name} to an empty name", {"op": "tensor", "name": t.name, "rename": ""}),
        ("add output.weight of one row", {"op": "add_tensor", "name": "output.weight", "shape": first.shape[:1] + [1],
                                          "type_id": first.type_id, "offset": first.offset}),
        ("add blk.0.attn_q.bias of 3 values", {"op": "add_tensor", "name": "blk.0.attn_q.bias", "shape": [3],
                                              "type_id": 0, "offset": 0}),
        ("add rope_freqs.weight of 1 value", {"op": "add_tensor", "name": "rope_freqs.weight", "shape": [1],
                                             "type_id": 0, "offset": 0}),
        ("add blk.0.attn_q_norm.weight (qk-norm) of 5 values", {"op": "add_tensor", "name": "blk.0.attn_q_norm.weight",
                                                             "shape": [5], "type_id": 0, "offset": 0}),
    ]
    label, edit = rng.choice(options)
    return label, [edit]


def gguf_chat_template(rng, layout):
    what = rng.choice(sorted(TEMPLATES) + ["not a string"])
    if what == "not a string":
        return "chat template is a u32", [{"op": "set_kv", "key": "tokenizer.chat_template", "type": "u32", "value": 5}]
    return f"chat template: {what}", [{"op": "set_kv", "key": "tokenizer.chat_template", "type": "str", "value": TEMPLATES[what]}]


def gguf_tokenizer(rng, layout):
    n = layout.array_length("tokenizer.ggml.tokens") or 1
    options = [
        ("no tokens", {"op": "set_kv", "key": "tokenizer.ggml.tokens", "type": "arr:str", "value": []}),
        ("tokens are integers", {"op": "set_kv", "key": "tokenizer.ggml.tokens", "type": "arr:i32", "value": [1, 2, 3]}),
        ("token types of 3 entries", {"op": "set_kv", "key": "tokenizer.ggml.token_type", "type": "arr:i32", "value": [3, 3, 3]}),
        ("merges of unknown symbols", {"op": "set_kv", "key": "tokenizer.ggml.merges", "type": "arr:str", "value": ["zz qq", "a"]}),
        ("tokenizer model 'llama'", {"op": "set_kv", "key": "tokenizer.ggml.model", "type": "str", "value": "llama"}),
        ("pre-tokenizer 'nonsense'", {"op": "set_kv", "key": "tokenizer.ggml.pre", "type": "str", "value": "nonsense"}),
        ("all tokens control", {"op": "set_kv", "key": "tokenizer.ggml.token_type", "type": "arr:i32", "value": [3] * n}),
        ("add_bos with BOS beyond vocab", {"op": "set_kv", "key": "tokenizer.ggml.add_bos_token", "type": "bool", "value": True}),
    ]
    label, edit = rng.choice(options)
    edits = [edit]
    if label.startswith("add_bos"):
        edits.append({"op": "set_kv", "key": "tokenizer.ggml.bos_token_id", "type": "u32", "value": n + 5})
    return label, edits


GGUF_KINDS = {
    "truncate": gguf_truncate, "flip_header": gguf_flip_header, "flip_tensor_info": gguf_flip_tensor_info,
    "kv_value": gguf_kv_value, "kv_type": gguf_kv_type, "kv_nest": gguf_kv_nest, "kv_count": gguf_kv_count,
    "kv_delete": gguf_kv_delete, "tensor_shape": gguf_tensor_shape, "tensor_type": gguf_tensor_type,
    "tensor_offset": gguf_tensor_offset, "tensor_table": gguf_tensor_table, "chat_template": gguf_chat_template,
    "tokenizer": gguf_tokenizer,
}


def _kv_offset(layout: GGUFLayout, key: str) -> int:
    pos = 24
    for k, v in layout.kv.items():
        if k == key:
            return pos
        pos += 8 + len(k.encode()) + len(v)
    raise KeyError(key)


# -- Hugging Face folder mutators: (rng, folder) -> (label, edits) -----------------------------------------------

HF_KEYS = ["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size",
           "vocab_size", "max_position_embeddings", "head_dim", "rms_norm_eps", "rope_theta", "sliding_window",
           "tie_word_embeddings", "rope_scaling", "eos_token_id", "bos_token_id", "model_type", "use_sliding_window"]
JSON_VALUES = [0, -1, 1, 3, 12, 2**31, 2**63, 10**30, 9.5, math.nan, math.inf, "12", None, [4], {"a": 1}, True, "",
               {"rope_type": "llama3", "factor": "x"}, {"rope_type": "llama3"}]


def hf_config_value(rng, folder):
    key, value = rng.choice(HF_KEYS), rng.choice(JSON_VALUES)
    return f"config.json {key} = {json.dumps(value)[:40]}", [{"op": "json_set", "file": "config.json", "path": [key], "value": value}]


def hf_config_doc(rng, folder):
    options = [("a list", []), ("null", None), ("a number", 5), ("a string", "llama"), ("empty", {})]
    if rng.random() < 0.3:
        return "config.json truncated", [{"op": "truncate", "file": "config.json", "at": rng.randrange(1, 120)}]
    if rng.random() < 0.3:
        depth = rng.choice([900, 2000, 100000])
        return f"config.json is a list nested {depth} deep", [{"op": "json_nest", "file": "config.json", "path": [], "depth": depth}]
    label, value = rng.choice(options)
    return f"config.json is {label}", [{"op": "json_set", "file": "config.json", "path": [], "value": value}]


def hf_config_nest(rng, folder):
    key, depth = rng.choice(HF_KEYS[:6] + ["rope_scaling"]), rng.choice([3, 2000, 100000])
    return f"config.json {key} nested {depth} deep", [{"op": "json_nest", "file": "config.json", "path": [key], "depth": depth}]


def hf_config_delete(rng, folder):
    key = rng.choice(HF_KEYS[:7] + ["model_type"])
    return f"config.json without {key}", [{"op": "json_del", "file": "config.json", "path": [key]}]


def _st_tensor(rng, folder) -> str:
    names = [n for n in folder.weights.header if n != "__metadata__"]
    early = [n for n in names if ".layers." not in n or ".layers.0." in n]
    return rng.choice(early)


def hf_st_shape(rng, folder):
    name = _st_tensor(rng, folder)
    shape = folder.weights.header[name]["shape"]
    rows, cols = (shape + [1])[:2]
    options = {"rows doubled": [rows * 2, cols], "dims swapped": [cols, rows], "one dim": [rows * cols],
               "extra dim": [rows, cols, 1], "no dims": [], "zero rows": [0, cols], "huge": [2**62, 2**62],
               "negative": [-rows, cols], "strings": ["a", "b"], "rows halved, same bytes": [rows // 2, cols * 2]}
    what = rng.choice(sorted(options))
    return f"{name} shape {shape} -> {options[what]} ({what})", [
        {"op": "st_set", "tensor": name, "field": "shape", "value": options[what]}]


def hf_st_dtype(rng, folder):
    name = _st_tensor(rng, folder)
    dtype = rng.choice(["F16", "BF16", "I64", "U8", "F64", "F8_E4M3", "XX", 5, None])
    return f"{name} dtype -> {dtype}", [{"op": "st_set", "tensor": name, "field": "dtype", "value": dtype}]


def hf_st_offsets(rng, folder):
    name = _st_tensor(rng, folder)
    begin, end = folder.weights.header[name]["data_offsets"]
    size = len(folder.weights.data)
    options = {"past the end": [begin, size + 4096], "reversed": [end, begin], "empty": [begin, begin],
               "negative": [-8, end], "huge": [2**63, 2**63 + 4], "strings": ["0", "4"], "three": [0, 4, 8],
               "overlap": [0, end - begin]}
    what = rng.choice(sorted(options))
    return f"{name} data_offsets -> {options[what]} ({what})", [
        {"op": "st_set", "tensor": name, "field": "data_offsets", "value": options[what]}]


def hf_st_header(rng, folder):
    choice = rng.randrange(4)
    if choice == 0:
        value = rng.choice([0, 2, 2**63, 2**40, 10**6, 100])
        return f"safetensors header length = {value}", [{"op": "st_header_length", "value": value}]
    if choice == 1:
        text, what = rng.choice([("[]", "a list"), ("null", "null"), ("{", "broken JSON"), ("[" * 5000 + "]" * 5000, "nested 5000"),
                                 ('{"__metadata__": 5}', "metadata only, a number"), ("\udcff", "not UTF-8")])
        return f"safetensors header is {what}", [{"op": "st_header_text", "text": text}]
    if choice == 2:
        name = _st_tensor(rng, folder)
        return f"safetensors entry {name} is a list", [{"op": "st_set", "tensor": name, "field": None, "value": [1, 2]}]
    at = rng.randrange(1, len(folder.weights.to_bytes()))
    return f"model.safetensors truncated at {at:,}", [{"op": "truncate", "file": "model.safetensors", "at": at}]


def hf_tokenizer_json(rng, folder):
    options = [
        ("tokenizer.json truncated", {"op": "truncate", "file": "tokenizer.json", "at": 200}),
        ("vocab is a list", {"op": "json_set", "file": "tokenizer.json", "path": ["model", "vocab"], "value": ["a", "b"]}),
        ("model type Unigram", {"op": "json_set", "file": "tokenizer.json", "path": ["model", "type"], "value": "Unigram"}),
        ("added token id 10^6", {"op": "json_set", "file": "tokenizer.json", "path": ["added_tokens", 0, "id"], "value": 10**6}),
        ("vocab id 10^9", {"op": "json_set", "file": "tokenizer.json", "path": ["model", "vocab", "a"], "value": 10**9}),
        ("empty vocab", {"op": "json_set", "file": "tokenizer.json", "path": ["model", "vocab"], "value": {}}),
        ("tokenizer.json is null", {"op": "json_set", "file": "tokenizer.json", "path": [], "value": None}),
        ("eos token unknown", {"op": "json_set", "file": "tokenizer_config.json", "path": ["eos_token"], "value": "<nope>"}),
        ("eos token a number", {"op": "json_set", "file": "tokenizer_config.json", "path": ["eos_token"], "value": 7}),
        ("tokenizer_config.json is a list", {"op": "json_set", "file": "tokenizer_config.json", "path": [], "value": [1]}),
    ]
    label, edit = rng.choice(options)
    return label, [edit]


def hf_chat_template(rng, folder):
    what = rng.choice(sorted(TEMPLATES) + ["a list", "a number"])
    value = {"a list": [{"name": "default", "template": 5}], "a number": 5}.get(what, TEMPLATES.get(what))
    return f"chat template: {what}", [{"op": "json_set", "file": "tokenizer_config.json", "path": ["chat_template"], "value": value}]


def hf_remove(rng, folder):
    name = rng.choice(["config.json", "tokenizer.json", "model.safetensors", "tokenizer_config.json"])
    return f"remove {name}", [{"op": "rm", "file": name}]


def hf_flip(rng, folder):
    name = rng.choice(["config.json", "model.safetensors", "tokenizer.json"])
    size = len(folder.file_bytes(name))
    limit = min(size, 8 + len(json.dumps(folder.weights.header))) if name == "model.safetensors" else size
    edits = [{"op": "flip", "file": name, "at": rng.randrange(0, limit), "xor": rng.choice([1, 0x20, 0x80, 0xFF])}
             for _ in range(rng.randint(1, 4))]
    return f"{len(edits)} byte flips in {name}", edits


HF_KINDS = {
    "config_value": hf_config_value, "config_doc": hf_config_doc, "config_nest": hf_config_nest,
    "config_delete": hf_config_delete, "st_shape": hf_st_shape, "st_dtype": hf_st_dtype, "st_offsets": hf_st_offsets,
    "st_header": hf_st_header, "tokenizer": hf_tokenizer_json, "chat_template": hf_chat_template, "remove": hf_remove,
    "flip": hf_flip,
}


def kinds(target: str) -> list[str]:
    return list(HF_KINDS if target == "tiny-hf" else GGUF_KINDS)


# -- cases --------------------------------------------------------------------------------------------------------


@dataclass
class Seeds:
    """The unmutated inputs, built once per run: tiny GGUF path, SmolLM2 path, the tiny HF folder in memory."""

    tiny_gguf: Path
    hf: HFFolder
    smollm2: Path | None = None
    _layouts: dict = field(default_factory=dict)

    @classmethod
    def build(cls, folder: Path, with_smollm2: bool = True) -> "Seeds":
        from .seeds import smollm2_path, tiny_hf_folder, write_tiny_gguf

        folder.mkdir(parents=True, exist_ok=True)
        return cls(write_tiny_gguf(folder / "tiny.gguf"), tiny_hf_folder(), smollm2_path() if with_smollm2 else None)

    def layout(self, target: str) -> GGUFLayout:
        if target not in self._layouts:
            path = self.tiny_gguf if target == "tiny-gguf" else self.smollm2
            if path is None:
                raise ValueError("the SmolLM2 target was not built")
            self._layouts[target] = GGUFLayout.read(path)
        return self._layouts[target]


def make_case(target: str, seed: int, index: int, seeds: Seeds) -> Case:
    names = kinds(target)
    kind = names[index % len(names)]
    rng = random.Random(f"{target}:{seed}:{index}")
    if target == "tiny-hf":
        label, edits = HF_KINDS[kind](rng, seeds.hf)
    else:
        label, edits = GGUF_KINDS[kind](rng, seeds.layout(target))
    steps = ("info", "plan", "generate") if target == "smollm2" else Case.steps  # its dense conversion: 540 MB, a minute
    return Case(target, kind, label, edits, seed, index, steps=steps, chat=kind == "chat_template")


def materialize(case: Case, seeds: Seeds, folder: Path) -> Path:
    """Write the case's mutated model into `folder`; returns the path kvlab is given."""
    folder.mkdir(parents=True, exist_ok=True)
    if case.target == "tiny-hf":
        return _write_hf(case.edits, seeds.hf, folder / "model")
    return _write_gguf(case.edits, seeds.layout(case.target), folder / "model.gguf")


def _write_gguf(edits: list[dict], base: GGUFLayout, target: Path) -> Path:
    layout = copy.copy(base)
    layout.kv, layout.tensors = dict(base.kv), [copy.copy(t) for t in base.tensors]
    tensors = {t.name: t for t in layout.tensors}
    for e in edits:
        op = e["op"]
        if op == "set_kv":
            layout.kv[e["key"]] = encode_value(e["type"], e["value"])
        elif op == "raw_kv":
            layout.kv[e["key"]] = bytes.fromhex(e["hex"])
        elif op == "nest_kv":
            layout.kv[e["key"]] = nested_array(e["depth"])
        elif op == "del_kv":
            layout.kv.pop(e["key"], None)
        elif op == "counts":
            layout.counts = (e["tensors"], e["keys"])
        elif op == "tensor":
            t = tensors[e["name"]]
            t.shape = list(e.get("shape", t.shape))
            t.type_id = e.get("type_id", t.type_id)
            t.offset = e.get("offset", t.offset)
            t.name = e.get("rename", t.name)
        elif op == "del_tensor":
            layout.tensors.remove(tensors[e["name"]])
        elif op == "dup_tensor":
            layout.tensors.append(copy.copy(tensors[e["name"]]))
        elif op == "add_tensor":
            layout.tensors.append(TensorInfo(e["name"], list(e["shape"]), e["type_id"], e["offset"]))
    layout.write(target)
    _byte_edits(edits, target)
    return target


def _byte_edits(edits: list[dict], path: Path) -> None:
    """flip and truncate: applied to the written file, in order."""
    with open(path, "r+b") as fh:
        for e in edits:
            if e["op"] == "flip" and e["at"] < os.fstat(fh.fileno()).st_size:
                fh.seek(e["at"])
                byte = fh.read(1)[0]
                fh.seek(e["at"])
                fh.write(bytes([byte ^ e["xor"]]))
            elif e["op"] == "truncate":
                fh.truncate(e["at"])


_NEST = "\u0000fuzz-nest\u0000"


def _write_hf(edits: list[dict], base: HFFolder, folder: Path) -> Path:
    hf = HFFolder(copy.deepcopy(base.json_files), copy.deepcopy(base.weights))
    nests: dict[str, int] = {}
    for e in edits:
        op = e["op"]
        if op in ("json_set", "json_nest"):
            value = _NEST if op == "json_nest" else e["value"]
            if op == "json_nest":
                nests[e["file"]] = e["depth"]
            if e["path"]:
                _parent(hf.json_files[e["file"]], e["path"])[e["path"][-1]] = value
            else:
                hf.json_files[e["file"]] = value
        elif op == "json_del":
            _parent(hf.json_files[e["file"]], e["path"]).pop(e["path"][-1], None)
        elif op == "st_set":
            if e["field"] is None:
                hf.weights.header[e["tensor"]] = e["value"]
            else:
                hf.weights.header[e["tensor"]][e["field"]] = e["value"]
        elif op == "st_header_length":
            hf.weights.header_length = e["value"]
        elif op == "st_header_text":
            hf.weights.header_text = e["text"]
        elif op == "rm":
            hf.removed.add(e["file"])
    for name, depth in nests.items():  # written as text: json.dumps would recurse `depth` deep
        text = json.dumps(hf.json_files[name], indent=1).replace(json.dumps(_NEST), "[" * depth + "1" + "]" * depth)
        hf.raw[name] = text.encode()
    hf.write(folder)
    for e in edits:
        if e["op"] in ("flip", "truncate") and e["file"] not in hf.removed:
            _byte_edits([e], folder / e["file"])
    return folder


def _parent(doc, path: list):
    for key in path[:-1]:
        doc = doc[key]
    return doc


__all__ = ["Case", "Seeds", "make_case", "materialize", "kinds", "TARGETS", "GGUF_TARGETS"]
