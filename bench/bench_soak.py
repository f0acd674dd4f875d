"""Soak: N streaming clients against one `glmserve serve` on loopback for a fixed time, then the figures.

Each client loops until the deadline: a completion of a random length (prompt 4-120 words, 1-64 new tokens),
streamed 9 times in 10; 1 stream in 6 is left at a random point (the client closes the connection), 1 request in
20 is cancelled before any answer. Everything else must end well: a 200 whose stream ends with [DONE] and no
error event. Reported (one JSON object): requests, unexpected errors (with the first few), the server's RSS after
warm-up and at the end (growth in %), KV blocks free once idle, and p95 time to first token and p95 request
latency over the first and the last minute.

    python bench/bench_soak.py --minutes 10 --clients 32                   # a tiny random Llama, torch-only
    python bench/bench_soak.py --minutes 10 --model embedded               # the embedded SmolLM2 (Q4_1)

Bounded and self-stopping: clients stop at the deadline, every request has a timeout, the server is stopped
with SIGTERM at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fuzz_api import engine_idle
from serve_process import glmserve

WORDS = "the quick brown fox jumps over a lazy dog while paged attention keeps key and value blocks".split()
WARMUP_S = 60.0


@dataclass
class Sample:
    start: float  # seconds since the soak began
    ttft: float | None
    latency: float


@dataclass
class Soak:
    samples: list[Sample] = field(default_factory=list)
    aborted: int = 0
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)
    unexpected: int = 0

    def error(self, text: str) -> None:
        self.unexpected += 1
        if len(self.errors) < 10:
            self.errors.append(text)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def _request(http: httpx.AsyncClient, rng: random.Random, soak: Soak, t0: float) -> None:
    body = {"model": "soak", "prompt": " ".join(rng.choices(WORDS, k=rng.randint(4, 120))),
            "max_tokens": rng.randint(1, 64), "stream": rng.random() < 0.9, "temperature": 0.8}
    leave_after = rng.randint(1, 16) if body["stream"] and rng.random() < 1 / 6 else None
    start = time.monotonic()
    if rng.random() < 0.05:  # cancelled before any answer
        task = asyncio.create_task(http.post("/v1/completions", json=body))
        await asyncio.sleep(rng.random() * 0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        soak.cancelled += 1
        return
    ttft = None
    if not body["stream"]:
        response = await http.post("/v1/completions", json=body)
        if response.status_code != 200:
            soak.error(f"{response.status_code}: {response.text[:200]}")
            return
        soak.samples.append(Sample(start - t0, None, time.monotonic() - start))
        return
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            soak.error(f"{response.status_code}: {(await response.aread())[:200]!r}")
            return
        chunks = 0
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                soak.samples.append(Sample(start - t0, ttft, time.monotonic() - start))
                return
            if not line.startswith("data: "):
                continue
            if '"error"' in line:
                soak.error(f"error event: {line[:200]}")
                return
            chunks += 1
            ttft = ttft if ttft is not None else time.monotonic() - start
            if leave_after is not None and chunks >= leave_after:
                soak.aborted += 1
                return  # closing the stream mid-way
    soak.error("a stream ended without [DONE]")


async def _client(base_url: str, seed: int, deadline: float, soak: Soak, t0: float) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        while time.monotonic() < deadline:
            try:
                await _request(http, rng, soak, t0)
            except httpx.HTTPError as exc:
                soak.error(f"{type(exc).__name__}: {exc}")


async def _sample_rss(pid: int, deadline: float, out: list[tuple[float, int]], t0: float) -> None:
    while time.monotonic() < deadline:
        out.append((time.monotonic() - t0, _rss_bytes(pid)))
        await asyncio.sleep(5)
    out.append((time.monotonic() - t0, _rss_bytes(pid)))


def _p95(values: list[float]) -> float | None:
    return round(statistics.quantiles(values, n=20)[-1], 4) if len(values) >= 20 else None


async def soak(base_url: str, pid: int, clients: int, seconds: float) -> dict:
    result = Soak()
    rss: list[tuple[float, int]] = []
    t0 = time.monotonic()
    deadline = t0 + seconds
    await asyncio.gather(_sample_rss(pid, deadline, rss, t0),
                         *(_client(base_url, seed, deadline, result, t0) for seed in range(clients)))
    warm = next((b for t, b in rss if t >= min(WARMUP_S, seconds / 4)), rss[-1][1])
    first = [s for s in result.samples if s.start < 60]
    last = [s for s in result.samples if s.start >= seconds - 60]
    return {
        "clients": clients, "seconds": round(time.monotonic() - t0, 1), "completed": len(result.samples),
        "aborted_streams": result.aborted, "cancelled_requests": result.cancelled,
        "unexpected_errors": result.unexpected, "first_errors": result.errors,
        "rss_after_warmup_mb": round(warm / 1e6, 1), "rss_end_mb": round(rss[-1][1] / 1e6, 1),
        "rss_growth_pct": round(100 * (rss[-1][1] - warm) / warm, 2),
        "p95_ttft_s": {"first_minute": _p95([s.ttft for s in first if s.ttft is not None]),
                       "last_minute": _p95([s.ttft for s in last if s.ttft is not None])},
        "p95_latency_s": {"first_minute": _p95([s.latency for s in first]),
                          "last_minute": _p95([s.latency for s in last])},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--model", default="tiny", help="'tiny' (a random Llama, torch-only), 'embedded', or a path")
    parser.add_argument("--log", default=None, help="where the server writes its log (default: a temp file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="glmserve-soak-") as tmp:
        flags = ["--served-model-name", "soak", "--max-model-len", "512", "--num-threads", "1",
                 "--max-num-seqs", "16", "--session-store", "off", "--shutdown-timeout", "10"]
        if args.model == "tiny":
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from tiny_models import make_tiny_model

            os.environ["GLMSERVE_TORCH_ONLY"] = "1"
            flags += ["--model", str(make_tiny_model("llama", Path(tmp) / "model")),
                      "--kv-cache-memory-bytes", str(16 << 20)]
        elif args.model != "embedded":
            flags += ["--model", args.model]
        log = Path(args.log) if args.log is not None else Path(tmp) / "server.log"
        with glmserve(flags, log, ready_timeout_s=600) as base_url:
            pid = int(re.search(r"Started server process \[(\d+)\]", log.read_text()).group(1))
            figures = asyncio.run(soak(base_url, pid, args.clients, args.minutes * 60))
            idle = engine_idle(base_url, timeout_s=60)
            figures["free_blocks_when_idle"] = f"{idle['num_free_blocks']}/{idle['num_total_blocks']}"
            figures["tracebacks_in_log"] = log.read_text(errors="replace").count("Traceback")
    figures["load_average"] = os.getloadavg()
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
