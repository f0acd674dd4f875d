"""A `llama-server` process (built by `bench/setup_peers.sh llama-server`) for the bench scripts.

`running(flags, log)` starts `$GLMSERVE_BENCH_DIR/bin/llama-server -m <embedded GGUF> FLAGS` on a free
127.0.0.1 port, waits until `/health` answers 200 and yields it; it is stopped (SIGTERM, then SIGKILL) on exit,
and dies with its parent (PR_SET_PDEATHSIG) if the bench process is killed.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import workloads as wl
from serve_process import stop

BIN = wl.BENCH_DIR / "bin"
BUILD_BIN = wl.BENCH_DIR / "llama.cpp-build" / "bin"  # where setup_peers.sh builds them before installing
_PR_SET_PDEATHSIG = 1
# ggml's AMX matmul (an "extra buffer type" of the CPU backend) dies with a general protection fault on this
# KVM guest (gdb: ggml_backend_amx_mul_mat), so the tools run without the extra buffer types (weight repacking
# off: llama-server/llama-perplexity `-nr`, llama-bench `--repack 0`); llama.cpp then uses its AVX-512 kernels.
NO_REPACK = ["-nr"]


def binary(tool: str) -> Path:
    """Path of a built llama.cpp tool (llama-server, llama-perplexity, llama-bench): installed, else as built."""
    installed = BIN / tool
    return installed if installed.exists() or not (BUILD_BIN / tool).exists() else BUILD_BIN / tool


def missing() -> str | None:
    """None when llama-server is built, else why not."""
    server = binary("llama-server")
    return None if server.exists() else f"{server} missing: run bench/setup_peers.sh llama-server"


def version() -> str:
    """`--version` of a built tool (build number and commit of the vendored llama.cpp)."""
    tool = next((binary(t) for t in ("llama-server", "llama-bench", "llama-perplexity") if binary(t).exists()), None)
    if tool is None:
        return "not built"
    out = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else "unknown version"


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen[bytes]
    command: list[str]


@contextmanager
def running(flags: list[str], log: Path, gguf: Path | None = None, ready_timeout_s: float = 600) -> Iterator[Server]:
    """A ready llama-server on the GGUF (default: the embedded SmolLM2) with extra `flags`."""
    port = _free_port()
    cmd = [str(binary("llama-server")), "-m", str(gguf or wl.embedded_gguf_path()), "--host", "127.0.0.1",
           "--port", str(port), *NO_REPACK, *flags]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    server = Server(f"http://127.0.0.1:{port}", proc, cmd)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode} (log {log})")
            try:
                if httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not ready after {ready_timeout_s:.0f} s (log {log})")
            time.sleep(0.05)
        yield server
    finally:
        stop(proc, 30)
