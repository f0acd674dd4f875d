"""Where the 64-request throughput run's time goes: a per-step log of our engine on that workload.

    GLMSERVE_BENCH_THREADS=1 .venv/bin/python bench/profile_throughput.py [--requests 64] [--set 0]
        [--decode-tokens N] [--max-num-batched-tokens N] [--max-num-seqs N] [--log steps.jsonl]

Submits the bench's `throughput` workload (bench/workloads.py: 64 prompts of 100..1,000 tokens, greedy,
ignore_eos, DECODE_TOKENS new tokens each; `--set` picks one of its request sets, `--requests` takes the first N)
all at once, then steps the engine by hand as `LLM.generate` does, timing each step's three parts: scheduling, the
runner (batch building, model, sampling) and the engine's bookkeeping after it. Prints the KV pool against what the
workload needs, then the wall time split by step kind (pure prefill, mixed prefill + decode, pure decode), the
decode rows per step over the run, and steps with small prefill chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import workloads as wl

os.environ.setdefault("OMP_NUM_THREADS", str(wl.THREADS))


@dataclass
class Step:
    decode_rows: int  # rows with one new token
    prefill_rows: int
    prefill_tokens: int
    schedule_s: float
    execute_s: float
    post_s: float  # the engine's bookkeeping after the runner (stop checks, outputs)
    cpu_s: float  # this thread's CPU time over the step (with 1 thread: the step's compute, whatever the load)
    running: int
    waiting: int
    free_blocks: int

    @property
    def kind(self) -> str:
        if self.prefill_rows and self.decode_rows:
            return "mixed"
        return "prefill" if self.prefill_rows else "decode"

    @property
    def wall_s(self) -> float:
        return self.schedule_s + self.execute_s + self.post_s


def timed_calls(obj: Any, name: str, sink: list[float]) -> None:
    """Wraps `obj.name` so each call's duration is appended to `sink` (an instance attribute shadows it)."""
    inner: Callable = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    setattr(obj, name, wrapper)


def run(engine: Any, prompts: list[list[int]], max_tokens: int, params_cls: Any) -> tuple[list[Step], float]:
    """All prompts submitted at once, stepped to the end: (each step, total wall seconds)."""
    sched_s: list[float] = []
    exec_s: list[float] = []
    batches: list[list[tuple[int, int]]] = []
    schedule = engine.scheduler.schedule

    def schedule_and_record() -> Any:
        start = time.perf_counter()
        batch = schedule()
        sched_s.append(time.perf_counter() - start)
        batches.append([(s.num_new_tokens, s.seq.num_computed_tokens) for s in batch])
        return batch

    engine.scheduler.schedule = schedule_and_record
    timed_calls(engine.runner, "execute", exec_s)
    params = params_cls(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    steps: list[Step] = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"tp-{i}", prompt, params)
    while engine.has_unfinished_requests():
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        sched = engine.scheduler
        batch = batches[-1]
        if not batch:
            continue
        decode = sum(1 for n, computed in batch if n == 1 and computed > 0)
        steps.append(Step(decode_rows=decode, prefill_rows=len(batch) - decode,
                          prefill_tokens=sum(n for n, _ in batch) - decode, schedule_s=sched_s[-1],
                          execute_s=exec_s[-1], post_s=wall - sched_s[-1] - exec_s[-1], cpu_s=cpu,
                          running=len(sched.running), waiting=len(sched.waiting),
                          free_blocks=engine.kv.blocks.num_free_blocks))
    total = time.perf_counter() - start
    del engine.scheduler.schedule, engine.runner.execute
    return steps, total


def summarize(steps: list[Step], total_s: float, generated: int) -> None:
    cpu = sum(s.cpu_s for s in steps)
    print(f"\nwall {total_s:.2f} s ({generated / total_s:.1f} tok/s), step CPU time {cpu:.2f} s "
          f"({generated / cpu:.1f} tok/s per CPU second), {len(steps)} steps, {generated} tokens generated; "
          f"outside steps {total_s - sum(s.wall_s for s in steps):.3f} s wall")
    print("\n| step kind | steps | wall s | CPU s | CPU share | prefill tok | prefill rows/step | decode rows/step | "
          "CPU ms/step | schedule ms/step | bookkeeping ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in ("prefill", "mixed", "decode"):
        group = [s for s in steps if s.kind == kind]
        if not group:
            continue
        n = len(group)
        group_cpu = sum(s.cpu_s for s in group)
        print(f"| {kind} | {n} | {sum(s.wall_s for s in group):.2f} | {group_cpu:.2f} | {group_cpu / cpu:.0%} | "
              f"{sum(s.prefill_tokens for s in group)} | {sum(s.prefill_rows for s in group) / n:.1f} | "
              f"{sum(s.decode_rows for s in group) / n:.1f} | {1e3 * group_cpu / n:.1f} | "
              f"{1e3 * sum(s.schedule_s for s in group) / n:.2f} | {1e3 * sum(s.post_s for s in group) / n:.2f} |")
    decode_only = [s for s in steps if s.kind == "decode"]
    if decode_only:
        rows = [s.decode_rows for s in decode_only]
        print(f"\npure decode steps: rows min {min(rows)} median {statistics.median(rows)} max {max(rows)}; "
              f"{sum(rows) / sum(s.cpu_s for s in decode_only):.1f} tok per CPU second over them")
    prefill_steps = [s for s in steps if s.prefill_rows]
    small = [s for s in prefill_steps if s.prefill_tokens < 256]
    print(f"steps with prefill: {len(prefill_steps)}, of which {len(small)} with < 256 prefill tokens "
          f"({sum(s.cpu_s for s in small):.2f} CPU s)")
    print("\nover the run (every tenth of the steps): step, elapsed wall s, kind, prefill tok, prefill rows, "
          "decode rows, running, waiting, free blocks, step CPU ms")
    elapsed = 0.0
    mark = max(1, len(steps) // 10)
    for i, s in enumerate(steps):
        elapsed += s.wall_s
        if i % mark == 0 or i == len(steps) - 1:
            print(f"  {i:5d} {elapsed:7.2f} {s.kind:7s} {s.prefill_tokens:5d} {s.prefill_rows:3d} {s.decode_rows:3d} "
                  f"{s.running:3d} {s.waiting:3d} {s.free_blocks:6d} {1e3 * s.cpu_s:7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=wl.THROUGHPUT_REQUESTS)
    parser.add_argument("--set", type=int, default=0, help="which of the workloads' request sets (default: 0)")
    parser.add_argument("--decode-tokens", type=int, help="new tokens per request (default: the workloads')")
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", help="the engine's KV format (default: its auto)")
    parser.add_argument("--block-size", type=int, help="tokens per KV block (default: the engine's)")
    parser.add_argument("--log", type=Path, help="write every step as a JSON line here")
    args = parser.parse_args()

    import torch

    from glmserve import LLM, SamplingParams

    torch.set_num_threads(wl.THREADS)
    work = wl.load(wl.ensure(quick=False))
    prompts = work.throughput[args.set][:args.requests]
    max_tokens = args.decode_tokens or work.decode_tokens
    overrides = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                                   ("max_num_seqs", args.max_num_seqs), ("kv_cache_dtype", args.kv_cache_dtype),
                                   ("block_size", args.block_size))
                 if v is not None}
    llm = LLM(model=None, dtype=args.dtype, enable_prefix_caching=True, num_threads=wl.THREADS, **overrides)
    engine = llm.engine
    llm.generate([work.startup], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    llm.generate([work.warmup], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    blocks = engine.kv.blocks
    need = sum(-(-(len(p) + max_tokens) // engine.config.block_size) for p in prompts)
    print(f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {max_tokens} new tokens each; "
          f"max_num_seqs {engine.config.max_num_seqs}, max_num_batched_tokens {engine.config.max_num_batched_tokens}; "
          f"KV pool {blocks.num_usable_blocks} blocks of {engine.config.block_size}, the workload needs {need}; "
          f"load {os.getloadavg()[0]:.2f}")
    preempted = engine.scheduler.num_preemptions
    steps, total = run(engine, prompts, max_tokens, SamplingParams)
    summarize(steps, total, len(prompts) * max_tokens)
    print(f"\npreemptions {engine.scheduler.num_preemptions - preempted}; load {os.getloadavg()[0]:.2f}")
    if args.log:
        args.log.write_text("".join(json.dumps({**asdict(s), "kind": s.kind}) + "\n" for s in steps))


if __name__ == "__main__":
    main()
