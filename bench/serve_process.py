"""A `glmserve serve` process for a benchmark: started with given flags on a free port, ready once
`/v1/health` answers 200, stopped with SIGTERM. A process that exits or never gets ready raises
`ServeFailed` with the end of its log."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


class ServeFailed(RuntimeError):
    """The server exited or did not get ready in time; the message ends with its log's last lines."""


@contextmanager
def glmserve(flags: list[str], log_path: Path, ready_timeout_s: float) -> Iterator[str]:
    """Yields the base URL of a ready `glmserve serve --port 0 FLAGS` (its output goes to `log_path`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "glmserve.cli", "serve", "--port", "0", *flags],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        yield _wait_ready(proc, log_path, ready_timeout_s)
    finally:
        stop(proc, 60)


def stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM a server still running, SIGKILL it if it has not exited within `timeout_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, log_path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    base_url = None
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if proc.poll() is not None:
            raise ServeFailed(f"glmserve serve exited with {proc.returncode}:\n{_tail(text)}")
        if base_url is None:
            match = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", text)
            base_url = match.group(1) if match else None
        elif httpx.get(f"{base_url}/v1/health", timeout=10).status_code == 200:
            return base_url
        time.sleep(0.5)
    text = log_path.read_text(errors="replace")
    raise ServeFailed(f"glmserve serve not ready within {timeout_s:.0f} s:\n{_tail(text)}")


def _tail(text: str, lines: int = 15) -> str:
    kept = [line for line in text.splitlines() if "GET /v1/health" not in line]
    return "\n".join(kept[-lines:])
