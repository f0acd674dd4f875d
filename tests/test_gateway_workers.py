"""`glmserve gateway --workers 2`: two gateway processes on one socket, in front of the fake backend, with a real
redis-server and a real SQLite ledger. A burst on one key admits exactly the burst, /metrics sums both workers'
counters whichever worker answers the scrape, a worker killed with SIGKILL is replaced, and --keys without --redis
is refused."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from redis_server import redis_server
from server_process import listening_process, wait_for

FAKE_BACKEND = Path(__file__).with_name("fake_backend.py")
KEYS = '[[key]]\nname = "shared"\nkey = "sk-shared-0123456789"\nrps = 0.001\nburst = 20\n'
HEADERS = {"Authorization": "Bearer sk-shared-0123456789"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def workers_of(pid: int) -> set[int]:
    """The live worker processes uvicorn's supervisor `pid` spawned (not multiprocessing's resource tracker)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
            except OSError:
                continue
            state, parent = stat.rsplit(")", 1)[1].split()[:2]
            if int(parent) == pid and state != "Z" and b"spawn_main" in cmdline:
                found.add(int(entry.name))
    return found


def admitted(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "glmserve_gateway_admitted_total" and s.labels.get("key") == "shared")


def burst(url: str, n: int) -> list[int]:
    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=30) as http:
            answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=BODY) for _ in range(n)))
        return [a.status_code for a in answers]
    return asyncio.run(run())


def test_two_workers_share_limits_ledger_and_metrics_and_a_killed_worker_is_replaced(tmp_path: Path) -> None:
    keys, ledger = tmp_path / "keys.toml", tmp_path / "ledger.sqlite3"
    keys.write_text(KEYS)
    with ExitStack() as stack:
        redis = stack.enter_context(redis_server(tmp_path))
        backend = stack.enter_context(listening_process([sys.executable, str(FAKE_BACKEND), "--name", "a"],
                                                        tmp_path / "backend.log"))
        gateway = stack.enter_context(listening_process(
            [sys.executable, "-m", "glmserve.cli", "gateway", "--port", "0", "--workers", "2", "--probe-interval",
             "0.2", "--backend", backend.base_url, "--keys", str(keys), "--redis", redis,
             "--ledger", f"sqlite:///{ledger}"], tmp_path / "gateway.log"))
        url = gateway.base_url

        def all_ready() -> bool:  # each worker probes on its own; a few answers in a row from whichever answers
            try:
                return len(workers_of(gateway.proc.pid)) == 2 and all(
                    httpx.get(f"{url}/v1/health", timeout=10).status_code == 200 for _ in range(6))
            except httpx.TransportError:  # the supervisor bound the socket; the workers listen once they start
                return False
        wait_for(all_ready, 60, "both workers ready", gateway.log)
        workers = workers_of(gateway.proc.pid)

        statuses = burst(url, 60)
        assert statuses.count(200) == 20 and statuses.count(429) == 40
        assert [admitted(url) for _ in range(6)] == [20.0] * 6
        with sqlite3.connect(ledger) as conn:
            assert conn.execute("SELECT COUNT(*) FROM ledger").fetchone()[0] == 20

        killed = min(workers)
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: len(workers_of(gateway.proc.pid) - {killed}) == 2, 60, "a new worker", gateway.log)
        assert workers_of(gateway.proc.pid) != workers
        assert burst(url, 4) == [429] * 4  # the burst is spent for every worker, the new one too
        assert [admitted(url) for _ in range(6)] == [20.0] * 6  # the dead worker's counts are kept


def test_workers_with_keys_but_without_redis_are_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    done = subprocess.run([sys.executable, "-m", "glmserve.cli", "gateway", "--port", "0", "--workers", "2",
                           "--backend", "http://127.0.0.1:9", "--keys", str(keys)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--workers 2 with --keys needs --redis" in done.stderr
