"""The load-and-fault run of bench/bench_gateway.py for about a minute (slow): 32 clients through two gateways with
keys, Redis limits and one SQLite ledger, in front of two `glmserve serve` replicas whose session store is on a real
redis-server; a replica and a gateway are killed with SIGKILL and restarted. The bench checks, and this test
asserts, each of its verdicts: no failed non-streamed request, every cut stream ended with an SSE error event,
the ledger equal to the usage the clients saw (with random client disconnects and the gateway kill), and session
turns served by the surviving replica reporting cached tokens restored from Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from redis_server import REDIS_BIN

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_gateway.py"


@pytest.mark.slow
@pytest.mark.skipif(REDIS_BIN is None, reason="redis-server is not installed (.ci/run installs it)")
def test_fault_run_passes_every_check(tmp_path: Path) -> None:
    report = tmp_path / "fault.json"
    argv = [sys.executable, str(BENCH), "fault", "--seconds", "60", "--kill-at", "15", "--restart-after", "5",
            "--gateway-kill-at", "40", "--gateway-restart-after", "2", "--workdir", str(tmp_path / "work"),
            "--report", str(report)]
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1])}
    with (tmp_path / "bench.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=1200)  # a replica's restart takes minutes on a loaded machine
        finally:
            if proc.poll() is None:  # the bench's replicas, gateways and redis-server share its process group
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    output = (tmp_path / "bench.log").read_text(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    result = json.loads(report.read_text())
    assert all(check["pass"] for check in result["checks"].values()), result["checks"]
    outcomes = result["outcomes"]
    assert outcomes.get("unary:ok", 0) > 0 and outcomes.get("stream:done", 0) > 0 and outcomes.get("session:ok", 0) > 0
    assert outcomes.get("unary:disconnected", 0) + outcomes.get("stream:disconnected", 0) > 0  # clients did leave
    assert result["events_s"]["gateway_exit_code"] == -signal.SIGKILL
