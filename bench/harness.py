"""Measurement code shared by every engine runner (ours and the peers).

A runner wraps its engine in an `Engine` (load + generate on token ids) and calls
`run_main(make_engine)`. The harness times every workload in `workloads.py` the same way and
prints one JSON object (the common schema, see `METRICS`) as the last line of stdout:

    {"engine": ..., "version": ..., "prefill_512_tok_s": ..., ..., "peak_rss_mb": ...,
     "notes": {metric: why it is null or how it differs}, "details": {...}}

Definitions:
  prefill_N_tok_s      prompt tokens / latency of a max_tokens=1 request (median of repeats)
  decode_bK_tok_s      tokens generated / wall time of the decode steps of a K-prompt batch, timed
                       from the step after which every prompt is computed (each has its first token)
                       to the end: prefill is outside the window (median of repeats)
  throughput_64_tok_s  generated tokens / wall time, all 64 requests submitted at once
  prefix_*_ttft_s      latency of a max_tokens=1 request with a 4,000-token prefix: the first
                       time (cold) and then with other suffixes (warm, median)
  startup_s            process launch (the --t0 wall clock from the driver) to the first token
  peak_rss_mb          max of this process's VmHWM and the sampled RSS of its process tree
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import workloads as wl

METRICS = (
    "prefill_512_tok_s",
    "prefill_2048_tok_s",
    "prefill_8192_tok_s",
    "decode_b1_tok_s",
    "decode_b32_tok_s",
    "throughput_64_tok_s",
    "prefix_cold_ttft_s",
    "prefix_warm_ttft_s",
    "startup_s",
    "peak_rss_mb",
)
RESULT_MARKER = "BENCH_RESULT "


class Engine(ABC):
    """What a runner provides: one engine, loaded once, generating greedily from token ids."""

    name: str = "engine"
    #: metric -> caveat printed with the results (a metric that fails is null with its error here)
    notes: dict[str, str] = {}
    #: metrics this engine measures differently from ours (e.g. a batch run serially): reported, no ratio
    unlike: frozenset[str] = frozenset()

    @abstractmethod
    def load(self, args: argparse.Namespace) -> None:
        """Import and build the engine (counted in startup_s)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        """Greedy, ignore_eos, all prompts submitted together; returns generated-token counts."""

    @abstractmethod
    def decode_timeline(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, int]]:
        """Runs `generate(prompts, max_tokens)` step by step: (time.perf_counter() after a step, tokens
        generated so far over all prompts) for every step that produced tokens."""

    def version(self) -> str:
        return "unknown"

    def extra(self) -> dict[str, Any]:
        """Engine-specific details to record (cache hits, batch sizes...)."""
        return {}


class TreeRssSampler:
    """Samples the summed RSS of a process (default: this one) and its descendants (engines may fork
    workers); the first sample is taken at once, so a short `with` block still gets one."""

    def __init__(self, interval_s: float = 0.25, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.peak_kb = 0
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeRssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.peak_kb = max(self.peak_kb, tree_rss_kb(self.pid))
            if self._stop.wait(self._interval):
                return


def tree_rss_kb(root: int) -> int:
    """Summed VmRSS (KiB) of process `root` and its descendants."""
    return sum(_rss_kb(pid) for pid in _tree(root))


def hwm_kb(pid: int) -> int:
    """The process's peak RSS so far (VmHWM, KiB)."""
    return _status_kb(pid, "VmHWM")


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _rss_kb(pid: int) -> int:
    return _status_kb(pid, "VmRSS")


def _tree(root: int) -> list[int]:
    """`root` and all its descendants, from /proc/<pid>/task/*/children."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:
                continue
    return pids


def timed(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Latency of one generate call and the number of tokens it produced."""
    start = time.perf_counter()
    counts = engine.generate(prompts, max_tokens)
    return time.perf_counter() - start, sum(counts)


def decode_rate(timeline: list[tuple[float, int]], batch: int) -> float:
    """Decode tok/s of a batch from its step timeline: the steps after the one where all `batch` prompts
    have their first token (so no prefill is left), until the last step."""
    ready = next(i for i, (_, produced) in enumerate(timeline) if produced >= batch)
    (t_ready, n_ready), (t_end, n_end) = timeline[ready], timeline[-1]
    if n_end <= n_ready:
        raise ValueError("no decode step after the prompts were computed (max_tokens too small)")
    return (n_end - n_ready) / max(t_end - t_ready, 1e-9)


class Suite:
    """Runs the workloads on one engine and fills the common result schema."""

    def __init__(self, engine: Engine, work: wl.Workloads, metrics: set[str], budget_s: float | None) -> None:
        self.engine = engine
        self.work = work
        self.wanted = metrics
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s if budget_s else float("inf")
        self.result: dict[str, Any] = {m: None for m in METRICS}
        self.notes: dict[str, str] = dict(engine.notes)
        self.details: dict[str, Any] = {}

    def measure(self, metric: str, fn: Callable[[], float]) -> None:
        if metric not in self.wanted:
            self.notes.setdefault(metric, "not requested")
            return
        if time.monotonic() > self.deadline:
            self.notes[metric] = f"skipped: the runner's time budget ({self.budget_s:.0f} s) ran out"
            return
        print(f"[{self.engine.name}] {metric} ...", file=sys.stderr, flush=True)
        try:
            self.result[metric] = round(fn(), 4)
        except NotImplementedError as exc:  # the engine cannot run this workload: its note says why
            self.notes.setdefault(metric, f"not supported: {exc}")
        except Exception as exc:  # one broken workload must not lose the others
            self.notes[metric] = f"failed: {type(exc).__name__}: {exc}"[:500]
        print(f"[{self.engine.name}] {metric} = {self.result[metric]}", file=sys.stderr, flush=True)

    def prefill(self, length: str) -> float:
        rates = []
        for prompt in self.work.prefill[length]:
            latency, _ = timed(self.engine, [prompt], 1)
            rates.append(len(prompt) / latency)
        return statistics.median(rates)

    def decode(self, batches: list[list[list[int]]]) -> float:
        """Median over the repeats (distinct batches) of the decode-window rate."""
        tokens = self.work.decode_tokens
        return statistics.median(decode_rate(self.engine.decode_timeline(b, tokens), len(b)) for b in batches)

    def throughput(self) -> float:
        latency, produced = timed(self.engine, self.work.throughput, self.work.decode_tokens)
        prompt_tokens = sum(map(len, self.work.throughput))
        self.details["throughput"] = {
            "requests": len(self.work.throughput),
            "prompt_tokens": prompt_tokens,
            "generated_tokens": produced,
            "wall_s": round(latency, 3),
            "total_tok_s": round((prompt_tokens + produced) / latency, 2),
        }
        return produced / latency

    def prefix_cold(self) -> float:
        return timed(self.engine, [self.work.prefix_cold], 1)[0]

    def prefix_warm(self) -> float:
        return statistics.median(timed(self.engine, [p], 1)[0] for p in self.work.prefix_warm)

    def run(self) -> None:
        """Cheap metrics first, so a time budget cuts the expensive ones (8k prefill, batches)."""
        w = self.work
        self.measure("prefill_512_tok_s", lambda: self.prefill("512"))
        self.measure("prefill_2048_tok_s", lambda: self.prefill("2048"))
        self.measure("decode_b1_tok_s", lambda: self.decode([[p] for p in w.decode_b1]))
        self.measure("prefix_cold_ttft_s", self.prefix_cold)
        self.measure("prefix_warm_ttft_s", self.prefix_warm)
        self.measure("prefill_8192_tok_s", lambda: self.prefill("8192"))
        self.measure("decode_b32_tok_s", lambda: self.decode(w.decode_b32))
        self.measure("throughput_64_tok_s", self.throughput)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run the glmserve benchmark workloads on one engine.")
    parser.add_argument("--workloads", type=Path, required=True, help="JSON from `workloads.py build`")
    parser.add_argument("--t0", type=float, default=None, help="wall-clock launch time (time.time()) for startup_s")
    parser.add_argument("--gguf", type=Path, help="the SmolLM2 GGUF")
    parser.add_argument("--hf-dir", type=Path, help="the exported bf16 HF folder")
    parser.add_argument(
        "--dtype", help="weights/activations dtype (default: bfloat16 for peers, the engine's own for ours)"
    )
    parser.add_argument("--quantization", help="glmserve only: weight format (default: the GGUF's own blocks; "
                        "none: float)")
    parser.add_argument("--metrics", default=",".join(METRICS), help="comma-separated subset of metrics")
    parser.add_argument("--budget-s", type=float, help="start no new metric after this many seconds of measuring")
    return parser.parse_args(argv)


def run_main(make_engine: Callable[[], Engine], argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point of a runner script: measure everything, print the result JSON line."""
    t0 = time.time()
    args = parse_args(argv)
    launch = args.t0 if args.t0 is not None else t0
    work = wl.load(args.workloads)
    load_start = round(os.getloadavg()[0], 2)  # other work on the machine skews every number
    engine = make_engine()
    with TreeRssSampler() as sampler:
        engine.load(args)
        startup_latency, _ = timed(engine, [work.startup], 1)
        startup = time.time() - launch
        timed(engine, [work.warmup], 4)
        suite = Suite(engine, work, set(args.metrics.split(",")), args.budget_s)
        suite.result["startup_s"] = round(startup, 3)
        suite.details["first_request_s"] = round(startup_latency, 3)
        suite.run()
    suite.result["peak_rss_mb"] = round(max(hwm_kb(os.getpid()), sampler.peak_kb) / 1024, 1)
    result = {
        "engine": engine.name,
        "version": engine.version(),
        **suite.result,
        "notes": suite.notes,
        "details": {
            **suite.details,
            **engine.extra(),
            "quick": work.quick,
            "decode_tokens": work.decode_tokens,
            "threads": wl.THREADS,
            "loadavg_1m_start_end": [load_start, round(os.getloadavg()[0], 2)],
            "unlike": sorted(engine.unlike),
        },
    }
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return result
