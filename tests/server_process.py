"""A real `glmserve serve` subprocess on a free port, shared by the HTTP tests."""

from __future__ import annotations

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
def glmserve_process(args: list[str], log_path: Path) -> Iterator[ServerProcess]:
    """Starts `glmserve serve --port 0 ARGS` (output to `log_path`) and yields once it listens, before the
    model is necessarily ready. On exit a still-running server gets SIGTERM and must exit with 0."""
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "glmserve.cli", "serve", "--port", "0", *args],
                                stdout=log_file, stderr=subprocess.STDOUT)
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
