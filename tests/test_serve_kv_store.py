"""`kvlab serve --kv-store DIR`: the prefix cache on disk, and POST /kv/save, /kv/restore.

The restart test is the issue's proof: a server answers a conversation's first turn and stops; a new server on
the same folder answers the next turn with cached_tokens equal to the history's full blocks and the very text
the uninterrupted server gives. The rest: a file flipped, cut short, or of another model or format is refused
with one line and the rest of the store still serves; writes are atomic; the size cap holds; blocks are written in
the pool's own format (bytes per token = the pool's).
"""

from __future__ import annotations

import functools
import logging
import shutil
from types import SimpleNamespace

import pytest

from kvlab.errors import ConfigError, StoreFileError
from kvlab.serve import Engine, SamplingParams
from kvlab.serve.kv_store import BLOCK_SUFFIX, check_servable, read_file, write_file

from .conftest import tiny_model

BS = 16
GREEDY = SamplingParams(max_tokens=2, temperature=0)


def engine(model, folder, cache="dense-f16", **kw) -> Engine:
    return Engine(model, cache=cache, kv_budget=kw.pop("kv_budget", "8MiB"), max_batch=2, block_size=BS,
                  kv_store=None if folder is None else str(folder), **kw)


def run(e: Engine, ids: list[int]):
    out = e.generate([ids], GREEDY, progress=False)[0]
    if e.store is not None:
        e.store.flush()
    return out


def conversation(seed: int, n: int = 4 * BS + 3) -> list[int]:
    """Token ids of a long-ish history (no template needed: the store keys token ids)."""
    return [(1000 + 7919 * (i + seed)) % 49152 for i in range(n)]


def common_blocks(a: list[int], b: list[int]) -> int:
    """Tokens in the full blocks `a` and `b` share from the start (what a prefix cache can give `b`)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // BS * BS


def block_files(e: Engine) -> list:
    return sorted(e.store.folder.glob(f"*{BLOCK_SUFFIX}"))


def chain_file(e: Engine, ids: list[int], i: int):
    """The file of block i of a conversation (its key is the prefix cache's)."""
    key = e.blocks.root
    for j in range(i + 1):
        key = e.blocks.chain_key(key, tuple(ids[j * BS:(j + 1) * BS]))
    return e.store.path(key.hex())


def serve_on_loopback(smollm2, e):
    """A real HTTP server (openai/httpx clients on a loopback port) over engine `e`."""
    from kvlab.serve.http import ServerConfig, create_app

    from .serve_fakes import ServerThread

    config = ServerConfig(model_name="smollm2", context_length=smollm2.config.max_seq_len, max_running=2,
                          max_waiting=2, shutdown_grace_s=0.5)
    return ServerThread(create_app(e, smollm2.tokenizer, config))


# -- the restart, over HTTP ------------------------------------------------------------------------------------
def test_restart_answers_the_next_turn_from_the_store_as_the_uninterrupted_server(smollm2, tmp_path):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    server = functools.partial(serve_on_loopback, smollm2)

    def ask(url, messages):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=6, temperature=0)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    history = [{"role": "system", "content": "You are a patient assistant who answers in short sentences. " * 4},
               {"role": "user", "content": "Name three rivers of Europe and say where each one flows."}]
    uninterrupted = engine(smollm2, tmp_path / "a")
    with server(uninterrupted) as a:
        reply, _ = ask(a.url, history)
        uninterrupted.store.flush()
        shutil.copytree(tmp_path / "a", tmp_path / "b")        # the store as a server stopped here leaves it
        turn = [*history, {"role": "assistant", "content": reply}, {"role": "user", "content": "And the longest?"}]
        expected_text, expected_cached = ask(a.url, turn)
    first = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(history), add_special=False)
    computed = first + smollm2.tokenizer.encode(reply, add_special=False)       # what the first turn left cached
    nxt = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(turn), add_special=False)
    assert expected_cached == common_blocks(computed, nxt) >= len(first) // BS * BS > 0

    restarted = engine(smollm2, tmp_path / "b")
    assert restarted.blocks.index == {} and len(restarted.store.files) >= len(first) // BS   # nothing in memory yet
    with server(restarted) as b:
        text, cached = ask(b.url, turn)
    assert (text, cached) == (expected_text, expected_cached)
    assert not restarted.store.refused


def test_save_and_restore_one_conversation_through_the_endpoints(smollm2, tmp_path):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    server = functools.partial(serve_on_loopback, smollm2)

    ids = conversation(11)
    with server(engine(smollm2, tmp_path / "a")) as a:
        post = lambda route, **body: httpx.post(f"{a.url}{route}", json=body, timeout=60)   # noqa: E731
        first = post("/v1/completions", prompt=ids, max_tokens=3, temperature=0).json()
        saved = post("/kv/save", filename="conv-1", tokens=ids).json()
        assert saved["n_saved"] == len(ids) // BS * BS and saved["n_written"] > saved["n_saved"] * 1000
        last = post("/slots/0?action=save", filename="last").json()            # llama-server's route and shape
        assert last["id_slot"] == 0 and last["n_saved"] == (len(ids) + 2) // BS * BS
        assert post("/kv/save", filename="../up", tokens=ids).status_code == 400
    saved_file = tmp_path / "a" / "saved" / "conv-1"
    (tmp_path / "b" / "saved").mkdir(parents=True)
    shutil.copy(saved_file, tmp_path / "b" / "saved" / "conv-1")                  # only the saved file, no blocks
    data = bytearray(saved_file.read_bytes())
    data[-100] ^= 1
    (tmp_path / "b" / "saved" / "torn").write_bytes(bytes(data))
    with server(engine(smollm2, tmp_path / "b")) as b:
        post = lambda route, **body: httpx.post(f"{b.url}{route}", json=body, timeout=60)   # noqa: E731
        restored = post("/kv/restore", filename="conv-1").json()
        assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
        again = post("/v1/completions", prompt=ids, max_tokens=3, temperature=0).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == saved["n_saved"]
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        torn = post("/kv/restore", filename="torn")
        assert torn.status_code == 400 and "checksum" in torn.json()["error"]["message"]
        assert post("/kv/restore", filename="nothing").status_code == 404
    with server(engine(smollm2, None)) as c:
        off = httpx.post(f"{c.url}/kv/save", json={"filename": "x"}, timeout=60)
        assert off.status_code == 400 and "--kv-store" in off.json()["error"]["message"]


# -- refusals: one line each, the rest of the store still serves ---------------------------------------------
@pytest.fixture(scope="module")
def two_conversations(smollm2, tmp_path_factory):
    """A store holding two conversations' blocks (dense-f16), and what the engine answered them."""
    folder = tmp_path_factory.mktemp("kv-store")
    e = engine(smollm2, folder)
    a, b = conversation(0), conversation(50)
    outs = {tuple(ids): run(e, ids) for ids in (a, b)}
    e.close()
    return SimpleNamespace(folder=folder, a=a, b=b, outs=outs, engine=e)


@pytest.fixture()
def stored(smollm2, two_conversations, tmp_path):
    """A copy of that store for one test to change (`engine`: one on it, to name its files)."""
    shared, folder = two_conversations, tmp_path / "store"
    shutil.copytree(shared.folder, folder)
    e = engine(smollm2, folder)
    return SimpleNamespace(folder=folder, a=shared.a, b=shared.b, outs=shared.outs, engine=e, files=block_files(e))


def restarted_answers(smollm2, folder, ids, expected_cached):
    e = engine(smollm2, folder)
    out = run(e, ids)
    assert out.cached_prompt_tokens == expected_cached
    return e, out


def test_a_flipped_byte_or_a_cut_file_is_refused_with_one_line_and_the_rest_still_serves(smollm2, stored, caplog):
    flipped, cut = chain_file(stored.engine, stored.a, 2), chain_file(stored.engine, stored.b, 1)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x10
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING, logger="kvlab.serve"):
        e, out = restarted_answers(smollm2, stored.folder, stored.a, 2 * BS)       # blocks 0, 1 from disk, then 2 refused
        assert out.token_ids == stored.outs[tuple(stored.a)].token_ids
        assert run(e, stored.b).cached_prompt_tokens == BS                          # block 0, then the cut one
    assert len(e.store.refused) == 2
    assert all("\n" not in m for m in e.store.refused)
    assert str(flipped) in e.store.refused[0] and "checksum" in e.store.refused[0]
    assert str(cut) in e.store.refused[1] and "checksum" in e.store.refused[1]
    assert sum("refused" in r.getMessage() for r in caplog.records) == 2
    e.close()                                                   # the refused blocks were computed again: written anew
    for path in (flipped, cut):
        read_file(path, e.store.identity)
    e2, _ = restarted_answers(smollm2, stored.folder, stored.a, len(stored.a) // BS * BS)
    assert not e2.store.refused


def test_a_file_of_another_format_or_model_is_refused_and_their_stores_are_left_alone(smollm2, stored, caplog):
    other = engine(smollm2, stored.folder, cache="int8")
    assert other.store.folder != stored.engine.store.folder      # side by side in one folder
    run(other, stored.a)                                           # nothing of the dense-f16 store is read
    other.close()
    assert [p.read_bytes() for p in block_files(stored.engine)] == [p.read_bytes() for p in stored.files]
    foreign = block_files(other)[0]
    victim = chain_file(stored.engine, stored.a, 1)
    shutil.copy(foreign, victim)                                   # an int8 block where a dense-f16 one should be
    tiny = engine(tiny_model(), stored.folder, kv_budget="1MiB")   # another model: its own, empty store
    assert len(tiny.store.files) == 0
    with caplog.at_level(logging.WARNING, logger="kvlab.serve"):
        e, _ = restarted_answers(smollm2, stored.folder, stored.a, BS)
        assert run(e, stored.b).cached_prompt_tokens == len(stored.b) // BS * BS     # the other conversation: whole
    assert len(e.store.refused) == 1
    message = e.store.refused[0]
    assert str(victim) in message and "int8+g16" in message and "dense-f16" in message and "\n" not in message
    assert any("also holds KV of" in r.getMessage() and "int8+g16" in r.getMessage() for r in caplog.records)
    with pytest.raises(StoreFileError, match="another|version|KV of"):
        read_file(foreign, e.store.identity)


def test_writes_are_atomic_and_a_crash_leaves_nothing_half_written(smollm2, stored):
    e = stored.engine
    target = stored.files[0]
    before = target.read_bytes()
    with pytest.raises(TypeError):                                 # a write that dies half way
        write_file(target, e.store.identity, [0] * BS, [b"x" * 1000, object()], first=False, durable=False)
    assert target.read_bytes() == before
    assert not [p for p in stored.folder.rglob("*") if p.name.endswith(".tmp")]
    for path in stored.files:                                      # every file visible is whole
        read_file(path, e.store.identity)
    leftover = e.store.folder / f".{target.name}.abc.tmp"          # what a process killed mid-write leaves
    leftover.write_bytes(before[:100])
    again = engine(smollm2, stored.folder)
    assert not leftover.exists() and len(again.store.files) == len(stored.files)


def test_the_size_cap_holds_least_recently_used_first(smollm2, tmp_path):
    e = engine(smollm2, tmp_path)
    block_file = e.store.identity.block_nbytes
    cap = 3 * block_file + 3 * 4096                                # three blocks and their headers
    e.close()
    e = engine(smollm2, tmp_path, kv_store_bytes=cap)
    ids = conversation(7, 6 * BS + 1)
    run(e, ids)
    files = block_files(e)
    assert len(files) == len(e.store.files) == 3 and e.store.nbytes <= cap
    assert sum(p.stat().st_size for p in files) <= cap
    assert set(files) == {chain_file(e, ids, i) for i in (3, 4, 5)}   # the last written stay
    e.close()


def test_blocks_are_written_in_the_pool_format(smollm2, tmp_path):
    """Bytes on disk per token are the pool's: a block's file payload is exactly its block_bytes (+ one header)."""
    sizes = {}
    for cache in ("dense-f16", "int8", "tq-k4v4+sink1"):
        e = engine(smollm2, tmp_path / cache, cache=cache)
        ids = conversation(3, 2 * BS + 1)
        first = run(e, ids)
        e.close()
        assert e.store.identity.block_nbytes == e.capacity.block_bytes
        files = [read_file(path, e.store.identity) for path in block_files(e)]
        assert len(files) == 2 and all(len(f.data) - 4 - f.blocks_at == e.capacity.block_bytes for f in files)
        assert all((f.state_at or f.blocks_at) < 1024 for f in files)   # one small header each
        assert [f.blocks_at - f.state_at for f in files if f.state_at] == \
            ([e.store.identity.state_nbytes] if "sink" in cache else [])   # +sink1: the rows with the first block
        sizes[cache] = e.capacity.block_bytes
        again = engine(smollm2, tmp_path / cache, cache=cache)
        out = run(again, ids)                                      # +sink1: its sink rows come back with block 0
        assert out.cached_prompt_tokens == 2 * BS and out.token_ids == first.token_ids
        again.close()
    assert sizes["dense-f16"] > sizes["int8"] > sizes["tq-k4v4+sink1"]


def test_what_the_store_cannot_hold_is_refused_with_one_line(smollm2, tmp_path):
    hybrid = SimpleNamespace(name="a hybrid", layer_kinds=("full", "recurrent"))
    with pytest.raises(ConfigError, match="attention blocks only.*recurrent"):
        check_servable(hybrid, SimpleNamespace(), True)
    with pytest.raises(ConfigError, match="prefix caching"):
        engine(smollm2, tmp_path, prefix_caching=False)
    with pytest.raises(ConfigError, match="--kv-store-max"):
        engine(smollm2, tmp_path, kv_store_bytes="lots")
    (tmp_path / "file").write_text("x")
    with pytest.raises(Exception, match="--kv-store .*file"):
        engine(smollm2, tmp_path / "file")


def test_a_miss_the_store_does_not_hold_costs_no_cached_block():
    from kvlab.serve.blocks import BlockManager
    from kvlab.serve.sequence import Sequence

    class Nothing:
        def has(self, key):
            return False

        def load(self, *args):
            raise AssertionError("load asked without has")

    m = BlockManager(2, 2, store=Nothing())
    seq = Sequence("a", [1, 2, 3, 4])
    assert m.take_cached_prefix(seq) == 0
    m.reserve(seq, 4)
    seq.num_computed = 4
    m.register_full_blocks(seq)
    m.free(seq)                                                    # every block full, cached, in the LRU
    index, lru = dict(m.index), list(m.free_lru)
    assert len(index) == 2
    assert m.take_cached_prefix(Sequence("b", [9, 8, 7])) == 0
    assert (m.index, list(m.free_lru)) == (index, lru)
