"""Where our engine's time goes: torch.profiler over a prefill and over batched decode steps.

    .venv/bin/python bench/profile_engine.py [--prefill 512] [--batch 32] [--steps 16] [--top 15] [--dtype D] \
        [--cpu-repeats N] [--model PATH]

Runs the embedded model (engine defaults, GLMSERVE_BENCH_THREADS threads) on bench workload
prompts: one `--prefill`-token prompt with 1 new token, then `--batch` 128-token prompts whose
prefill is left out of the profile, and `--steps` decode steps of that batch. Prints, per phase,
the wall time, the ops with the most self CPU time and their share of the profiled time, the
share outside any torch op (Python: batch building, scheduling, sampling glue), and torch's
build configuration (which BLAS / oneDNN the GEMMs go to). Our C++ kernels (glmserve/kernels, pybind11
functions the profiler does not see) are wrapped in `record_function("kernels::NAME")`, so each appears as
an op of its own; their self time excludes the aten ops they call. `--cpu-repeats N` (one thread) also times N
unprofiled prefills by the thread's CPU time, per kernel and the rest (aten ops, Python): on a host shared with
other work, time slices lost to other processes do not count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import workloads as wl

os.environ.setdefault("OMP_NUM_THREADS", str(wl.THREADS))


KERNEL_CPU_S: dict[str, float] = {}  # thread CPU seconds per kernel op, summed since the last clear()


def profile_kernels() -> None:
    """Every C++ kernel op the dispatcher hands out from now on runs inside record_function("kernels::NAME") and
    adds its thread CPU time to KERNEL_CPU_S[NAME]."""
    import functools
    import types

    import torch

    from glmserve.kernels import dispatch

    def wrapped(fn, name: str):
        def call(*args, **kwargs):
            start = time.thread_time()
            try:
                with torch.profiler.record_function(f"kernels::{name}"):
                    return fn(*args, **kwargs)
            finally:
                KERNEL_CPU_S[name] = KERNEL_CPU_S.get(name, 0.0) + time.thread_time() - start
        return call

    @functools.cache
    def load(source: str, isa: str):
        module = real_load(source, isa)
        if module is None:
            return None
        names = [n for n, s in dispatch.OPS.items() if s == source]
        return types.SimpleNamespace(**{n: wrapped(getattr(module, n), n) for n in names})

    real_load = dispatch.load
    dispatch.load = load


def cpu_report(run: object, repeats: int) -> None:
    """`repeats` calls of run() timed by this thread's CPU time: medians per kernel op and of the rest."""
    samples: list[dict[str, float]] = []
    for _ in range(repeats):
        KERNEL_CPU_S.clear()
        start = time.thread_time()
        run()  # type: ignore[operator]
        total = time.thread_time() - start
        sample = {f"kernels::{k}": v for k, v in KERNEL_CPU_S.items()}
        sample["rest (aten ops, Python)"] = total - sum(sample.values())
        sample["total"] = total
        samples.append(sample)
    print(f"\n## thread CPU time, medians of {repeats} prefills (one thread only: workers are not counted)")
    print("| part | CPU ms | share |\n|---|---|---|")
    med = {k: statistics.median(s.get(k, 0.0) for s in samples) for k in samples[0]}
    for k in sorted(med, key=lambda k: -med[k]):
        print(f"| {k} | {med[k] * 1e3:.1f} | {med[k] / med['total']:.1%} |")


def report(name: str, prof: object, wall_s: float, top: int) -> None:
    events = prof.key_averages()  # type: ignore[attr-defined]
    total_us = wall_s * 1e6
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    in_ops = sum(e.self_cpu_time_total for e in rows)
    print(f"\n## {name}: {wall_s * 1e3:.1f} ms wall; torch ops {in_ops / total_us:.0%}, outside ops "
          f"{1 - in_ops / total_us:.0%}")
    print("| op | calls | self CPU ms | share of wall |")
    print("|---|---|---|---|")
    for e in rows[:top]:
        print(f"| {e.key} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} | {e.self_cpu_time_total / total_us:.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--dtype", default="auto", help="engine dtype (auto: float32 on CPU)")
    parser.add_argument("--model", default=None, help="a model folder or GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--cpu-repeats", type=int, default=0,
                        help="also time this many unprofiled prefills by thread CPU time (one thread)")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from glmserve import LLM, SamplingParams

    torch.set_num_threads(wl.THREADS)
    profile_kernels()
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=wl.THREADS)
    engine = llm.engine
    maker = wl.PromptMaker(wl.load_tokenizer(wl.embedded_gguf_path()), wl.SEED + 3)
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # warm-up: lazy init, kernel loading, and at the profiled length the first dense-path call's work (prepacked
    # bf16 weights, oneDNN's primitives for these shapes), which a serving process pays once
    llm.generate([maker.tokens(64)], greedy)
    llm.generate([maker.tokens(args.prefill)], greedy)

    prompt = maker.tokens(args.prefill)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate([prompt], greedy)
        wall = time.perf_counter() - start
    report(f"prefill {args.prefill} tokens", prof, wall, args.top)
    if args.cpu_repeats:
        cpu_report(lambda: llm.generate([maker.tokens(args.prefill)], greedy), args.cpu_repeats)

    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True)
    for i, p in enumerate(maker.batch(args.batch, wl.DECODE_BATCH_PROMPT_LEN)):
        engine.add_request(f"profile-{i}", p, params)
    while not all(s.num_output_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the batch's prefill, outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = time.perf_counter() - start
    report(f"decode batch {args.batch}, {args.steps} steps ({args.batch * args.steps / wall:.1f} tok/s)", prof,
           wall, args.top)
    while engine.has_unfinished_requests():
        engine.step()
    print(f"\nthreads {torch.get_num_threads()}, mkldnn {torch.backends.mkldnn.is_available()}, "
          f"mkl {torch.backends.mkl.is_available()}")
    print("\n".join(line for line in torch.__config__.show().splitlines() if "BLAS" in line or "LAPACK" in line))


if __name__ == "__main__":
    main()
