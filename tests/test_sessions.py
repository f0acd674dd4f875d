"""Session KV persistence: the stores (disk, a real redis-server), the engine across restarts and
replicas, and the HTTP API (session_id, GET/DELETE /v1/sessions/{id}, summary anchoring).

Redis tests start their own `redis-server` (no persistence, a free port, a temp dir) and skip only
when the binary is missing; `.ci/run` installs it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from parity import assert_same_output
from redis_server import REDIS_BIN, free_port, redis_server
from server_process import STARTUP_TIMEOUT_S, glmserve_process, wait_for

from glmserve.kv.chunk_store import ChunkStore, DiskChunkStore
from glmserve.kv.redis_store import RedisChunkStore
from glmserve.kv.session_io import SessionKV
from glmserve.kv.session_store import META_SUFFIX, SessionStore, session_key

needs_redis = pytest.mark.skipif(REDIS_BIN is None, reason="redis-server is not installed (.ci/run installs it)")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS_BIN is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


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
    assert b.touch("k1") and not b.touch("nope")
    assert a.keys() == ["k2", "k1"]  # LRU order, oldest first, shared by the replicas
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


def _expire_now(store: RedisChunkStore, key: str) -> None:
    """Lets Redis expire the entry of `key` (as if its TTL ran out now) and waits until it did."""
    entry = store._entry(key)
    store.redis.pexpire(entry, 1)
    deadline = time.monotonic() + 20
    while store.redis.exists(entry):
        assert time.monotonic() < deadline, f"redis never expired {entry}"
        time.sleep(0.01)


@needs_redis
def test_redis_store_ttl_expires_entries(redis_url: str) -> None:
    store = redis_store(redis_url, ttl_s=60)
    store.put("old", b"1")
    store.put("kept", b"2")
    assert 0 < store.redis.pttl(store._entry("old")) <= store.ttl_ms  # every entry gets a Redis expiry
    store.redis.pexpire(store._entry("kept"), 1000)  # as if most of its TTL had passed
    assert "kept" in store  # checking membership keeps an entry alive: a whole TTL again
    assert store.redis.pttl(store._entry("kept")) > store.ttl_ms // 2
    _expire_now(store, "old")
    assert store.get("old") is None
    assert store.keys() == ["kept"] and store.get("kept") == b"2"
    _expire_now(store, "kept")
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


# -- the engine: a session's KV across engines (a restart, another replica) ---------------------------------
BS = 4
CHUNK = 16  # session chunks of 4 blocks: a turn spans several
ENGINE = dict(block_size=BS, max_model_len=256, max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20,
              kv_chunk_tokens=CHUNK, num_threads=1)


def _run(engine, prompt: list[int], session_id: str | None = None, salt: str | None = None):
    from glmserve.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    engine.add_request(f"r{next(_prefixes)}", prompt, params, cache_salt=salt, session_id=session_id)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return final


def _prompt(seed: int, n: int) -> list[int]:
    import torch

    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(params=["disk", "redis"])
def two_engines(request: pytest.FixtureRequest, tiny_model_dir, tmp_path: Path):
    """Two engines on one session store: a restarted server (disk) or two replicas (Redis)."""
    from glmserve.config import EngineConfig
    from glmserve.engine.llm_engine import LLMEngine

    if request.param == "disk":
        store = str(tmp_path / "sessions")
    else:
        if REDIS_BIN is None:
            pytest.skip("redis-server is not installed (.ci/run installs it)")
        store = request.getfixturevalue("redis_url")
        RedisChunkStore(store, 1).redis.flushdb()
    engines = [LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), session_store=store, **ENGINE))
               for _ in range(2)]
    yield engines
    for engine in engines:
        engine.close()


def test_next_turn_loads_the_session_in_another_engine(two_engines) -> None:
    first, second = two_engines
    turn1 = _prompt(1, 50)
    out1 = _run(first, turn1, session_id="conv-1")
    assert out1.num_cached_tokens == 0
    first.kv.sessions.wait("conv-1")
    stored = first.kv.sessions.info("conv-1")
    # the whole sequence's full blocks: 50 prompt + 5 generated tokens with KV (the 6th has none yet)
    assert stored["turns"] == 1 and stored["num_tokens"] == 52 and stored["num_chunks"] == 4
    turn2 = turn1 + out1.outputs[0].token_ids + _prompt(2, 30)
    cold = _run(second, turn2, salt="cold")  # a salt keeps it away from every cached block
    resumed = _run(second, turn2, session_id="conv-1")
    assert resumed.num_cached_tokens == 52  # loaded from the session store, not computed
    assert_same_output(resumed, cold)
    second.kv.sessions.wait("conv-1")
    assert second.kv.sessions.info("conv-1")["turns"] == 2
    # a session's KV is only used for the tokens it was computed for
    other = _prompt(3, 60)
    assert _run(second, other, session_id="conv-1").num_cached_tokens == 0


def test_corrupt_session_chunk_is_recomputed(tiny_model_dir, tmp_path: Path) -> None:
    from glmserve.config import EngineConfig
    from glmserve.engine.llm_engine import LLMEngine

    engines = [LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), session_store=str(tmp_path), **ENGINE))
               for _ in range(2)]
    first, second = engines
    turn1 = _prompt(4, 70)
    out1 = _run(first, turn1, session_id="c")
    first.close()
    sessions = second.kv.sessions.sessions
    key = sessions.record("c").chunk_keys()[2]
    path = sessions.store._path(key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    turn2 = turn1 + out1.outputs[0].token_ids + _prompt(5, 10)
    cold = _run(second, turn2, salt="cold")
    resumed = _run(second, turn2, session_id="c")
    assert resumed.num_cached_tokens == 2 * CHUNK  # chunks 0 and 1; chunk 2 failed its checksum
    assert_same_output(resumed, cold)
    assert second.kv.sessions.stats.restored_chunks == 2
    second.kv.sessions.wait("c")  # the turn's save wrote the recomputed chunk 2 in place of the corrupt one
    assert path.read_bytes() != bytes(data) and sessions.store.get(key) is not None
    second.close()


class GatedDiskStore(DiskChunkStore):
    """A session directory whose KV chunk reads block until `gate` opens: a slow disk, for real."""

    def __init__(self, root: Path, budget: int) -> None:
        super().__init__(root, budget)
        self.gate = threading.Event()
        self.reading = threading.Event()  # a chunk read has started

    def get(self, key: str) -> bytes | None:
        if not key.endswith(META_SUFFIX):
            self.reading.set()
            assert self.gate.wait(timeout=60), "the test never opened the gate"
        return super().get(key)


def _step_until_finished(engine, request_id: str):
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def test_session_restore_reads_while_other_requests_run(tiny_model_dir, tmp_path: Path) -> None:
    """The session's chunks are read in a reader thread: the engine keeps stepping other requests meanwhile,
    loads the chunks one per step while another request runs, then schedules the waiting request, whose
    output equals a cold run."""
    from glmserve.config import EngineConfig
    from glmserve.engine.llm_engine import LLMEngine
    from glmserve.engine.sampling import SamplingParams

    config = EngineConfig(model=str(tiny_model_dir("llama")), session_store=str(tmp_path), **ENGINE)
    first = LLMEngine(config)
    turn1 = _prompt(6, 50)
    out1 = _run(first, turn1, session_id="slow")
    first.close()
    engine = LLMEngine(config)
    store = GatedDiskStore(tmp_path, 1 << 30)
    engine.kv.sessions = SessionKV(lambda: SessionStore(store, engine.kv.identity, CHUNK, 3600, 1 << 30),
                                engine.kv.blocks, engine.kv.io, CHUNK)
    turn2 = turn1 + out1.outputs[0].token_ids + _prompt(7, 30)
    cold = _run(engine, turn2, salt="cold")
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    engine.add_request("resumed", turn2, params, session_id="slow")
    assert store.reading.wait(10)
    engine.add_request("other", _prompt(8, 40), params)
    other = _step_until_finished(engine, "other")  # runs to its end while the session's chunk read waits
    assert len(other.outputs[0].token_ids) == 6 and "resumed" in engine.restoring
    assert engine.stats().num_waiting == 1 and engine.kv.sessions.stats.restores == 0
    engine.add_request("other2", _prompt(9, 40), params)
    store.gate.set()
    restore = engine.restoring["resumed"][1]
    restore.future.result(timeout=10)
    engine.step()  # with another request running, one chunk is loaded per step
    assert engine.kv.sessions.stats.restored_chunks == 1 and "resumed" in engine.restoring
    resumed = _step_until_finished(engine, "resumed")
    assert resumed.num_cached_tokens == 52
    assert_same_output(resumed, cold)
    stats = engine.kv.sessions.stats
    assert (stats.restores, stats.restore_misses, stats.restored_chunks, stats.restored_tokens) == (1, 0, 4, 52)
    assert stats.restore_read_seconds > 0
    engine.close()


def test_turn_cut_short_keeps_its_kv(tiny_model_dir, tmp_path: Path) -> None:
    """A session turn still running when the engine closes (server shutdown) saves the KV it computed; a
    later turn cut short that holds less than the stored session does not replace it."""
    from glmserve.config import EngineConfig
    from glmserve.engine.llm_engine import LLMEngine
    from glmserve.engine.sampling import SamplingParams

    config = EngineConfig(model=str(tiny_model_dir("llama")), session_store=str(tmp_path), **ENGINE)
    first = LLMEngine(config)
    prompt = _prompt(9, 70)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first.add_request("cut", prompt, params, session_id="cut")
    while not first.step() or len(first.requests["cut"].seqs[0].output_token_ids) < 3:
        pass
    first.close()  # what the server's shutdown does with a turn it had to stop
    second = LLMEngine(config)
    info = second.kv.sessions.info("cut")
    assert info["turns"] == 1 and info["num_tokens"] == 72  # 70 prompt + 2 generated tokens with KV
    turn2 = prompt + _prompt(10, 10)
    resumed = _run(second, turn2, session_id="cut")
    assert resumed.num_cached_tokens == 64  # chunks 0-3; chunk 4 holds generated tokens turn 2 does not have
    assert_same_output(resumed, _run(second, turn2, salt="cold"))
    second.kv.sessions.wait("cut")
    stored = second.kv.sessions.info("cut")
    second.add_request("short", _prompt(11, 60), params, session_id="cut")  # other tokens: nothing restored
    while not second.step():
        pass
    second.abort_request("short")  # 60 computed tokens would replace the 84 stored: kept instead
    second.kv.sessions.wait("cut")
    assert second.kv.sessions.info("cut")["num_tokens"] == stored["num_tokens"] == 84
    second.close()


def test_sessions_off(tiny_model_dir) -> None:
    from glmserve.config import EngineConfig
    from glmserve.engine.llm_engine import LLMEngine
    from glmserve.engine.sampling import SamplingParams
    from glmserve.errors import InvalidRequestError

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), session_store="off", **ENGINE))
    with pytest.raises(InvalidRequestError, match="sessions are off"):
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2), session_id="s")
    assert not engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="cannot reach Redis"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")),
                               session_store=f"redis://127.0.0.1:{free_port()}/0", **ENGINE))


# -- the HTTP API: a real `glmserve serve` on the embedded SmolLM2 ----------------------------------------
SUMMARY_THRESHOLD = 150  # prompt tokens above which session_summary summarizes earlier turns


@contextmanager
def serve(store: str, log_path: Path, args: list[str] | None = None) -> Iterator[httpx.Client]:
    """A `glmserve serve` process with its session store at `store`; stopped with SIGTERM on exit."""
    args = args or ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(128 << 20),
                    "--session-summary-threshold", str(SUMMARY_THRESHOLD), "--session-summary-keep", "1"]
    args = [*args, "--num-threads", "1", "--session-store", store]
    with glmserve_process(args, log_path) as process, httpx.Client(base_url=process.base_url, timeout=300) as http:
        wait_for(lambda: http.get("/v1/health").status_code == 200, STARTUP_TIMEOUT_S, "readiness", process.log)
        yield http


def _chat(http: httpx.Client, messages: list[dict], max_tokens: int = 8, **extra) -> dict:
    headers = extra.pop("headers", None)
    response = http.post("/v1/chat/completions", headers=headers,
                         json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()


HISTORY = [
    {"role": "user", "content": "My name is Alice, I live in Lyon and my favourite number is 42. " * 3},
    {"role": "assistant", "content": "Nice to meet you, Alice from Lyon! 42 is a great number. " * 3},
    {"role": "user", "content": "I am planning a trip to Rome next spring with my brother Bob. " * 3},
    {"role": "assistant", "content": "Rome in spring is lovely; Bob and you will enjoy the sights. " * 3},
    {"role": "user", "content": "What should we eat there?"},
]


def test_http_sessions_api_and_anchoring(tmp_path: Path) -> None:
    with serve(str(tmp_path / "store"), tmp_path / "server.log") as http:
        # turn 1 with the field, turn 2 with the header
        first = [{"role": "user", "content": "Tell me three facts about the Moon. " * 8}]
        reply = _chat(http, first, session_id="moon")
        second = first + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                          {"role": "user", "content": "And about Mars?"}]
        usage = _chat(http, second, headers={"X-Session-Id": "moon"})["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 64
        info = http.get("/v1/sessions/moon").json()
        assert info["id"] == "moon" and info["turns"] == 2 and info["bytes"] > 0
        assert usage["prompt_tokens"] <= info["num_tokens"] + 16

        # bad ids and a summary without a session are 400; unknown sessions 404
        bad = http.post("/v1/chat/completions", json={"messages": first, "session_id": "no spaces"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"
        bad = http.post("/v1/chat/completions", headers={"X-Session-Id": "x" * 200}, json={"messages": first})
        assert bad.status_code == 400
        bad = http.post("/v1/chat/completions", json={"messages": first, "session_summary": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_summary"
        assert http.get("/v1/sessions/nobody").json()["error"]["code"] == "session_not_found"

        # anchoring: the long conversation reaches the engine as summary + the last turns
        full = _chat(http, HISTORY, max_tokens=1)["usage"]["prompt_tokens"]
        assert full > SUMMARY_THRESHOLD
        anchored = _chat(http, HISTORY, session_id="trip", session_summary=True)
        summary = http.get("/v1/sessions/trip").json()["summary"]
        assert summary["text"] and 0 < summary["num_tokens"] <= min(512, SUMMARY_THRESHOLD // 2)
        assert summary["num_messages"] == 4  # keep 1: only the last (user) message stays verbatim
        expected = [{"role": "system", "content": f"Summary of the earlier conversation: {summary['text']}"},
                    HISTORY[-1]]
        assert anchored["usage"]["prompt_tokens"] == _chat(http, expected, max_tokens=1)["usage"]["prompt_tokens"]
        assert anchored["usage"]["prompt_tokens"] < full
        # the next turn reuses the stored summary (same system prefix: its KV is cached)
        longer = HISTORY + [{"role": "assistant", "content": anchored["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "Thanks!"}]
        again = _chat(http, longer, session_id="trip", session_summary=True)
        assert http.get("/v1/sessions/trip").json()["summary"] == summary
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        # delete frees the session; a second delete is a 404
        deleted = http.delete("/v1/sessions/moon")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        assert http.get("/v1/sessions/moon").status_code == 404
        assert http.delete("/v1/sessions/moon").status_code == 404


@pytest.mark.slow
def test_http_session_survives_a_server_restart(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    first = [{"role": "user", "content": "Describe the water cycle in detail. " * 12}]
    with serve(store, tmp_path / "first.log") as http:
        reply = _chat(http, first, session_id="water")
        stored = http.get("/v1/sessions/water").json()["num_tokens"]
        anchored = _chat(http, HISTORY, session_id="trip", session_summary=True)
        summary = http.get("/v1/sessions/trip").json()["summary"]
    second = first + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "Shorter, please."}]
    with serve(store, tmp_path / "second.log") as http:  # a fresh process: nothing is cached on the device
        usage = _chat(http, second, session_id="water")["usage"]
        # loaded from the session directory: the stored full blocks the new prompt starts with
        assert 96 <= usage["prompt_tokens_details"]["cached_tokens"] <= stored
        assert http.get("/v1/sessions/water").json()["turns"] == 2
        assert http.get("/v1/sessions/trip").json()["summary"] == summary  # the summary persisted
        longer = HISTORY + [{"role": "assistant", "content": anchored["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "Thanks!"}]
        again = _chat(http, longer, session_id="trip", session_summary=True)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert http.get("/v1/sessions/trip").json()["summary"] == summary


BLOCK_TOKENS = 16  # the server's default block size
# the tiny random Llama (tests/tiny_models.py) for fast versions of the restart and shutdown tests: 2 layers x
# (K, V) x 2 kv heads x (head dim 16 + a 2-byte scale) bytes per token (int8 KV, the CPU default); a pool of 640
# tokens, chunks of 64 (as TIERED below)
TINY_KV_TOKEN_BYTES = 2 * 2 * 2 * (16 + 2)
TINY_CHUNK = 64
TINY_TIERED = ["--max-model-len", "512", "--kv-chunk-tokens", str(TINY_CHUNK), "--max-num-batched-tokens", "256",
               "--kv-cache-memory-bytes", str(640 * TINY_KV_TOKEN_BYTES), "--no-sparse-block-bounds"]


def test_http_session_survives_a_server_restart_fast(tiny_model_dir, tmp_path: Path) -> None:
    """The restart claim on a tiny model: a fresh process loads the session's KV from the directory."""
    args = ["--model", str(tiny_model_dir("llama")), *TINY_TIERED]
    store = str(tmp_path / "store")
    turn1 = _prompt(20, 150)
    with serve(store, tmp_path / "first.log", args) as http:
        _complete(http, turn1, session_id="s")
        stored = http.get("/v1/sessions/s").json()
    # the full blocks of the prompt and the one generated token with KV: all turn 1's prompt tokens
    assert stored["turns"] == 1 and stored["num_tokens"] == BLOCK_TOKENS * ((len(turn1) + 1) // BLOCK_TOKENS)
    with serve(store, tmp_path / "second.log", args) as http:  # nothing is cached on the device
        usage = _complete(http, turn1 + _prompt(21, 20), session_id="s")["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == stored["num_tokens"]
        assert http.get("/v1/sessions/s").json()["turns"] == 2


# -- /metrics: KV tiers and sessions; what a shutdown keeps ---------------------------------------------------
KV_TOKEN_BYTES = 30 * 2 * 3 * (64 + 2)  # SmolLM2-135M, int8 KV (the CPU default): layers x (K, V) x kv heads x (D + 2)
TIERED = ["--max-model-len", "512", "--kv-chunk-tokens", "64", "--max-num-batched-tokens", "256",
          "--kv-cache-memory-bytes", str(640 * KV_TOKEN_BYTES), "--no-sparse-block-bounds"]


def _complete(http: httpx.Client, prompt: list[int], **extra) -> dict:
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def _scrape(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics by name (labels joined into the name)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = http.get("/metrics")
    assert response.status_code == 200
    return {s.name + "".join(f"[{v}]" for v in s.labels.values()): s.value
            for f in text_string_to_metric_families(response.text) for s in f.samples}


def _tokens(seed: int, n: int) -> list[int]:
    import torch

    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_http_tier_and_session_metrics(tmp_path: Path) -> None:
    args = [*TIERED, "--kv-disk-dir", str(tmp_path / "kv")]
    with serve(str(tmp_path / "store"), tmp_path / "server.log", args) as http:
        before = _scrape(http)
        assert before["glmserve_kv_tier_saved_chunks_total"] == 0 and before["glmserve_session_restores_total"] == 0
        assert before["glmserve_kv_tier_bytes[host]"] == 0  # no host tier on CPU
        assert before["glmserve_kv_cache_usage"] == 0
        pool_blocks = before["glmserve_kv_cache_free_blocks"]  # the usable pool (less with a learned indexer)
        a, c, big = _tokens(1, 300), _tokens(2, 300), _tokens(3, 450)
        _complete(http, a, session_id="a")  # saved to the session store when it ends
        _complete(http, c)
        _complete(http, big)  # needs most of the pool: the chunks of a and c go to the disk tier
        before_again = _scrape(http)
        again = _complete(http, c)  # loaded back from the disk tier
        cached_again = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached_again >= 256
        loaded_again = _scrape(http)["glmserve_kv_tier_loaded_tokens_total"] - \
            before_again["glmserve_kv_tier_loaded_tokens_total"]
        turn2 = _complete(http, a + _tokens(4, 20), session_id="a")  # restored from the session store
        assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
        _complete(http, _tokens(5, 100), session_id="new")  # a session the store does not know: a miss
        # the disk writer thread adds its seconds once a write is done, which may be after the requests ended
        after = wait_for(lambda: (sample := _scrape(http))["glmserve_kv_tier_write_seconds_total"] > 0 and sample,
                         60, "the disk tier's first write", (tmp_path / "server.log").read_text)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("glmserve_kv_tier_saved_chunks_total") >= 4
    assert moved("glmserve_kv_tier_loaded_chunks_total") >= 2
    # Tokens loaded from the tier = tokens cached minus tokens still on the device. The pool evicts its least
    # recently used blocks first (blocks that cache nothing before them, a sequence's tail before its head), and
    # c was used last before `big`: the blocks `big` did not take are c's first full blocks, still on the device.
    big_blocks = -(-(len(big) + 1) // BLOCK_TOKENS)  # the prompt and the first generated token have KV
    on_device = BLOCK_TOKENS * max(0, min(len(c) // BLOCK_TOKENS, pool_blocks - big_blocks))
    assert loaded_again == cached_again - on_device > 0
    assert moved("glmserve_kv_tier_loaded_tokens_total") == loaded_again  # turn 2 of "a" came from the session store
    assert moved("glmserve_kv_tier_failed_loads_total") == 0
    assert moved("glmserve_kv_tier_save_seconds_total") > 0
    assert moved("glmserve_kv_tier_load_seconds_total") > 0
    assert after["glmserve_kv_tier_bytes[disk]"] >= 4 * 64 * KV_TOKEN_BYTES
    # every session request asked the store; "a" turn 1 and "new" found nothing there
    assert after["glmserve_session_restores_total"] == 3 and after["glmserve_session_restore_misses_total"] == 2
    assert after["glmserve_session_restored_tokens_total"] == turn2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert after["glmserve_session_restored_chunks_total"] >= 4
    assert after["glmserve_session_restore_read_seconds_total"] > 0
    assert after["glmserve_session_restore_load_seconds_total"] > 0
    assert after["glmserve_session_saves_total"] >= 1 and after["glmserve_session_saved_chunks_total"] >= 4
    assert after["glmserve_session_saved_bytes_total"] >= 4 * 64 * KV_TOKEN_BYTES
    assert after["glmserve_session_save_failures_total"] == 0
    assert after["glmserve_session_store_bytes"] >= 4 * 64 * KV_TOKEN_BYTES



@pytest.mark.slow
def test_http_shutdown_keeps_session_and_tier_kv(tmp_path: Path) -> None:
    """SIGTERM while a session turn streams (cut after --shutdown-timeout) and after chunks went to the disk
    tier: the server exits 0, and a restarted one finds the turn's KV in the session store and the chunks on
    disk."""
    args = [*TIERED, "--kv-disk-dir", str(tmp_path / "kv"), "--num-threads", "1",
            "--session-store", str(tmp_path / "store")]
    evicted, prompt = _tokens(6, 300), _tokens(7, 300)
    log_path = tmp_path / "first.log"
    with glmserve_process([*args, "--shutdown-timeout", "1"], log_path) as process, \
            httpx.Client(base_url=process.base_url, timeout=300) as http:
        wait_for(lambda: http.get("/v1/health").status_code == 200, STARTUP_TIMEOUT_S, "readiness", process.log)
        _complete(http, evicted)
        _complete(http, _tokens(9, 450))  # pushes `evicted` out of the device pool, to the disk tier
        body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True, "session_id": "cut"}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                next(lines)
            process.proc.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.RemoteProtocolError):  # cut short once the shutdown timeout is over
                for _ in lines:
                    pass
        assert process.proc.wait(timeout=120) == 0, process.log()[-4000:]
    # uvicorn logs the stream it cancelled at the timeout ("Exception in ASGI application"); nothing else fails
    assert log_path.read_text().count("Traceback") <= 1
    with serve(str(tmp_path / "store"), tmp_path / "second.log", [*TIERED, "--kv-disk-dir", str(tmp_path / "kv")]) \
            as http:
        from_disk = _complete(http, evicted)  # nothing on the device yet: the disk tier's chunks
        assert from_disk["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
        info = http.get("/v1/sessions/cut").json()
        assert info["turns"] == 1 and info["num_tokens"] >= 288  # the prompt's full blocks, at least
        resumed = _complete(http, prompt + _tokens(8, 20), session_id="cut")
        assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256  # chunk 4 holds generated tokens


def test_http_shutdown_keeps_session_and_tier_kv_fast(tiny_model_dir, tmp_path: Path) -> None:
    """The shutdown claim on a tiny model: SIGTERM while a session turn streams (its engine steps held, so it
    is still running when the --shutdown-timeout cuts it) and after chunks went to the disk tier: the server
    exits 0, and a restarted one finds the turn's KV in the session store and the chunks on disk."""
    model = ["--model", str(tiny_model_dir("llama")), *TINY_TIERED, "--kv-disk-dir", str(tmp_path / "kv")]
    store = str(tmp_path / "store")
    evicted, prompt = _prompt(30, 300), _prompt(31, 2 * TINY_CHUNK)  # the cut turn's prompt: two whole chunks
    log_path, pause = tmp_path / "first.log", tmp_path / "pause-steps"
    with glmserve_process([*model, "--num-threads", "1", "--session-store", store, "--shutdown-timeout", "1"],
                          log_path, step_pause=pause) as process, \
            httpx.Client(base_url=process.base_url, timeout=300) as http:
        wait_for(lambda: http.get("/v1/health").status_code == 200, STARTUP_TIMEOUT_S, "readiness", process.log)
        _complete(http, evicted)
        for seed in (32, 33):  # two prompts of most of the pool push every block of `evicted` out, to disk
            _complete(http, _prompt(seed, 450))
        body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True, "session_id": "cut"}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                next(lines)
            pause.touch()  # the turn stays in flight: no engine step runs until the stream was cut
            process.proc.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.RemoteProtocolError):  # cut short once the shutdown timeout is over
                for _ in lines:
                    pass
            pause.unlink()
        assert process.proc.wait(timeout=120) == 0, process.log()[-4000:]
    assert log_path.read_text().count("Traceback") <= 1  # uvicorn logs the stream it cancelled
    with serve(store, tmp_path / "second.log", model) as http:  # nothing on the device of a fresh process
        from_disk = _complete(http, evicted)
        assert from_disk["usage"]["prompt_tokens_details"]["cached_tokens"] == TINY_CHUNK * (len(evicted) // TINY_CHUNK)
        info = http.get("/v1/sessions/cut").json()
        assert info["turns"] == 1 and info["num_tokens"] >= len(prompt)  # the prompt's blocks, at least
        resumed = _complete(http, prompt + _prompt(34, 20), session_id="cut")
        # the prompt's two chunks; a third one holds generated tokens this turn does not have
        assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
