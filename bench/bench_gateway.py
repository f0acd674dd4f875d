"""`glmserve gateway` benchmarks.

overhead: the latency the gateway adds in front of a fast fake backend (tests/fake_backend.py), at fixed
    request rates. An open-loop generator sends non-streamed chat requests on a fixed schedule, alternately
    straight to the backend and through the gateway (the same backend, the same run); latency runs from the
    scheduled send time (no coordinated omission). Added latency = through-gateway minus direct, per percentile.
    `--floor fixed,aiohttp,own` adds the floors of bench/gateway_floor.py (uvicorn + a pure ASGI app answering a
    fixed body; a bare ASGI proxy on aiohttp or on the gateway's own upstream client) to the same interleaved run.

fault: 32 clients through two gateways with admission on (keys, Redis limits, a SQLite ledger) in front of two
    real `glmserve serve` replicas (session store on Redis) on a tiny random-weight model; a replica and a
    gateway are killed with SIGKILL and restarted. Prints a PASS/FAIL verdict per check and exits 1 when one
    fails (bench/gateway_fault.py says what each check proves).

    .venv/bin/python bench/bench_gateway.py overhead --rates 200,500 --seconds 20
    .venv/bin/python bench/bench_gateway.py fault --seconds 600 --kill-at 120 --restart-after 30 --gateway-kill-at 420
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
BENCH_KEY = "sk-bench-0123456789"
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
    http: bool = True  # False: ready once the port accepts a connection (redis-server)
    cwd: Path | None = None  # `python -m` imports from the working directory first

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_path: str = "/v1/health", timeout_s: float = 300) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd,
                                         env={**os.environ, "PYTHONPATH": str(REPO), **self.env})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv} exited: {self.log.read_text()[-2000:]}")
            if not self.http:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            with contextlib.suppress(httpx.HTTPError):
                if self.http and httpx.get(self.url + ready_path, timeout=2).status_code == 200:
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

    def __init__(self, port: int, path: str, body: bytes, extra_headers: str = "") -> None:
        self.port = port
        self.request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                        f"{extra_headers}Content-Length: {len(body)}\r\n\r\n").encode() + body
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
    clock = time.perf_counter  # uvloop's loop clock counts whole milliseconds
    tasks = []

    async def one(name: str, scheduled: float) -> None:
        try:
            status = await targets[name].call()
        except (OSError, asyncio.IncompleteReadError) as exc:
            status = type(exc).__name__
        if status == 200:
            latencies[name].append(clock() - scheduled)
        else:
            errors[name][str(status)] = errors[name].get(str(status), 0) + 1

    names = list(targets)
    interval = 1.0 / (rate * len(names))
    start = clock() + 0.1
    n_total = int(rate * seconds) * len(names)
    for i in range(n_total):
        scheduled = start + i * interval
        delay = scheduled - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(names[i % len(names)], scheduled)))
    await asyncio.gather(*tasks)
    return latencies, errors


def _stat_fields(pid: int | str) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its live descendants (Linux /proc): `--workers N` serves from the
    supervisor's children."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(entry.name)
        except OSError:  # exited while we looked
            continue
        parents[int(entry.name)] = int(fields[1])
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent and child not in tree]
        tree.update(children)
        frontier += children
    return sum(ticks.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_overhead(args: argparse.Namespace) -> dict:
    logdir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    port = free_port()
    backend = Proc([sys.executable, str(TESTS / "fake_backend.py"), "--name", "fast", "--port", str(port)],
                   logdir / "backend.log", port)
    procs = [backend]
    extra = [*args.gateway_args.split()]
    if not args.bare:  # the realistic configuration: a key with limits, a SQLite ledger, limits in Redis or memory
        (logdir / "keys.toml").write_text(f'[[key]]\nname = "bench"\nkey = "{BENCH_KEY}"\nrps = 5000\n'
                                          'burst = 5000\nrpm = 1000000\ntpm = 100000000\nmax_concurrency = 4096\n')
        extra += ["--keys", str(logdir / "keys.toml")]
        if args.limits == "redis":
            redis_port = free_port()
            procs.insert(0, Proc(["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
                                 logdir / "redis.log", redis_port, http=False))
            extra += ["--redis", f"redis://127.0.0.1:{redis_port}/0"]
    gateways = {"gateway": REPO}
    if args.baseline:  # another checkout's gateway, the same configuration, interleaved in the same run
        gateways["baseline"] = Path(args.baseline).resolve()
    gws: dict[str, Proc] = {}
    for name, root in gateways.items():
        ledger = [] if args.bare else ["--ledger", f"sqlite:///{logdir / f'ledger-{name}.sqlite3'}"]
        gws[name] = gateway_proc([backend.url], logdir, *extra, *ledger)
        gws[name].log = logdir / f"{name}.log"
        gws[name].env, gws[name].cwd = {"PYTHONPATH": str(root)}, root
    procs += gws.values()
    floors: dict[str, Proc] = {}  # the floors under the gateway's CPU (bench/gateway_floor.py)
    for mode in args.floor:
        floors[f"floor_{mode}"] = p = Proc([sys.executable, str(BENCH / "gateway_floor.py"), mode, "--port",
                                            str(port := free_port()), "--backend", backend.url],
                                           logdir / f"floor-{mode}.log", port)
        p.env = {"PYTHONPATH": str(REPO)}
    procs += floors.values()
    body = json.dumps(CHAT).encode()
    auth = "" if args.bare else f"Authorization: Bearer {BENCH_KEY}\r\n"
    rows = []

    async def measure() -> None:
        targets = {"direct": Connections(backend.port, "/v1/chat/completions", body),
                   **{name: Connections(gw.port, "/v1/chat/completions", body, auth) for name, gw in gws.items()},
                   **{name: Connections(p.port, "/v1/chat/completions", body) for name, p in floors.items()}}
        await open_loop(targets, 20, 2)  # warm-up: connections, code paths
        spy = None
        if args.py_spy:  # samples the gateway while the rates run (collapsed stacks, for flamegraph.pl or grep)
            py_spy = str(Path(sys.executable).with_name("py-spy"))
            spy = subprocess.Popen([py_spy, "record", "--pid", str(gws["gateway"].proc.pid), "--format", "raw",
                                    "--rate", "200", "--output", args.py_spy], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        for rate in args.rates:
            servers = {**gws, **floors}
            measured = [backend, *servers.values()]
            cpu_before = {p: cpu_seconds(p.proc.pid) for p in measured}
            load_before = os.getloadavg()[0]
            lat, errors = await open_loop(targets, rate, args.seconds)
            n = {k: len(v) for k, v in lat.items()}
            cpu = {p: cpu_seconds(p.proc.pid) - cpu_before[p] for p in measured}
            via_backend = sum(v for k, v in n.items() if k != "floor_fixed")  # the fixed floor never calls it
            row = {"rate_rps": rate, "seconds": args.seconds, "config": config, "ok": n, "errors": errors,
                   "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                   # CPU per request: each gateway's own, and the backend's (which serves every path)
                   "backend_cpu_ms_per_request": round(cpu[backend] * 1e3 / max(1, via_backend), 3)}
            for name, gw in servers.items():
                row[f"{name}_cpu_ms_per_request"] = round(cpu[gw] * 1e3 / max(1, n[name]), 3)
            for q, label in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
                d = pct(lat["direct"], q) * 1e3
                row[label] = {"direct_ms": round(d, 3)}
                for name in servers:
                    g = pct(lat[name], q) * 1e3
                    row[label] |= {f"{name}_ms": round(g, 3), f"{name}_added_ms": round(g - d, 3)}
            for name in servers:
                row[f"{name}_mean_added_ms"] = round((statistics.mean(lat[name]) - statistics.mean(lat["direct"]))
                                                     * 1e3, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)

    config = "bare proxy" if args.bare else f"keys + {args.limits} limits + SQLite ledger"
    config += f" {args.gateway_args}".rstrip()
    with running(*procs):
        _run_loop(measure())
    return {"overhead": rows}


def _run_loop(coro) -> None:
    """The generator on uvloop when it is installed (cheaper per request than asyncio's loop)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--report", default=None, help="write the results as JSON here")
    o = sub.add_parser("overhead", parents=[common])
    o.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[200.0, 500.0])
    o.add_argument("--seconds", type=float, default=20)
    o.add_argument("--baseline", default=None, metavar="CHECKOUT",
                   help="also measure the gateway of this checkout (e.g. `git archive main | tar -x -C DIR`)")
    o.add_argument("--py-spy", default=None, metavar="FILE", help="py-spy record the gateway into FILE")
    o.add_argument("--bare", action="store_true", help="the proxy without keys (no ledger rows, no limits)")
    o.add_argument("--floor", type=lambda s: [m for m in s.split(",") if m], default=[],
                   help="also measure these floors (bench/gateway_floor.py modes): fixed,aiohttp,own")
    o.add_argument("--limits", choices=("memory", "redis"), default="memory")
    o.add_argument("--gateway-args", default="", help="more `glmserve gateway` options, e.g. '--max-retries 0'")
    f = sub.add_parser("fault", parents=[common])
    from gateway_fault import add_fault_args, run_fault  # it imports this module's process helpers

    add_fault_args(f)
    args = parser.parse_args()
    result, passed = (run_overhead(args), True) if args.what == "overhead" else run_fault(args)
    if args.report:
        Path(args.report).write_text(json.dumps(result, indent=1))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
