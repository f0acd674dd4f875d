"""`glmserve gateway` benchmarks.

overhead: the latency the gateway adds in front of a fast fake backend (tests/fake_backend.py), at fixed
    request rates. An open-loop generator sends non-streamed chat requests on a fixed schedule, alternately
    straight to the backend and through the gateway (the same backend, the same run); latency runs from the
    scheduled send time (no coordinated omission). Added latency = through-gateway minus direct, per percentile.

fault: 32 clients (3/4 non-streamed, 1/4 streamed) through the gateway in front of two real `glmserve serve`
    replicas on a tiny random-weight model; one replica is killed with SIGKILL and restarted. Counts failed
    non-streamed requests (should be 0) and how every stream ended (`[DONE]` or an SSE error event; a stream
    that just stops would be a silent cut).

    .venv/bin/python bench/bench_gateway.py overhead --rates 200,500 --seconds 20
    .venv/bin/python bench/bench_gateway.py fault --seconds 180 --kill-at 60 --restart-after 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TESTS = REPO / "tests"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say hello to the benchmark."}]}


# ---------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(eq=False)
class Proc:
    argv: list[str]
    log: Path
    port: int
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_path: str = "/v1/health", timeout_s: float = 300) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONPATH": str(REPO), **self.env})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv} exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + ready_path, timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{self.argv} not ready after {timeout_s} s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)


@contextlib.contextmanager
def running(*procs: Proc) -> Iterator[None]:
    try:
        for p in procs:
            p.start()
        yield
    finally:
        for p in reversed(procs):
            p.stop()


def gateway_proc(backends: list[str], logdir: Path, *extra: str) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "glmserve.cli", "gateway", "--port", str(port), *extra]
    for url in backends:
        argv += ["--backend", url]
    return Proc(argv, logdir / "gateway.log", port)


# ---------------------------------------------------------------------- overhead: open-loop, raw HTTP/1.1


class Connections:
    """Keep-alive HTTP/1.1 connections to one server, each used by one request at a time; the requests are
    prebuilt bytes and the answers are read by Content-Length, so that the load generator costs little CPU."""

    def __init__(self, port: int, path: str, body: bytes) -> None:
        self.port = port
        self.request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def call(self, fresh: bool = False) -> int:
        reused = bool(self.idle) and not fresh
        conn = self.idle.pop() if reused else await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = conn
        writer.write(self.request)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError):
            writer.close()
            if not reused:
                raise
            return await self.call(fresh=True)  # closed by the server while idle (keep-alive timeout)
        status = int(head[9:12])
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
        await reader.readexactly(length)
        self.idle.append(conn)
        return status


async def open_loop(targets: dict[str, Connections], rate: float, seconds: float) -> dict[str, list[float]]:
    """Sends `rate` requests/s to every target for `seconds`, interleaved; latencies (s) per target."""
    latencies: dict[str, list[float]] = {name: [] for name in targets}
    errors: dict[str, dict[str, int]] = {name: {} for name in targets}
    loop = asyncio.get_running_loop()
    tasks = []

    async def one(name: str, scheduled: float) -> None:
        try:
            status = await targets[name].call()
        except (OSError, asyncio.IncompleteReadError) as exc:
            status = type(exc).__name__
        if status == 200:
            latencies[name].append(loop.time() - scheduled)
        else:
            errors[name][str(status)] = errors[name].get(str(status), 0) + 1

    names = list(targets)
    interval = 1.0 / (rate * len(names))
    start = loop.time() + 0.1
    n_total = int(rate * seconds) * len(names)
    for i in range(n_total):
        scheduled = start + i * interval
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(names[i % len(names)], scheduled)))
    await asyncio.gather(*tasks)
    return latencies, errors


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_overhead(args: argparse.Namespace) -> dict:
    logdir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    port = free_port()
    backend = Proc([sys.executable, str(TESTS / "fake_backend.py"), "--name", "fast", "--port", str(port)],
                   logdir / "backend.log", port)
    gw = gateway_proc([backend.url], logdir)
    body = json.dumps(CHAT).encode()
    rows = []

    async def measure() -> None:
        targets = {"direct": Connections(backend.port, "/v1/chat/completions", body),
                   "gateway": Connections(gw.port, "/v1/chat/completions", body)}
        await open_loop(targets, 20, 2)  # warm-up: connections, code paths
        for rate in args.rates:
            cpu_before = {p: cpu_seconds(p.proc.pid) for p in (backend, gw)}
            lat, errors = await open_loop(targets, rate, args.seconds)
            n = {k: len(v) for k, v in lat.items()}
            cpu = {p: cpu_seconds(p.proc.pid) - cpu_before[p] for p in (backend, gw)}
            row = {"rate_rps": rate, "seconds": args.seconds, "ok": n, "errors": errors,
                   "load_average_1m": os.getloadavg()[0],
                   # CPU per request: the gateway's own, and the backend's (which serves both paths)
                   "gateway_cpu_ms_per_request": round(cpu[gw] * 1e3 / max(1, n["gateway"]), 3),
                   "backend_cpu_ms_per_request": round(cpu[backend] * 1e3 / max(1, n["gateway"] + n["direct"]), 3)}
            for q, label in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
                d, g = pct(lat["direct"], q) * 1e3, pct(lat["gateway"], q) * 1e3
                row[label] = {"direct_ms": round(d, 3), "gateway_ms": round(g, 3), "added_ms": round(g - d, 3)}
            row["mean_added_ms"] = round((statistics.mean(lat["gateway"]) - statistics.mean(lat["direct"])) * 1e3, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)

    with running(backend, gw):
        asyncio.run(measure())
    return {"overhead": rows}


# ---------------------------------------------------------------------- fault: real replicas, one killed


@dataclass
class FaultCounts:
    unary_ok: int = 0
    unary_failed: int = 0
    streams_done: int = 0
    streams_error_event: int = 0
    streams_silent_cut: int = 0
    failures: list[str] = field(default_factory=list)


async def fault_client(n: int, url: str, stream: bool, stop: asyncio.Event, counts: FaultCounts) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        i = 0
        while not stop.is_set():
            i += 1
            body = {"model": "tiny", "max_tokens": 32, "ignore_eos": True, "stream": stream,
                    "prompt": f"client {n} request {i}"}  # completions: the tiny model has no chat template
            try:
                if not stream:
                    r = await http.post("/v1/completions", json=body)
                    if r.status_code == 200:
                        counts.unary_ok += 1
                    else:
                        counts.unary_failed += 1
                        counts.failures.append(f"{r.status_code} {r.text[:200]}")
                    continue
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    text = (await r.aread()).decode()
                events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
                if events and events[-1] == "[DONE]":
                    counts.streams_done += 1
                elif events and '"error"' in events[-1]:
                    counts.streams_error_event += 1
                else:
                    counts.streams_silent_cut += 1
                    counts.failures.append(f"stream {r.status_code}: {text[-200:]!r}")
            except httpx.HTTPError as exc:
                counts.failures.append(f"{type(exc).__name__}: {exc}")
                if stream:
                    counts.streams_silent_cut += 1
                else:
                    counts.unary_failed += 1


def run_fault(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(TESTS))
    from tiny_models import make_tiny_model

    logdir = Path(tempfile.mkdtemp(prefix="bench-gateway-fault-"))
    model = make_tiny_model("llama", logdir / "tiny")
    replicas = []
    for i in range(2):
        port = free_port()
        argv = [sys.executable, "-m", "glmserve.cli", "serve", "--port", str(port), "--model", str(model),
                "--served-model-name", "tiny", "--max-model-len", "512", "--num-threads", "1",
                "--kv-cache-memory-bytes", str(64 << 20), "--session-store", "off", "--max-num-seqs", "32"]
        replicas.append(Proc(argv, logdir / f"replica{i}.log", port, env={"GLMSERVE_TORCH_ONLY": "1"}))
    gw = gateway_proc([r.url for r in replicas], logdir, "--probe-interval", "1", "--unhealthy-after", "3")
    counts = FaultCounts()
    timeline = []

    async def drive() -> None:
        stop = asyncio.Event()
        clients = [asyncio.ensure_future(fault_client(n, gw.url, n % 4 == 3, stop, counts)) for n in range(32)]
        t0 = time.monotonic()
        await asyncio.sleep(args.kill_at)
        replicas[0].stop(signal.SIGKILL)
        timeline.append((round(time.monotonic() - t0, 1), "replica 0 killed (SIGKILL)"))
        await asyncio.sleep(args.restart_after)
        await asyncio.to_thread(replicas[0].start)
        timeline.append((round(time.monotonic() - t0, 1), "replica 0 restarted and ready"))
        await asyncio.sleep(max(0.0, args.seconds - (time.monotonic() - t0)))
        stop.set()
        await asyncio.gather(*clients)
        timeline.append((round(time.monotonic() - t0, 1), "clients stopped"))

    with running(*replicas, gw):
        asyncio.run(drive())
        metrics = httpx.get(gw.url + "/metrics").text
    def total(name: str) -> float:
        return sum(float(line.rsplit(None, 1)[1]) for line in metrics.splitlines() if line.startswith(name))

    result = {"clients": 32, "seconds": args.seconds, "timeline": timeline,
              "retries": total("glmserve_gateway_retries_total"),
              "retries_refused": total("glmserve_gateway_retries_refused_total"),
              **{k: v for k, v in vars(counts).items() if k != "failures"}, "first_failures": counts.failures[:5]}
    print(json.dumps(result, indent=1))
    return {"fault": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--report", default=None, help="write the results as JSON here")
    o = sub.add_parser("overhead", parents=[common])
    o.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[200.0, 500.0])
    o.add_argument("--seconds", type=float, default=20)
    f = sub.add_parser("fault", parents=[common])
    f.add_argument("--seconds", type=float, default=180, help="length of the run (the issue asks for 600)")
    f.add_argument("--kill-at", type=float, default=60)
    f.add_argument("--restart-after", type=float, default=20)
    args = parser.parse_args()
    result = run_overhead(args) if args.what == "overhead" else run_fault(args)
    if args.report:
        Path(args.report).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
