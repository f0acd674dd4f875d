"""A/B of two engines of our prefill attention kernel (csrc/prefill_attention.cpp: "avx512_bf16", "avx512_fma", or
"amx") inside whole one-token prefills, in one process: the layer's kernel is wrapped to run a given engine, and
each prompt is prefilled once per engine, the order alternating by prompt. Prints per length the median process CPU
time of each engine and B / A speed. With one thread (the default) the CPU time counts only the work itself, which
suits a shared host.

    GLMSERVE_BENCH_THREADS=1 .venv/bin/python bench/ab_attention_engine.py [--a avx512_bf16] [--b avx512_fma] \
        [--prefill 128,550,2048] [--repeats 10]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import workloads as wl

import glmserve.layers.attention as attention
from glmserve import LLM, SamplingParams


def pin_engine() -> dict[str, str]:
    """Wraps the layer's kernel lookup so that every call runs the engine held in the returned dict's "engine"."""
    chosen = {"engine": ""}
    lookup = attention.bf16_prefill_kernel

    def pinned(head_dim: int) -> Callable | None:
        kernel = lookup(head_dim)
        return None if kernel is None else functools.partial(kernel, engine=chosen["engine"])

    attention.bf16_prefill_kernel = pinned
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", default="avx512_bf16", help="engine A (the baseline)")
    parser.add_argument("--b", default="avx512_fma", help="engine B")
    parser.add_argument("--prefill", default="128,550,2048")
    parser.add_argument("--repeats", type=int, default=10, help="prompts per length")
    args = parser.parse_args()
    torch.set_num_threads(wl.THREADS)
    chosen = pin_engine()
    # No prefix cache: each prompt is prefilled once per engine, and the second run must not hit the first's blocks.
    llm = LLM(model=None, num_threads=wl.THREADS, enable_prefix_caching=False)
    maker = wl.PromptMaker(wl.load_tokenizer(wl.embedded_gguf_path()), wl.SEED + 17)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    lengths = [int(n) for n in args.prefill.split(",")]
    for n in lengths:  # warm-up: kernels, scratch buffers and the allocator at each length, on each engine
        for engine in (args.a, args.b):
            chosen["engine"] = engine
            llm.generate([maker.tokens(n)], one)
    print(f"threads {wl.THREADS}, load average {open('/proc/loadavg').read().strip()}")
    for n in lengths:
        times: dict[str, list[float]] = {args.a: [], args.b: []}
        for r in range(args.repeats):
            prompt = maker.tokens(n)
            for engine in (args.a, args.b) if r % 2 == 0 else (args.b, args.a):
                chosen["engine"] = engine
                start = time.process_time()
                llm.generate([prompt], one)
                times[engine].append(time.process_time() - start)
        a, b = statistics.median(times[args.a]), statistics.median(times[args.b])
        print(f"prefill {n}: {args.a} {a * 1e3:.1f} ms ({n / a:.0f} tok/s) | {args.b} {b * 1e3:.1f} ms "
              f"({n / b:.0f} tok/s) | B / A x{a / b:.3f}", flush=True)


if __name__ == "__main__":
    main()
