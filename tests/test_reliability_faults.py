"""Broken parts under a real `glmserve serve` process (a tiny random Llama, torch-only), each a test: session KV
chunk files truncated, bit-flipped or deleted between write and read, the server SIGKILLed right after a turn
(while its KV is being written) and restarted, Redis stopped and restarted mid-run, and the disk tier's file
system full: a 64 KB tmpfs (ENOSPC; mounting needs root, skipped otherwise) and the kernel's file size limit,
RLIMIT_FSIZE, on the server process (EFBIG, the same path; no root needed). Each time the client sees only
200s; the loss is counted in a metric and recomputed.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from redis_server import REDIS_BIN, free_port, redis_server
from server_process import STARTUP_TIMEOUT_S, ServerProcess, glmserve_process, listening_process, wait_for

CHUNK = 64  # tokens per KV chunk
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # the tiny Llama: layers x (K, V) x kv heads x head dim x float32
ARGS = ["--max-model-len", "512", "--kv-chunk-tokens", str(CHUNK), "--max-num-batched-tokens", "256",
        "--kv-cache-memory-bytes", str(640 * TOKEN_BYTES), "--no-sparse-block-bounds", "--num-threads", "1",
        "--shutdown-timeout", "5"]

pytestmark = pytest.mark.slow  # each test starts one or two servers: minutes on a loaded machine


@pytest.fixture(autouse=True)
def torch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLMSERVE_TORCH_ONLY", "1")  # the servers inherit it: no C++ kernel to build or load


@contextmanager
def serve(args: list[str], log: Path) -> Iterator[tuple[ServerProcess, httpx.Client]]:
    with glmserve_process(args, log) as process, httpx.Client(base_url=process.base_url, timeout=120) as http:
        wait_for(lambda: http.get("/v1/health").status_code == 200, STARTUP_TIMEOUT_S, "readiness", process.log)
        yield process, http


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def complete(http: httpx.Client, prompt: list[int], headers: dict[str, str] | None = None, **extra) -> dict:
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra},
                         headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def metric(http: httpx.Client, name: str) -> float:
    response = http.get("/metrics")
    assert response.status_code == 200, response.text
    return sum(s.value for f in text_string_to_metric_families(response.text) for s in f.samples if s.name == name)


def chunk_files(store: Path) -> set[Path]:
    """The store's KV chunk files (a session's record is a few hundred bytes, a chunk 32 KB)."""
    return {p for p in store.rglob("*") if p.is_file() and p.stat().st_size > CHUNK * TOKEN_BYTES // 2}


def test_damaged_session_chunks_and_a_killed_writer_cost_a_recompute_only(tiny_model_dir, tmp_path: Path) -> None:
    store = tmp_path / "sessions"
    args = ["--model", str(tiny_model_dir("llama")), *ARGS, "--session-store", str(store)]
    prompts = {name: tokens(seed, 150) for seed, name in enumerate(("flip", "cut", "gone", "kept", "killed"))}
    files: dict[str, set[Path]] = {}
    with serve(args, tmp_path / "first.log") as (first, http):
        for name in ("flip", "cut", "gone", "kept"):
            before, saves = chunk_files(store), metric(http, "glmserve_session_saves_total")
            complete(http, prompts[name], session_id=name)
            wait_for(lambda s=saves: metric(http, "glmserve_session_saves_total") > s, 30, "the save", first.log)
            files[name] = chunk_files(store) - before
            assert len(files[name]) == 2  # 150 tokens: two whole chunks of 64 (and a small one of 16)
        kept_tokens = http.get("/v1/sessions/kept").json()["num_tokens"]
        complete(http, prompts["killed"], session_id="killed")
        killed_pid = first.proc.pid
        first.proc.send_signal(signal.SIGKILL)  # its turn's KV is being written now (or just was)
        first.proc.wait(timeout=30)
    for path in files["flip"]:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))
    for path in files["cut"]:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for path in files["gone"]:
        path.unlink()

    with serve(args, tmp_path / "second.log") as (second, http):
        misses = metric(http, "glmserve_session_restore_misses_total")
        for name in ("flip", "cut", "gone", "kept"):
            cached = complete(http, prompts[name] + tokens(99, 20), session_id=name)["usage"]
            expected = kept_tokens if name == "kept" else 0  # a damaged first chunk ends the loaded prefix at once
            assert cached["prompt_tokens_details"]["cached_tokens"] == expected, (name, cached)
            # the store (opened on first use) removed what the killed writer left (its temp files carry its pid)
            assert not [p for p in store.rglob("*") if f".{killed_pid}." in p.name]
        assert metric(http, "glmserve_session_restore_misses_total") == misses + 3
        killed = http.get("/v1/sessions/killed")  # either the whole turn was saved or none of it
        assert killed.status_code in (200, 404), killed.text
        usage = complete(http, prompts["killed"] + tokens(98, 20), session_id="killed")["usage"]
        saved = killed.json()["num_tokens"] if killed.status_code == 200 else 0
        assert usage["prompt_tokens_details"]["cached_tokens"] == saved
        assert "Traceback" not in second.log()


@pytest.mark.skipif(REDIS_BIN is None, reason="redis-server is not installed (.ci/run installs it)")
def test_redis_stopped_and_restarted_mid_run(tiny_model_dir, tmp_path: Path) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    args = ["--model", str(tiny_model_dir("llama")), *ARGS, "--session-store", url]
    redis = redis_server(tmp_path, port)
    redis.__enter__()
    try:
        with serve(args, tmp_path / "server.log") as (server, http):
            complete(http, tokens(1, 150), session_id="before")
            wait_for(lambda: http.get("/v1/sessions/before").status_code == 200, 30, "the save", server.log)
            redis.__exit__(None, None, None)  # Redis goes away mid-run
            redis = None
            for i in range(3):  # sessions degrade to a recompute: the client sees 200s
                complete(http, tokens(1, 150) + tokens(10 + i, 20), session_id="before")
                complete(http, tokens(20 + i, 100), {"x-request-id": f"redis-down-{i}"}, session_id=f"during-{i}")
            for path in ("/v1/sessions/before", "/metrics", "/v1/health"):
                answer = http.get(path)
                assert answer.status_code < 500 or answer.status_code == 503, (path, answer.text)
            # the engine thread's line about the lost save names the HTTP request
            def lost() -> list[str]:
                return [x for x in server.log().splitlines() if "session during-0: the session store cannot" in x]

            wait_for(lost, 30, "the lost save's line", server.log)
            assert all("[redis-down-0]" in line for line in lost()), lost()
            redis = redis_server(tmp_path, port)  # back, empty (no persistence)
            redis.__enter__()
            saves = metric(http, "glmserve_session_saves_total")
            complete(http, tokens(30, 150), session_id="after")
            wait_for(lambda: http.get("/v1/sessions/after").status_code == 200, 30, "sessions to resume", server.log)
            assert metric(http, "glmserve_session_saves_total") > saves
    finally:
        if redis is not None:
            redis.__exit__(None, None, None)


def _file_size_limit(limit: int):
    def limit_writes() -> None:  # in the server process only, before exec: writes past `limit` get EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return limit_writes


@contextmanager
def _full_tmpfs(path: Path, size: int) -> Iterator[None]:
    """A tmpfs of `size` bytes mounted at `path` (skips the test where mounting is not allowed)."""
    path.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                                   capture_output=True, timeout=30).returncode == 0
    if not mounted:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.mark.parametrize("full", ["tmpfs", "file-size-limit"])
def test_full_disk_tier_still_answers_and_says_so(tiny_model_dir, tmp_path: Path, full: str) -> None:
    """Chunks of 256 tokens (128 KB) on a 64 KB tmpfs, or under a 64 KB file size limit: every disk-tier write
    fails (the server's own log file is elsewhere, or far below the limit)."""
    log, kv = tmp_path / "server.log", tmp_path / "kv"
    args = [sys.executable, "-m", "glmserve.cli", "serve", "--port", "0", "--model", str(tiny_model_dir("llama")),
            *ARGS, "--kv-chunk-tokens", "256", "--kv-disk-dir", str(kv), "--session-store", "off"]
    with _full_tmpfs(kv, 64 << 10) if full == "tmpfs" else nullcontext():
        _fill_the_disk_tier(args, log, kv, _file_size_limit(64 << 10) if full == "file-size-limit" else None)


def _fill_the_disk_tier(args: list[str], log: Path, kv: Path, preexec_fn: Callable[[], None] | None) -> None:
    with listening_process(args, log, preexec_fn=preexec_fn) as server, \
            httpx.Client(base_url=server.base_url, timeout=120) as http:
        wait_for(lambda: http.get("/v1/health").status_code == 200, STARTUP_TIMEOUT_S, "readiness", server.log)
        prompts = [tokens(40 + i, 300) for i in range(3)]
        for prompt in prompts + prompts:  # each evicts the one before it: its chunk goes to the (full) disk tier
            complete(http, prompt)
        wait_for(lambda: metric(http, "glmserve_kv_tier_failed_writes_total") > 0, 30, "a failed write", server.log)
        assert metric(http, "glmserve_kv_tier_loaded_chunks_total") == 0
        assert "KV disk tier: no room for a chunk" in server.log()
        assert not list(kv.iterdir())  # nothing half-written

