"""Measurement code shared by every engine runner (ours and the peers).

A runner wraps its engine in an `Engine` (load + generate on token ids) and calls
`run_main(make_engine)`. The harness times every workload in `workloads.py` the same way, either all
in a row or (`--worker`, how bench_engine.py runs engines interleaved) one sample per command read from
stdin, and prints one JSON object (the common schema, see `METRICS`) as the last line of stdout:

    {"engine": ..., "version": ..., "prefill_512_tok_s": ..., ..., "peak_rss_mb": ...,
     "notes": {metric: why it is null or how it differs}, "details": {...}}

Definitions:
  prefill_N_tok_s      prompt tokens / latency of a max_tokens=1 request (median of repeats)
  decode_bK_tok_s      tokens generated / wall time of the decode steps of a K-prompt batch, timed
                       from the step after which every prompt has its first token (from the engine's
                       own step timeline, `Timeline`) to the end: prefill is outside the window
                       (median of repeats)
  throughput_64_tok_s  generated tokens / wall time, all 64 requests submitted at once
  prefix_*_ttft_s      latency of a max_tokens=1 request with a 4,000-token prefix: the first
                       time (cold) and then with other suffixes (warm, median)
  startup_s            process launch (the --t0 wall clock from the driver) to the first token
  peak_rss_mb          max of this process's VmHWM, the sampled RSS of its process tree and the
                       engine's own `peak_rss_kb` (a server process's VmHWM)
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
READY_MARKER = "BENCH_READY "  # worker mode: loaded, startup measured, waiting for commands
SAMPLE_MARKER = "BENCH_SAMPLE "  # worker mode: one measured sample
#: a decode step timeline: (time.perf_counter() after the step, tokens generated so far over all prompts,
#: prompts that have their first token so far)
Timeline = list[tuple[float, int, int]]


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
    def decode_timeline(self, prompts: list[list[int]], max_tokens: int) -> Timeline:
        """Runs `generate(prompts, max_tokens)` step by step: (time.perf_counter() after a step, tokens
        generated so far over all prompts, prompts with a first token so far) for every step that produced
        tokens."""

    def version(self) -> str:
        return "unknown"

    def extra(self) -> dict[str, Any]:
        """Engine-specific details to record (cache hits, batch sizes...)."""
        return {}

    def measure_itself(self, metric: str, work: wl.Workloads, index: int) -> float | None:
        """An engine whose own tool times a workload (llama-bench) returns that rate here; None: time it
        through `generate`/`decode_timeline` as every other engine."""
        return None

    def peak_rss_kb(self) -> int:
        """Peak RSS of processes the engine runs outside this one's tree sampling (a server: its VmHWM)."""
        return 0

    def close(self) -> None:  # noqa: B027 (optional hook: most engines start nothing)
        """Stop what `load` started (a server process)."""


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


def ready_step(timeline: Timeline, batch: int) -> int:
    """The index of the step where all `batch` prompts have their first token (no prefill is left after it)."""
    ready = next((i for i, (_, _, started) in enumerate(timeline) if started >= batch), None)
    if ready is None:
        raise ValueError(f"only {timeline[-1][2] if timeline else 0} of {batch} prompts got a token")
    return ready


def decode_rate(timeline: Timeline, batch: int) -> float:
    """Decode tok/s of a batch from its step timeline: the steps after `ready_step`, until the last step."""
    (t_ready, n_ready, _), (t_end, n_end, _) = timeline[ready_step(timeline, batch)], timeline[-1]
    if n_end <= n_ready:
        raise ValueError("no decode step after the prompts were computed (max_tokens too small)")
    return (n_end - n_ready) / max(t_end - t_ready, 1e-9)


def repeats(work: wl.Workloads, metric: str) -> int:
    """How many distinct samples `metric` has in `work` (one prompt or batch each)."""
    if metric == "throughput_64_tok_s":
        return len(work.throughput)  # distinct request sets: each run's prompts are new to the prefix cache
    if metric == "prefix_cold_ttft_s":
        return 1  # the cold prefix is cold once
    return work.repeats


class Suite:
    """Runs the workloads on one engine, one sample (a prompt or a batch) at a time."""

    #: the order metrics are measured in: cheap ones first, so a time budget cuts the expensive ones
    ORDER = ("prefill_512_tok_s", "prefill_2048_tok_s", "decode_b1_tok_s", "prefix_cold_ttft_s",
             "prefix_warm_ttft_s", "prefill_8192_tok_s", "decode_b32_tok_s", "throughput_64_tok_s")

    def __init__(self, engine: Engine, work: wl.Workloads) -> None:
        self.engine = engine
        self.work = work
        self.details: dict[str, Any] = {}

    def sample(self, metric: str, index: int) -> float:
        """The value of sample `index` of `metric` (index < repeats(work, metric))."""
        w, engine = self.work, self.engine
        own = engine.measure_itself(metric, w, index)
        if own is not None:
            return own
        if metric.startswith("prefill_"):
            prompt = w.prefill[metric.split("_")[1]][index]
            return len(prompt) / timed(engine, [prompt], 1)[0]
        if metric == "decode_b1_tok_s":
            return decode_rate(engine.decode_timeline([w.decode_b1[index]], w.decode_tokens), 1)
        if metric == "decode_b32_tok_s":
            batch = w.decode_b32[index]
            return decode_rate(engine.decode_timeline(batch, w.decode_tokens), len(batch))
        if metric == "throughput_64_tok_s":
            return self._throughput(w.throughput[index])
        if metric == "prefix_cold_ttft_s":
            return timed(engine, [w.prefix_cold], 1)[0]
        if metric == "prefix_warm_ttft_s":
            return timed(engine, [w.prefix_warm[index]], 1)[0]
        raise ValueError(f"unknown metric {metric!r}")

    def _throughput(self, requests: list[list[int]]) -> float:
        cpu = time.process_time()
        latency, produced = timed(self.engine, requests, self.work.decode_tokens)
        cpu = time.process_time() - cpu
        prompt_tokens = sum(map(len, requests))
        self.details.setdefault("throughput", []).append({  # one entry per request set, in measuring order
            "requests": len(requests),
            "prompt_tokens": prompt_tokens,
            "generated_tokens": produced,
            "wall_s": round(latency, 3),
            "total_tok_s": round((prompt_tokens + produced) / latency, 2),
            # this process's CPU time (every thread): with 1 thread on a shared core, steadier than wall time
            "cpu_s": round(cpu, 3),
            "tok_per_cpu_s": round(produced / cpu, 2),
        })
        return produced / latency


def measure(suite: Suite, metric: str, index: int) -> tuple[float | None, str | None]:
    """One sample, or (None, why) when the engine cannot run it or it failed."""
    print(f"[{suite.engine.name}] {metric} #{index} ...", file=sys.stderr, flush=True)
    try:
        value, error = round(suite.sample(metric, index), 4), None
    except NotImplementedError as exc:  # the engine cannot run this workload: its note says why
        value, error = None, f"not supported: {exc}"
    except Exception as exc:  # one broken workload must not lose the others
        value, error = None, f"failed: {type(exc).__name__}: {exc}"[:500]
    print(f"[{suite.engine.name}] {metric} #{index} = {value} {error or ''}", file=sys.stderr, flush=True)
    return value, error


def run_sequential(suite: Suite, wanted: set[str], budget_s: float | None) -> tuple[dict, dict, dict]:
    """Every wanted metric in `Suite.ORDER`, all its samples in a row: (medians, notes, samples)."""
    deadline = time.monotonic() + budget_s if budget_s else float("inf")
    values: dict[str, Any] = {}
    notes: dict[str, str] = {}
    samples: dict[str, list[float]] = {}
    for metric in Suite.ORDER:
        if metric not in wanted:
            notes[metric] = "not requested"
            continue
        if time.monotonic() > deadline:
            notes[metric] = f"skipped: the runner's time budget ({budget_s:.0f} s) ran out"
            continue
        for index in range(repeats(suite.work, metric)):
            value, error = measure(suite, metric, index)
            if error:
                notes[metric] = error
                break
            samples.setdefault(metric, []).append(value)
        if metric in samples and metric not in notes:
            values[metric] = round(statistics.median(samples[metric]), 4)
    return values, notes, samples


def serve_commands(suite: Suite) -> None:
    """Worker mode (bench_engine.py interleaves engines): one JSON command per stdin line,
    {"metric": M, "index": I} -> one SAMPLE_MARKER line; {"finish": true} ends it."""
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("finish"):
            return
        value, error = measure(suite, command["metric"], command["index"])
        reply = {"metric": command["metric"], "index": command["index"], "value": value, "error": error,
                 "loadavg_1m": round(os.getloadavg()[0], 2)}
        print(SAMPLE_MARKER + json.dumps(reply), flush=True)


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
    parser.add_argument("--worker", action="store_true",
                        help="after startup, measure the samples that JSON lines on stdin ask for (bench_engine.py)")
    return parser.parse_args(argv)


def run_main(make_engine: Callable[[], Engine], argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point of a runner script: measure (all metrics, or the driver's commands with --worker) and
    print the result JSON line."""
    t0 = time.time()
    args = parse_args(argv)
    launch = args.t0 if args.t0 is not None else t0
    work = wl.load(args.workloads)
    load_start = round(os.getloadavg()[0], 2)  # other work on the machine skews every number
    engine = make_engine()
    try:
        with TreeRssSampler() as sampler:
            engine.load(args)
            startup_latency, _ = timed(engine, [work.startup], 1)
            startup = time.time() - launch
            timed(engine, [work.warmup], 4)
            suite = Suite(engine, work)
            if args.worker:
                print(READY_MARKER + json.dumps({"startup_s": round(startup, 3)}), flush=True)
                serve_commands(suite)
                values, notes, samples = {}, {}, {}
            else:
                values, notes, samples = run_sequential(suite, set(args.metrics.split(",")), args.budget_s)
        peak_kb = max(hwm_kb(os.getpid()), sampler.peak_kb, engine.peak_rss_kb())
        result = {
            "engine": engine.name,
            "version": engine.version(),
            **{m: values.get(m) for m in METRICS},
            "startup_s": round(startup, 3),
            "peak_rss_mb": round(peak_kb / 1024, 1),
            "notes": {**engine.notes, **notes},
            "details": {
                **suite.details,
                **engine.extra(),
                "first_request_s": round(startup_latency, 3),
                "samples": samples,
                "quick": work.quick,
                "decode_tokens": work.decode_tokens,
                "threads": wl.THREADS,
                "loadavg_1m_start_end": [load_start, round(os.getloadavg()[0], 2)],
                "unlike": sorted(engine.unlike),
            },
        }
    finally:
        engine.close()
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return result
