"""The 64-request mix (`throughput_64_tok_s`) split in two halves, for one engine: the steps until every prompt has
its first token (prefill, and decode rows riding along) and the pure decode steps after them.

    W=$(.venv/bin/python bench/workloads.py build)
    G=$(cd bench && ../.venv/bin/python -c "import workloads; print(workloads.embedded_gguf_path())")
    H=~/.cache/glmserve-bench/smollm2-bf16
    GLMSERVE_BENCH_THREADS=1 taskset -c 0 .venv/bin/python bench/mix_halves.py ours --workloads $W --gguf $G --hf-dir $H
    GLMSERVE_BENCH_THREADS=1 taskset -c 0 ~/.cache/glmserve-bench/vllm/bin/python bench/mix_halves.py peer_vllm \\
        --workloads $W --gguf $G --hf-dir $H

The first argument names a runner module of bench/ (ours, peer_vllm, peer_llamacpp, peer_transformers); the rest
are the runner's own arguments. Each of the workloads' request sets is run once (each new to the prefix cache),
through the runner's `decode_timeline` (the engine stepped by hand, as the bench's batch decode does), after the
bench's warmup. Prints a line per set and one JSON line (`MIX_HALVES {...}`): the wall time of each half, the steps in
each, the decode steps' median.
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import time

import harness
import workloads as wl


def halves(timeline: harness.Timeline, start: float, requests: int) -> dict[str, float]:
    """The two halves of one run's timeline (harness.Engine.decode_timeline), from `start` (perf_counter)."""
    ready = harness.ready_step(timeline, requests)
    steps = [timeline[i][0] - timeline[i - 1][0] for i in range(ready + 1, len(timeline))]
    total = timeline[-1][0] - start
    return {
        "total_s": round(total, 3),
        "tok_s": round(timeline[-1][1] / total, 2),
        "prefill_steps": ready + 1,
        "prefill_half_s": round(timeline[ready][0] - start, 3),
        "decode_steps": len(steps),
        "decode_half_s": round(sum(steps), 3),
        "decode_step_median_ms": round(statistics.median(steps) * 1e3, 2) if steps else 0.0,
    }


def main() -> None:
    module = importlib.import_module(sys.argv[1])
    runner = next(cls for cls in vars(module).values()
                  if isinstance(cls, type) and issubclass(cls, harness.Engine) and cls.__module__ == module.__name__)
    args = harness.parse_args(sys.argv[2:])
    work = wl.load(args.workloads)
    engine = runner()
    engine.load(args)
    try:
        harness.timed(engine, [work.warmup], 4)
        runs = []
        for index, requests in enumerate(work.throughput):
            start = time.perf_counter()
            run = halves(engine.decode_timeline(requests, work.decode_tokens), start, len(requests))
            runs.append(run)
            print(f"{engine.name} set {index}: {run['total_s']:.2f} s ({run['tok_s']:.1f} tok/s) = prefill-bearing "
                  f"{run['prefill_steps']} steps {run['prefill_half_s']:.2f} s + decode {run['decode_steps']} steps "
                  f"{run['decode_half_s']:.2f} s (median {run['decode_step_median_ms']:.1f} ms)", flush=True)
        print("MIX_HALVES " + json.dumps({"engine": engine.name, "threads": wl.THREADS, "runs": runs}), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
