"""A throwaway `redis-server` for tests: no persistence, a free port on 127.0.0.1, a temp dir; stopped on exit."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REDIS_BIN = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(workdir: Path, port: int | None = None) -> Iterator[str]:
    """Starts redis-server (REDIS_BIN must exist; on `port`, else a free one) and yields its URL once it accepts
    connections."""
    assert REDIS_BIN is not None, "redis-server is not installed (.ci/run installs it)"
    port = port or free_port()
    proc = subprocess.Popen(
        [REDIS_BIN, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
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
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
