"""The prefix cache on disk (`kvlab serve --kv-store DIR`): full KV blocks kept in the pool's own format, so a
restarted server answers the next turn of a saved conversation without prefilling its history again.

    DIR/<id>/about.json     what the blocks are of: model, cache format, block size, file version (for people, and for
                            the one line a server of another model or format prints about them)
    DIR/<id>/<key>.kvb      one full block, named by its prefix-cache key (blocks.py: SHA-256 chained over the token
                            ids from the identity), written when the request that computed it has finished
    DIR/saved/<name>        a conversation saved on request (POST /kv/save): its full blocks in one file

`<id>` is the identity's first 16 hex digits. The identity is SHA-256 over the model's weights and config, the
cache format's canonical name, the block size, the block's layout and (TurboQuant) the calibrated codec state: one
folder holds the stores of several models and formats side by side, and a server only reads its own.

A file, both kinds (little-endian; plain bytes, never a pickle):
    b"KVLABKV\\0"  u32 version  u32 n  n bytes of JSON header  payload  u32 CRC-32 of everything before it
    header   {"digest", "model", "format", "block_size", "tokens": [...] (block_size per block), "first": whether
              they are a sequence's first}, padded with spaces so the payload starts 64-byte aligned (the block's
              layout, [[name, dtype, shape], ...], is in about.json and in the digest)
    payload  [the prefix state, when "first" and the pool keeps one] then block after block, each its parts' raw
             bytes in order: the pool's own buffers (dense K/V in its dtype, int codes + scales, TurboQuant codes +
             norms, +sinkN's exact first rows), so a file's bytes per token are the pool's
A file that is torn, truncated, of another version or of another identity is refused with one line (logged; the
block is recomputed and written again) and nothing else is touched.

When. The blocks of a request are written when it finishes: they are what an agent's next turn asks for, a crash
after the turn loses nothing, and no disk write comes between the steps of a running prefill. The engine thread
copies the new blocks out of the pool (a memcpy); a writer thread writes them (temporary name + os.replace, no
fsync: the checksum refuses what a power cut tears), keeps the folder under its byte cap (least recently used
blocks go first; reading a block is a use) and is drained at shutdown. Reading is lazy: a prefix-cache miss at
admission asks the store before it gives the prefix up, so a server starts at once whatever the store holds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import re
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, StoreFileError
from ..fileio import atomic_path, check_writable_folder, write_json

log = logging.getLogger("kvlab.serve")

MAGIC = b"KVLABKV\0"
VERSION = 1
ALIGN = 64                     # the payload starts at a multiple of this
BLOCK_SUFFIX = ".kvb"
SAVED = "saved"                # DIR/saved/<name>: conversations saved on request
#: a saved conversation's file name (llama-server's rule: no folders, no hidden files)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PREFIX = struct.Struct("<8sII")


@dataclass(frozen=True)
class StoreIdentity:
    digest: str                # hex SHA-256: what the blocks' keys chain from
    model: str
    format: str
    block_size: int
    parts: tuple               # ((name, dtype, shape), ...) of one block
    state_parts: tuple = ()    # ((name, dtype, shape), ...) of the prefix state a sequence's first block comes with

    @property
    def folder(self) -> str:
        return self.digest[:16]

    @property
    def root(self) -> bytes:
        """The prefix cache's key before a sequence's first block."""
        return bytes.fromhex(self.digest)

    @property
    def block_nbytes(self) -> int:
        return _nbytes(self.parts)

    @property
    def state_nbytes(self) -> int:
        return _nbytes(self.state_parts)

    def describe(self) -> str:
        return f"{self.model} as {self.format} (blocks of {self.block_size})"


def check_servable(config, pool, prefix_caching: bool, n_groups: int = 1) -> None:
    """ConfigError (one line) when the served model or pool cannot keep its prefix cache on disk."""
    if not prefix_caching:
        raise ConfigError("--kv-store keeps the prefix cache on disk: it needs prefix caching on")
    kinds = set(getattr(config, "layer_kinds", ()) or ())
    if kinds - {"full", "sliding"}:
        raise ConfigError(f"--kv-store holds attention blocks only; {config.name} has {', '.join(sorted(kinds))} layers")
    if n_groups > 1:
        raise ConfigError(f"--kv-store keeps one block table per sequence; {config.name}'s sliding and full layers keep "
                          f"{n_groups} (layer groups)")
    sinks = getattr(pool, "sinks", None)
    if sinks and sinks.sink > pool.block_size:
        raise ConfigError(f"--kv-store keeps sink rows with a sequence's first block: {pool.plan.format} has more sink "
                          f"tokens ({sinks.sink}) than a block ({pool.block_size})")


def store_identity(model, pool, block_size: int) -> StoreIdentity:
    """The identity of the K/V this model computes into this pool (see the module's docstring)."""
    parts = _layout((name, t.dtype, tuple(t.shape)) for name, t in pool.block_parts(0))
    state = _layout(getattr(pool, "prefix_state_layout", ()))
    fmt = pool.plan.format                              # the canonical name
    digest = hashlib.sha256(f"kvlab kv store {VERSION}|{model.config!r}|{fmt}|{block_size}|{parts}|{state}".encode())
    seen = set()
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        if tensor.data_ptr() not in seen:          # a tied weight once
            seen.add(tensor.data_ptr())
            digest.update(_raw(tensor))
    codec = getattr(pool, "codec", None)
    for tensor in codec.calibrated_state() if codec is not None else ():
        digest.update(_raw(tensor))
    return StoreIdentity(digest.hexdigest(), model.config.name, fmt, block_size, parts, state)


# -- the file --------------------------------------------------------------------------------------------------
def parts_bytes(parts) -> bytes:
    """A copy of views' raw bytes, in order: a block (pool.block_parts) or a prefix state as the file holds it."""
    return b"".join(_raw(t) for _, t in parts)


def block_bytes(pool, block: int) -> bytes:
    return parts_bytes(pool.block_parts(block))


def fill_parts(parts, payload, offset: int) -> int:
    """Copy views' contents from `payload` (a writable buffer) at `offset`; returns the offset after them."""
    for _, part in parts:
        n = part.numel()
        part.copy_(torch.frombuffer(payload, dtype=part.dtype, count=n, offset=offset).reshape(part.shape))
        offset += n * part.element_size()
    return offset


@dataclass
class StoredFile:
    """A store file read and checked: its tokens, and where in `data` its prefix state and blocks begin."""

    tokens: list[int]
    first: bool                # the tokens are a sequence's first (the prefix state comes with them)
    data: bytearray
    state_at: int | None       # offset of the prefix state, if the file holds one
    blocks_at: int


def write_file(path: Path, identity: StoreIdentity, tokens: list[int], blocks: list[bytes], first: bool,
               durable: bool) -> int:
    """Write a store file atomically (`blocks`: the prefix state first when `first` and the identity has one);
    returns its size."""
    header = json.dumps({"digest": identity.digest, "model": identity.model, "format": identity.format,
                         "block_size": identity.block_size, "tokens": list(tokens), "first": first}).encode()
    start = _PREFIX.size + len(header)
    header += b" " * (-start % ALIGN)
    crc = 0
    with atomic_path(path, durable) as tmp, open(tmp, "wb") as f:
        for chunk in (_PREFIX.pack(MAGIC, VERSION, len(header)), header, *blocks):
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
        f.write(struct.pack("<I", crc))
        size = f.tell()
    return size


def read_file(path: Path, identity: StoreIdentity) -> StoredFile:
    """A store file of this identity, checked; StoreFileError (one line) for anything else: not such a file,
    another version, torn or truncated, another model or format."""
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        got = f.readinto(data)
    if got != len(data) or len(data) < _PREFIX.size + 4:
        raise StoreFileError(f"{path}: truncated ({len(data)} bytes)")
    magic, version, n = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise StoreFileError(f"{path}: not a kvlab KV store file")
    if version != VERSION:
        raise StoreFileError(f"{path}: KV store file version {version}; this kvlab reads version {VERSION}")
    if zlib.crc32(memoryview(data)[:-4]) != struct.unpack_from("<I", data, len(data) - 4)[0]:
        raise StoreFileError(f"{path}: torn or corrupted (its checksum does not match)")
    try:
        header = json.loads(bytes(data[_PREFIX.size:_PREFIX.size + n]))
        theirs = StoreIdentity(header["digest"], header["model"], header["format"], header["block_size"], ())
        tokens, first = [int(t) for t in header["tokens"]], bool(header["first"])
    except (ValueError, KeyError, TypeError) as err:
        raise StoreFileError(f"{path}: unreadable header ({err})") from None
    if theirs.digest != identity.digest:
        what = "other weights or calibration" if theirs.describe() == identity.describe() else theirs.describe()
        raise StoreFileError(f"{path}: KV of {what}; this server runs {identity.describe()}")
    start = _PREFIX.size + n
    state = identity.state_nbytes if first and identity.state_parts else 0
    blocks = len(tokens) // identity.block_size
    if len(tokens) % identity.block_size or len(data) - 4 - start != state + blocks * identity.block_nbytes:
        raise StoreFileError(f"{path}: {len(tokens)} tokens do not match its {len(data) - 4 - start} bytes of blocks")
    return StoredFile(tokens, first, data, start if state else None, start + state)


@dataclass
class Snapshot:
    """Blocks copied out of the pool, to be written to one file off the engine thread (POST /kv/save)."""

    identity: StoreIdentity
    tokens: list[int]          # a sequence's first ones
    blocks: list[bytes]        # the prefix state (if the pool keeps one), then the blocks

    def write(self, path: Path) -> int:
        return write_file(path, self.identity, self.tokens, self.blocks, first=True, durable=True)


# -- the store -------------------------------------------------------------------------------------------------
class KVStore:
    """One server's blocks on disk: which are there (an LRU by use), lazy reads into the pool, background writes."""

    def __init__(self, folder, identity: StoreIdentity, pool, max_bytes: int):
        self.base = check_writable_folder(folder, "--kv-store")
        self.identity, self.pool, self.max_bytes = identity, pool, max_bytes
        self.folder = self.base / identity.folder
        self.folder.mkdir(exist_ok=True)
        write_json(self.folder / "about.json", {"version": VERSION, **asdict(identity)})
        self.lock = threading.Lock()
        self.files: OrderedDict[str, int] = OrderedDict()     # key hex -> bytes, least recently used first
        self.pending: set[str] = set()                         # queued for the writer
        self.refused: list[str] = []                           # the one-line refusals so far
        self._scan()
        self.writes: queue.Queue = queue.Queue()
        self.writer = threading.Thread(target=self._write_loop, name="kvlab-kv-store", daemon=True)
        self.writer.start()

    def _scan(self) -> None:
        """Index the blocks already here (oldest use first), drop temporaries a crash left, name other stores."""
        found = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".tmp"):
                Path(entry.path).unlink(missing_ok=True)
            elif entry.name.endswith(BLOCK_SUFFIX) and entry.is_file():
                stat = entry.stat()
                found.append((stat.st_mtime_ns, entry.name[:-len(BLOCK_SUFFIX)], stat.st_size))
        for _, key, size in sorted(found):
            self.files[key] = size
        others = []
        for about in sorted(self.base.glob("*/about.json")):
            if about.parent != self.folder:
                try:
                    info = json.loads(about.read_text())
                    others.append(f"{info['model']} as {info['format']}")
                except (OSError, ValueError, KeyError, TypeError):
                    others.append(about.parent.name)
        if others:
            log.warning("--kv-store %s also holds KV of %s: not used by this server (%s)", self.base,
                        "; ".join(others), self.identity.describe())

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(self.files.values())

    def path(self, key_hex: str) -> Path:
        return self.folder / f"{key_hex}{BLOCK_SUFFIX}"

    # -- reading (the engine thread) -------------------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        with self.lock:
            return key.hex() in self.files

    def load(self, key: bytes, parent_key: bytes, ids: tuple[int, ...], block: int) -> bool:
        """BlockManager's source: fill `block` with the stored block of this key (True), or say it cannot."""
        stored = self._read(key)
        if stored is None:
            return False
        if tuple(stored.tokens) != ids or stored.first != (parent_key == self.identity.root):
            self._refuse(key, f"{self.path(key.hex())}: holds other tokens than its name says")
            return False
        fill_parts(self.pool.block_parts(block), stored.data, stored.blocks_at)
        return True

    def load_state(self, token_ids, key: bytes) -> bool:
        """BlockManager's hook for pools that keep per-sequence state of a prefix (+sinkN rows): take it from the
        stored first block (`key`) of `token_ids`, if there is one."""
        stored = self._read(key)
        if stored is None or stored.state_at is None or stored.tokens != list(token_ids[:len(stored.tokens)]):
            return False
        parts = self.pool.prefix_state_parts(token_ids, adopt=True)
        if parts is None:
            return False
        fill_parts(parts, stored.data, stored.state_at)
        return True

    def _read(self, key: bytes) -> StoredFile | None:
        """The checked file of a block this store lists, or None (not listed, gone, or refused: one line)."""
        name = key.hex()
        with self.lock:
            if name not in self.files:
                return None
            self.files.move_to_end(name)
        path = self.path(name)
        try:
            stored = read_file(path, self.identity)
            os.utime(path)                                    # a use: the LRU order outlives the process
        except FileNotFoundError:                             # evicted meanwhile
            self._forget(name)
            return None
        except (OSError, StoreFileError) as err:
            self._refuse(key, str(err) if isinstance(err, StoreFileError) else f"{path}: {err.strerror or err}")
            return None
        return stored

    def _refuse(self, key: bytes, message: str) -> None:
        """Say why a file is not used, once; it is written again when its block is computed again."""
        self.refused.append(message)
        log.warning("KV store file refused: %s", message)
        self._forget(key.hex())

    def _forget(self, name: str) -> None:
        with self.lock:
            self.files.pop(name, None)

    # -- writing ---------------------------------------------------------------------------------------------
    def save(self, chain, state: bytes | None) -> int:
        """Queue the blocks of a sequence's `chain` ((key, tokens, block id) from its first block) the store lacks;
        `state`: its prefix state's bytes (written with its first block; None: the pool keeps none for it, and
        nothing is stored). The engine thread copies them out of the pool now, the writer thread writes them."""
        queued = 0
        if self.identity.state_parts and state is None:
            return 0
        for i, (key, tokens, block) in enumerate(chain):
            name = key.hex()
            with self.lock:
                if name in self.files or name in self.pending:
                    continue
                self.pending.add(name)
            payload = [state, block_bytes(self.pool, block)] if i == 0 and self.identity.state_parts else \
                [block_bytes(self.pool, block)]
            self.writes.put((name, list(tokens), payload, i == 0))
            queued += 1
        return queued

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self.writes.join()

    def close(self) -> None:
        self.flush()
        self.writes.put(None)
        self.writer.join(30)

    def _write_loop(self) -> None:
        while True:
            item = self.writes.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as err:  # noqa: BLE001  (a full disk costs a block on disk, never the server)
                log.warning("KV store: writing a block failed: %s", err)
            finally:
                if item is not None:
                    with self.lock:
                        self.pending.discard(item[0])
                self.writes.task_done()

    def _write(self, name: str, tokens: list[int], payload: list[bytes], first: bool) -> None:
        size = write_file(self.path(name), self.identity, tokens, payload, first, durable=False)
        evict = []
        with self.lock:
            self.files[name] = size
            self.files.move_to_end(name)
            total = sum(self.files.values())
            while total > self.max_bytes and len(self.files) > 1:
                old, old_size = self.files.popitem(last=False)
                evict.append(old)
                total -= old_size
        for old in evict:
            self.path(old).unlink(missing_ok=True)

    # -- saved conversations (POST /kv/save, /kv/restore) ---------------------------------------------------
    def saved_path(self, name: str) -> Path:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ConfigError(f"filename {name!r}: 1-128 letters, digits, '.', '_' or '-', not starting with '.'")
        return self.base / SAVED / name


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _layout(parts) -> tuple:
    """((name, dtype name, shape), ...): how a layout is written and hashed."""
    return tuple((name, str(dtype).removeprefix("torch."), tuple(shape)) for name, dtype, shape in parts)


def _nbytes(layout) -> int:
    return sum(getattr(torch, dtype).itemsize * math.prod(shape) for _, dtype, shape in layout)
