"""Session KV persistence: the stores (disk, a real redis-server), the engine across restarts and
replicas, and the HTTP API (session_id, GET/DELETE /v1/sessions/{id}, summary anchoring).

Redis tests start their own `redis-server` (no persistence, a free port, a temp dir) and skip only
when the binary is missing; `.ci/run` installs it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from glmserve.kv.chunk_store import ChunkStore, DiskChunkStore
from glmserve.kv.redis_store import RedisChunkStore
from glmserve.kv.sessions import SessionStore, session_key

REDIS_BIN = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS_BIN is None, reason="redis-server is not installed (.ci/run installs it)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS_BIN is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [REDIS_BIN, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("redis-server did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


_prefixes = iter(range(1_000_000))


def redis_store(url: str, budget: int = 1 << 20, ttl_s: float | None = None, prefix: str | None = None
                ) -> RedisChunkStore:
    """A store under a fresh key prefix (tests share one server)."""
    return RedisChunkStore(url, budget, prefix=prefix or f"t{next(_prefixes)}:", ttl_s=ttl_s)


# -- RedisChunkStore ---------------------------------------------------------------------------------------
@needs_redis
def test_redis_store_round_trip_and_sharing(redis_url: str) -> None:
    a = redis_store(redis_url)
    b = RedisChunkStore(redis_url, 1 << 20, prefix=a.prefix)  # another replica on the same Redis
    assert a.put("k1", b"x" * 100) and a.put("k2", b"")
    assert b.get("k1") == b"x" * 100 and b.get("k2") == b""
    assert "k1" in b and "nope" not in b
    assert sorted(b.keys()) == ["k1", "k2"]
    assert a.nbytes == b.nbytes == a.entry_size("k1", b"x" * 100) + a.entry_size("k2", b"")
    b.delete("k1")
    assert a.get("k1") is None and a.keys() == ["k2"]


@needs_redis
def test_redis_store_corrupt_entry_is_dropped(redis_url: str) -> None:
    store = redis_store(redis_url)
    store.put("k", b"payload-bytes")
    raw = store.redis.get(store._entry("k"))
    store.redis.set(store._entry("k"), raw[:-1] + bytes([raw[-1] ^ 1]))  # one flipped bit
    assert store.get("k") is None
    assert "k" not in store and store.keys() == [] and store.nbytes == 0
    store.put("t", b"abcdef")
    raw = store.redis.get(store._entry("t"))
    store.redis.set(store._entry("t"), raw[:-2])  # truncated
    assert store.get("t") is None and store.keys() == []


@needs_redis
def test_redis_store_budget_evicts_least_recently_used(redis_url: str) -> None:
    probe = redis_store(redis_url)
    size = probe.entry_size("a", b"x" * 1000)
    store = redis_store(redis_url, budget=3 * size)
    for key in "abc":
        assert store.put(key, b"x" * 1000)
    assert store.get("a") is not None  # a is now the most recently used
    assert store.put("d", b"y" * 1000)
    assert sorted(store.keys()) == ["a", "c", "d"]
    assert not store.put("big", b"z" * (4 * size))  # can never fit
    assert store.nbytes <= store.budget


@needs_redis
def test_redis_store_ttl_expires_entries(redis_url: str) -> None:
    store = redis_store(redis_url, ttl_s=0.3)
    store.put("old", b"1")
    store.put("kept", b"2")
    for _ in range(4):  # checking membership keeps an entry alive
        time.sleep(0.1)
        assert "kept" in store
    time.sleep(0.15)
    assert store.get("old") is None
    assert store.keys() == ["kept"] and store.get("kept") == b"2"
    time.sleep(0.5)
    assert store.keys() == [] and store.nbytes == 0


# -- SessionStore over each backend ------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["disk", "redis"])
def chunk_store(request: pytest.FixtureRequest, tmp_path: Path) -> ChunkStore:
    if request.param == "disk":
        return DiskChunkStore(tmp_path / "sessions", 1 << 24)
    if REDIS_BIN is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    return redis_store(request.getfixturevalue("redis_url"), budget=1 << 24)


def _save(sessions: SessionStore, session_id: str, tokens: list[int]) -> list[int]:
    """Saves fake KV (payload = the chunk's tokens as bytes); returns the chunks written."""
    plan = sessions.plan_save(session_id, tokens)
    payloads = [bytes(t % 251 for t in plan.record.chunk_tokens[i]) for i in plan.new_chunks]
    assert sessions.commit(plan, payloads)
    return plan.new_chunks


def test_session_store_turns_reuse_chunks(chunk_store: ChunkStore) -> None:
    sessions = SessionStore(chunk_store, "model-a", chunk_tokens=4, ttl_s=100, max_bytes=1 << 24)
    turn1 = list(range(10))
    assert _save(sessions, "chat/1", turn1) == [0, 1, 2]
    turn2 = turn1 + [50, 51, 52, 53]
    assert _save(sessions, "chat/1", turn2) == [2, 3]  # chunks 0 and 1 are already stored
    info = sessions.info("chat/1")
    assert info["turns"] == 2 and info["num_tokens"] == 14 and info["num_chunks"] == 4
    # a prompt that starts with the first 9 stored tokens gets chunks 0, 1 (chunk 2 differs)
    prompt = turn2[:9] + [99, 99, 99]
    assert sessions.load_prefix("chat/1", prompt) == [bytes(range(4)), bytes(range(4, 8))]
    assert sessions.load_prefix("chat/1", turn2 + [7], start_chunk=1)[0] == bytes(range(4, 8))
    # another model never sees this session's KV
    other = SessionStore(chunk_store, "model-b", chunk_tokens=4, ttl_s=100, max_bytes=1 << 24)
    assert other.load_prefix("chat/1", turn2) == [] and other.info("chat/1") is None
    # the superseded partial chunk of turn 1 is gone
    assert len([k for k in chunk_store.keys() if k.startswith(session_key("chat/1"))]) == 4 + 1


def test_session_store_corrupt_chunk_ends_the_prefix(chunk_store: ChunkStore, tmp_path: Path) -> None:
    sessions = SessionStore(chunk_store, "m", chunk_tokens=4, ttl_s=100, max_bytes=1 << 24)
    tokens = list(range(12))
    _save(sessions, "s", tokens)
    key = sessions.record("s").chunk_keys()[1]
    if isinstance(chunk_store, RedisChunkStore):
        entry = chunk_store._entry(key)
        chunk_store.redis.setrange(entry, len(chunk_store.redis.get(entry)) - 1, b"\xff")
    else:
        path = chunk_store._path(key)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    assert sessions.load_prefix("s", tokens + [1]) == [bytes(range(4))]
    assert key not in chunk_store
    assert _save(sessions, "s", tokens) == [1]  # the next turn writes the lost chunk again


def test_session_store_ttl_and_size_cap(chunk_store: ChunkStore) -> None:
    clock = FakeClock()
    sessions = SessionStore(chunk_store, "m", chunk_tokens=8, ttl_s=60, max_bytes=1 << 24, clock=clock)
    _save(sessions, "old", list(range(8)))
    clock.now += 30
    _save(sessions, "new", list(range(8)))
    clock.now += 31  # "old" unused for 61 s, "new" for 31 s
    assert sessions.info("old") is None and sessions.load_prefix("old", list(range(9))) == []
    assert sessions.info("new") is not None
    assert not [k for k in chunk_store.keys() if k.startswith(session_key("old"))]
    # size cap: room for about two sessions; saving a third drops the least recently used one
    one = chunk_store.nbytes
    sessions.max_bytes = int(2.5 * one)
    clock.now += 1
    _save(sessions, "second", list(range(100, 108)))
    clock.now += 1
    sessions.load_prefix("new", list(range(9)))  # "new" is used again: "second" is now the oldest
    clock.now += 1
    _save(sessions, "third", list(range(200, 208)))
    assert sessions.info("second") is None
    assert sessions.info("new") is not None and sessions.info("third") is not None
    assert chunk_store.nbytes <= sessions.max_bytes


def test_session_store_delete_frees_everything(chunk_store: ChunkStore) -> None:
    sessions = SessionStore(chunk_store, "m", chunk_tokens=4, ttl_s=100, max_bytes=1 << 24)
    _save(sessions, "a", list(range(10)))
    _save(sessions, "b", list(range(5)))
    before = chunk_store.nbytes
    assert sessions.delete("a") and not sessions.delete("a")
    assert sessions.info("a") is None
    assert all(not k.startswith(session_key("a")) for k in chunk_store.keys())
    assert chunk_store.nbytes < before and sessions.info("b") is not None
