"""Prefill attention alone: our AMX bf16 kernel (kernels op `prefill_attention`) against torch's bf16 SDPA (what
layers/attention.py runs without it), SmolLM2-135M's heads, one thread, interleaved in one process.

    GLMSERVE_BENCH_THREADS=1 taskset -c 0 .venv/bin/python bench/bench_prefill_attention.py \
        [--cases 512,2048,8192,512@4096] [--repeats 7] [--clock cpu]

A case `T` is a fresh prompt of T tokens (SDPA's is_causal kernel); `T@C` a chunk of T queries over C cached keys,
both given the keys gathered head-major as the layer gathers them ([Hkv, 1, C + T, D]), SDPA with the causal
mask at the offset that the layer builds. Each repeat times each side over enough calls for ~0.2 s, the order
alternating by repeat; prints medians, GFLOP/s of the causal FLOPs (4 * D * Hq * sum over queries of the keys
each attends) and the ratio, with the load average before and after. `--clock cpu`: this thread's CPU time
(time slices lost to other processes on a shared machine do not count).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M


def causal_flops(t: int, context: int) -> float:
    keys = sum(context + i + 1 for i in range(t))
    return 4.0 * DIM * HEADS * keys


def case(spec: str, kernel, gen: torch.Generator):
    """(name, ours, sdpa, flops) for one case: two closures over the same bf16 inputs."""
    t, _, c = spec.partition("@")
    t, context = int(t), int(c or 0)
    length = context + t
    q = torch.randn(t, HEADS, DIM, generator=gen).bfloat16()
    keys, values = (torch.randn(KV_HEADS, 1, length, DIM, generator=gen).bfloat16() for _ in range(2))
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    scale = DIM**-0.5
    q_lens, kv_lens = torch.tensor([t]), torch.tensor([length])

    def ours():
        return kernel(q, keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3), q_lens, kv_lens, scale, True)

    if context == 0:
        def sdpa():
            return F.scaled_dot_product_attention(qs, keys.transpose(0, 1), values.transpose(0, 1), is_causal=True,
                                                  scale=scale, enable_gqa=True)
    else:
        mask = (torch.arange(length)[None, :] <= (context + torch.arange(t))[:, None])[None, None]

        def sdpa():
            return F.scaled_dot_product_attention(qs, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
                                                  scale=scale, enable_gqa=True)
    name = f"T={t}" if context == 0 else f"T={t} over {context} cached"
    return name, ours, sdpa, causal_flops(t, context)


def timed(fn, clock, calls: int) -> float:
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

    cpu = torch.device("cpu")
    probe = kernels.op("prefill_attention_available", cpu, torch.bfloat16)
    if probe is None or not probe():
        raise SystemExit("prefill_attention needs the avx512 build on a CPU with AMX-BF16")
    kernel = kernels.op("prefill_attention", cpu, torch.bfloat16)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"load average before: {open('/proc/loadavg').read().strip()}; threads {torch.get_num_threads()}, "
          f"clock {args.clock}")
    gen = torch.Generator().manual_seed(0)
    for spec in args.cases.split(","):
        name, ours, sdpa, flops = case(spec, kernel, gen)
        calls = {}
        for side, fn in (("ours", ours), ("sdpa", sdpa)):  # warm-up, and calls per timing for ~0.2 s
            fn()
            calls[side] = max(1, int(0.2 / max(timed(fn, time.perf_counter, 1), 1e-6)))
        times: dict[str, list[float]] = {"ours": [], "sdpa": []}
        for r in range(args.repeats):
            order = (("ours", ours), ("sdpa", sdpa)) if r % 2 == 0 else (("sdpa", sdpa), ("ours", ours))
            for side, fn in order:
                times[side].append(timed(fn, clock, calls[side]))
        med = {side: statistics.median(ts) for side, ts in times.items()}
        print(f"{name:>24}: ours {med['ours'] * 1e3:8.2f} ms {flops / med['ours'] / 1e9:6.0f} GFLOP/s | "
              f"torch SDPA bf16 {med['sdpa'] * 1e3:8.2f} ms {flops / med['sdpa'] / 1e9:6.0f} GFLOP/s | "
              f"x{med['sdpa'] / med['ours']:.2f}", flush=True)
    print(f"load average after: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
