"""A real `glmserve serve` subprocess on a free port, shared by the HTTP tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STARTUP_TIMEOUT_S = 180
CONTROLLED_SERVE = Path(__file__).with_name("controlled_serve.py")
LOAD_GATE_ENV = "GLMSERVE_TEST_LOAD_GATE"  # controlled_serve.py: the model loads once this file exists
STEP_PAUSE_ENV = "GLMSERVE_TEST_STEP_PAUSE"  # controlled_serve.py: no engine step while this file exists


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, log: Callable[[], str]) -> Any:
    """Polls `condition` until it returns something truthy (returned); fails with the server log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; server log:\n{log()[-4000:]}")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def glmserve_process(args: list[str], log_path: Path, load_gate: Path | None = None,
                     step_pause: Path | None = None) -> Iterator[ServerProcess]:
    """Starts `glmserve serve --port 0 ARGS` (output to `log_path`) and yields once it listens, before the
    model is necessarily ready. With `load_gate` the model is not loaded before that file exists, with
    `step_pause` no engine step starts while that file exists (tests/controlled_serve.py). On exit a
    still-running server gets SIGTERM and must exit with 0."""
    controls = {name: str(path) for name, path in ((LOAD_GATE_ENV, load_gate), (STEP_PAUSE_ENV, step_pause))
                if path is not None}
    launcher = [str(CONTROLLED_SERVE)] if controls else ["-m", "glmserve.cli"]
    with listening_process([sys.executable, *launcher, "serve", "--port", "0", *args], log_path,
                           {**os.environ, **controls}) as server:
        yield server


@contextmanager
def listening_process(argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                      preexec_fn: Callable[[], None] | None = None) -> Iterator[ServerProcess]:
    """Starts a uvicorn server process (`argv`, output to `log_path`; `preexec_fn` runs in the child before exec)
    and yields once it listens (its port read from uvicorn's "Uvicorn running on" line). On exit a still-running
    one gets SIGTERM and must exit with 0."""
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec_fn)
    server = ServerProcess(proc, "", log_path)

    def port() -> int | None:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", server.log())
        return int(match.group(1)) if match else None

    try:
        server.base_url = f"http://127.0.0.1:{wait_for(port, STARTUP_TIMEOUT_S, 'the server to listen', server.log)}"
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            assert proc.wait(timeout=60) == 0, server.log()[-4000:]
