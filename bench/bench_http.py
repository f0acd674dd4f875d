"""HTTP load benchmark: concurrent streaming chat clients against OpenAI-compatible servers.

Run with the project venv (httpx, and transformers to make the prompts):

    .venv/bin/python bench/bench_http.py --base-url http://127.0.0.1:8000/v1   # a running server
    .venv/bin/python bench/bench_http.py --server ours,llamacpp,vllm [--quick]   # launch each in turn

For every workload (short chats with 64 new tokens; ~512-token prompts with 128 new tokens) and
every concurrency level (1, 8, 32) it keeps N streaming clients busy for a bounded number of
requests and reports output tok/s (all completion tokens / wall time) and TTFT p50/p95 (request
sent -> first content chunk). Requests are greedy with ignore_eos so every engine produces the
same number of tokens. Launched servers listen on a free 127.0.0.1 port, one at a time, and are
stopped (SIGTERM, then SIGKILL of their process group) before the next starts. Traffic goes to
127.0.0.1 only. Results: bench/results/http-<date>[-quick].json (merged by server) and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import workloads as wl
from llama_server import NO_REPACK

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SERVED_NAME = "smollm2"
READY_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0
LEVEL_DEADLINE_S = 900.0  # a (workload, concurrency) cell stops sending new requests after this


@dataclass(frozen=True)
class HttpWorkload:
    name: str
    prompt_tokens: int
    max_tokens: int


WORKLOADS = (HttpWorkload("chat_short", 24, 64), HttpWorkload("prompt_512", 500, 128))


@dataclass
class RequestStat:
    ttft_s: float | None
    latency_s: float
    output_tokens: int
    error: str | None = None


@dataclass
class CellResult:
    workload: str
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    latency_p50_s: float | None
    first_error: str | None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def stream_chat(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> RequestStat:
    """One streaming chat completion; counts tokens from the usage chunk, else content chunks."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                return RequestStat(None, time.perf_counter() - start, 0, f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage") and event["usage"].get("completion_tokens") is not None:
                    usage_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestStat(ttft, time.perf_counter() - start, chunks, f"{type(exc).__name__}: {exc}"[:300])
    return RequestStat(ttft, time.perf_counter() - start, usage_tokens if usage_tokens is not None else chunks)


async def run_cell(
    base_url: str, model: str, prompts: list[str], workload: HttpWorkload, concurrency: int
) -> CellResult:
    """`concurrency` clients share the prompt list (each prompt sent once), bounded by a deadline."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    stats: list[RequestStat] = []
    deadline = time.monotonic() + LEVEL_DEADLINE_S
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty() and time.monotonic() < deadline:
                stats.append(await stream_chat(client, model, queue.get_nowait(), workload.max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [s for s in stats if s.error is None]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    tokens = sum(s.output_tokens for s in ok)
    errors = [s.error for s in stats if s.error is not None]
    return CellResult(
        workload=workload.name,
        concurrency=concurrency,
        requests=len(stats),
        errors=len(errors),
        wall_s=round(wall, 3),
        output_tokens=tokens,
        output_tok_s=round(tokens / wall, 2),
        ttft_p50_s=_round(percentile(ttfts, 50)),
        ttft_p95_s=_round(percentile(ttfts, 95)),
        latency_p50_s=_round(statistics.median([s.latency_s for s in ok]) if ok else None),
        first_error=errors[0] if errors else None,
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def make_prompts(quick: bool, levels: list[int]) -> dict[str, list[str]]:
    """Per workload, distinct prompts for every level (no prefix-cache hits across levels)."""
    maker = wl.PromptMaker(wl.load_tokenizer(wl.embedded_gguf_path()), wl.SEED + 1)
    count = sum(levels) * rounds(quick)
    return {w.name: [maker.text(w.prompt_tokens) for _ in range(count)] for w in WORKLOADS}


def rounds(quick: bool) -> int:
    """Requests per client at each level."""
    return 1 if quick else 2


async def bench_url(base_url: str, prompts: dict[str, list[str]], levels: list[int], quick: bool) -> dict[str, Any]:
    """All workloads x levels against one server; a warm-up request first."""
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        models = (await client.get("/models")).json()["data"]
        model = models[0]["id"]
        warm = await stream_chat(client, model, "Hello!", 8)
    if warm.error:
        raise RuntimeError(f"warm-up request failed: {warm.error}")
    cells = []
    for workload in WORKLOADS:
        offset = 0
        for level in levels:
            count = level * rounds(quick)
            batch = prompts[workload.name][offset : offset + count]
            offset += count
            cell = await run_cell(base_url, model, batch, workload, level)
            print(
                f"  {workload.name} c={level}: {cell.output_tok_s} tok/s, TTFT p50 {cell.ttft_p50_s}s "
                f"p95 {cell.ttft_p95_s}s, {cell.errors} errors",
                file=sys.stderr,
                flush=True,
            )
            cells.append(asdict(cell))
    return {"model": model, "cells": cells}


# --- server launchers -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(key: str, port: int, peer_dtype: str) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start server `key` on 127.0.0.1:`port`."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if key == "ours":
        return [
            sys.executable,  # the project venv running this script: the code at HEAD
            "-m",
            "glmserve.cli",
            "serve",
            *host,
            "--served-model-name",
            SERVED_NAME,
            "--num-threads",
            str(wl.THREADS),
        ], {}
    if key == "llamacpp":
        return [
            str(wl.BENCH_DIR / "bin" / "llama-server"),
            "-m",
            str(wl.embedded_gguf_path()),
            *host,
            "-t",
            str(wl.THREADS),
            "-tb",
            str(wl.THREADS),
            "-np",
            "32",
            "-c",
            "32768",
            "--alias",
            SERVED_NAME,
            *NO_REPACK,  # ggml's AMX repack crashes on this KVM guest (bench/llama_server.py)
        ], {}
    if key == "vllm":
        return [
            str(wl.BENCH_DIR / "vllm" / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(wl.BENCH_DIR / "smollm2-bf16"),
            *host,
            "--dtype",
            peer_dtype,
            "--max-model-len",
            str(wl.MODEL_CONTEXT),
            "--served-model-name",
            SERVED_NAME,
        ], {
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{wl.THREADS - 1}",  # "auto" keeps one of the 2 cores back
        }
    raise ValueError(f"unknown server {key!r}")


SERVERS = ("ours", "llamacpp", "vllm")
# each server's readiness route (200 once it can generate), relative to http://host:port
READY_PATHS = {"ours": "/v1/health", "llamacpp": "/health", "vllm": "/health"}


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, interval_s: float = 1.0) -> float:
    """Poll GET `url` until it answers 200; seconds waited. Raises if the process exits first."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming ready")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"server not ready after {timeout_s:.0f}s")


@dataclass
class Launched:
    """A running server: its OpenAI base URL, process, seconds from launch to ready, command line."""

    base_url: str
    proc: subprocess.Popen[bytes]
    ready_s: float
    command: str


@contextmanager
def launched(key: str, log: Path, peer_dtype: str, poll_s: float = 1.0) -> Iterator[Launched]:
    """Start server `key`, wait for its readiness route (polled every `poll_s`), yield it; always stop it."""
    port = free_port()
    cmd, extra_env = server_command(key, port, peer_dtype)
    print(f"== {key}: {' '.join(cmd)} (log {log})", file=sys.stderr, flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **extra_env}, start_new_session=True
        )
        try:
            ready = wait_ready(proc, f"http://127.0.0.1:{port}{READY_PATHS[key]}", READY_TIMEOUT_S, poll_s)
            yield Launched(f"http://127.0.0.1:{port}/v1", proc, ready, " ".join(cmd))
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per (workload, concurrency), per server output tok/s and TTFT p50/p95."""
    keys = [k for k in results if "error" not in results[k]]
    header = "| workload | c | " + " | ".join(f"{k} tok/s | {k} TTFT p50/p95 s" for k in keys) + " |"
    lines = [header, "|---|---|" + "---|---|" * len(keys)]
    rows = sorted(
        {(c["workload"], c["concurrency"]) for k in keys for c in results[k]["cells"]},
        key=lambda r: ([w.name for w in WORKLOADS].index(r[0]), r[1]),
    )
    for workload, level in rows:
        cells = []
        for k in keys:
            cell = next(
                (c for c in results[k]["cells"] if (c["workload"], c["concurrency"]) == (workload, level)), None
            )
            if cell is None:
                cells += ["—", "—"]
                continue
            errors = f" ({cell['errors']} err)" if cell["errors"] else ""
            cells += [f"{cell['output_tok_s']:.1f}{errors}", f"{cell['ttft_p50_s']} / {cell['ttft_p95_s']}"]
        lines.append(f"| {workload} | {level} | " + " | ".join(cells) + " |")
    failed = [f"- {k}: {results[k]['error']}" for k in results if "error" in results[k]]
    startup = [f"- {k}: ready after {results[k]['startup_s']} s" for k in keys if results[k].get("startup_s")]
    return "\n".join(lines + ([""] + startup if startup else []) + (["", "Failed:", *failed] if failed else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="an already running OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    target.add_argument("--server", help="comma-separated servers to launch in turn: " + ",".join(SERVERS))
    target.add_argument("--report", type=Path, help="only print the table of an existing results JSON")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    parser.add_argument("--quick", action="store_true", help="one round of requests per client instead of two")
    parser.add_argument("--peer-dtype", default="bfloat16", help="dtype of the vLLM server (it runs the HF export)")
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/http-<date>[-quick].json)")
    args = parser.parse_args()
    if args.report:
        print(table(json.loads(args.report.read_text())["servers"]))
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    keys = [args.base_url] if args.base_url else [k for k in args.server.split(",") if k]
    unknown = set(keys) - set(SERVERS) if args.server else set()
    if unknown:
        parser.error(f"unknown server(s): {', '.join(sorted(unknown))}")

    prompts = make_prompts(args.quick, levels)
    date = datetime.date.today().isoformat()
    out = args.out or BENCH / "results" / f"http-{date}{'-quick' if args.quick else ''}.json"
    report = json.loads(out.read_text()) if out.exists() else {"servers": {}}
    report.update(
        {"date": date, "concurrency": levels, "quick": args.quick, "workloads": [asdict(w) for w in WORKLOADS]}
    )
    for key in keys:
        entry: dict[str, Any] = {
            "command": " ".join(sys.argv),
            "measured_at": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        try:
            if args.base_url:
                entry.update(asyncio.run(bench_url(args.base_url, prompts, levels, args.quick)))
            else:
                log = wl.BENCH_DIR / "logs" / f"http-{key}.log"
                with launched(key, log, args.peer_dtype) as server:
                    entry["startup_s"] = round(server.ready_s, 2)
                    entry["server_command"] = server.command
                    entry.update(asyncio.run(bench_url(server.base_url, prompts, levels, args.quick)))
        except Exception as exc:  # one failing server must not lose the others' results
            entry["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        report["servers"][key] = entry
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report["servers"]))
    print(f"\nwritten: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
