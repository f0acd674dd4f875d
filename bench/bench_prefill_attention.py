"""Prefill attention alone: our bf16 kernel (kernels op `prefill_attention`: AMX tiles, or AVX512-BF16 where there
are none) and, on the avx2 build (CPUs without AVX-512), our float32 kernel (`prefill_attention_f32`,
side "ours f32", on the same bf16 K/V) against torch's SDPA in float32 (what layers/attention.py runs on a CPU
without either) and in bf16 (what it runs where bf16 attention is on but our kernel is not), SmolLM2-135M's heads,
interleaved in one process.

    GLMSERVE_BENCH_THREADS=1 taskset -c 0 .venv/bin/python bench/bench_prefill_attention.py \
        [--cases 512,2048,8192,512@4096] [--repeats 7] [--clock cpu]

A case `T` is a fresh prompt of T tokens (SDPA's is_causal kernel); `T@C` a chunk of T queries over C cached keys,
both given the keys gathered head-major as the layer gathers them ([Hkv, 1, C + T, D]), SDPA with the causal
mask at the offset that the layer builds. Each repeat times each side over enough calls for ~0.2 s, the order
rotating by repeat; prints medians, GFLOP/s of the causal FLOPs (4 * D * Hq * sum over queries of the keys
each attends) and each side's speed relative to float32 SDPA, with the load average before and after. `--clock
cpu`: this thread's CPU time (time slices lost to other processes on a shared machine do not count). Our kernel's
bf16 side is left out on a CPU that runs neither of its paths, the float32 one where the avx2 build is not active.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M


def causal_flops(t: int, context: int) -> float:
    keys = sum(context + i + 1 for i in range(t))
    return 4.0 * DIM * HEADS * keys


def case(spec: str, kernel: Callable | None, kernel_f32: Callable | None,
         gen: torch.Generator) -> tuple[str, dict[str, Callable], float]:
    """(name, {side: closure over the same bf16 values}, flops) for one case."""
    t, _, c = spec.partition("@")
    t, context = int(t), int(c or 0)
    length = context + t
    q = torch.randn(t, HEADS, DIM, generator=gen).bfloat16()
    keys, values = (torch.randn(KV_HEADS, 1, length, DIM, generator=gen).bfloat16() for _ in range(2))
    scale = DIM**-0.5
    q_lens, kv_lens = torch.tensor([t]), torch.tensor([length])
    mask = None if context == 0 else (torch.arange(length)[None, :] <= (context + torch.arange(t))[:, None])[None, None]

    def sdpa(dtype: torch.dtype) -> Callable:
        qs, ks, vs = (x.to(dtype) for x in (q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1),
                                            values.transpose(0, 1)))
        return lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                      enable_gqa=True)

    sides = {"sdpa f32": sdpa(torch.float32), "sdpa bf16": sdpa(torch.bfloat16)}
    if kernel is not None:
        sides["ours"] = lambda: kernel(q, keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3), q_lens, kv_lens,
                                       scale, True)
    if kernel_f32 is not None:
        qf, kp, vp = q.float(), keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)
        sides["ours f32"] = lambda: kernel_f32(qf, kp, vp, q_lens, kv_lens, scale)
    name = f"T={t}" if context == 0 else f"T={t} over {context} cached"
    return name, sides, causal_flops(t, context)


def timed(fn: Callable, clock: Callable[[], float], calls: int) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="512,2048,8192,512@4096")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("GLMSERVE_BENCH_THREADS", "1")))
    from glmserve import kernels
    from glmserve.layers.attention import f32_prefill_kernel

    cpu = torch.device("cpu")
    probe = kernels.op("prefill_attention_available", cpu, torch.bfloat16)
    kernel = kernels.op("prefill_attention", cpu, torch.bfloat16) if probe is not None and probe() else None
    kernel_f32 = f32_prefill_kernel(DIM)  # (the layer's own choice: the avx2 build)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"load average before: {open('/proc/loadavg').read().strip()}; threads {torch.get_num_threads()}, "
          f"clock {args.clock}, our bf16 kernel {'yes' if kernel is not None else 'not on this CPU'}, "
          f"float32 kernel {'yes' if kernel_f32 is not None else 'not in this build'}")
    gen = torch.Generator().manual_seed(0)
    for spec in args.cases.split(","):
        name, sides, flops = case(spec, kernel, kernel_f32, gen)
        calls = {}
        for side, fn in sides.items():  # warm-up, and calls per timing for ~0.2 s
            fn()
            calls[side] = max(1, int(0.2 / max(timed(fn, time.perf_counter, 1), 1e-6)))
        times: dict[str, list[float]] = {side: [] for side in sides}
        order = list(sides)
        for r in range(args.repeats):
            for side in order[r % len(order):] + order[:r % len(order)]:
                times[side].append(timed(sides[side], clock, calls[side]))
        med = {side: statistics.median(ts) for side, ts in times.items()}
        cells = [f"{side} {med[side] * 1e3:8.2f} ms {flops / med[side] / 1e9:5.0f} GFLOP/s "
                 f"x{med['sdpa f32'] / med[side]:.2f}" for side in sides]
        print(f"{name:>24}: " + " | ".join(cells), flush=True)
    print(f"load average after: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
