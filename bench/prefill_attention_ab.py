"""A/B of two versions of the bf16 prefill attention kernel (csrc/prefill_attention.cpp) in one process: A compiled
from the given source under a module name of its own (ab_quant_kernels.build_a), B this checkout's build, called in
turn on the same inputs (SmolLM2's heads: 9 query heads, 3 kv heads, head_dim 64). Checks first that both give the
same floats, from bf16 and from float32 q/k/v (what the engine passes), then times each case from float32 inputs by
the calling thread's CPU time (`--threads 1`) or the wall clock (more threads), alternating the order per repeat.
Cases: `T` a fresh prompt of T tokens, `T@C` a chunk of T queries over C cached keys, `mix` four rows of 100-1,000
queries some over cached keys (a chunked-prefill step of the 64-request mix); `--engine` one of the kernel's
engines (default: the best this CPU runs).

    git show main:glmserve/kernels/csrc/prefill_attention.cpp > /tmp/pa_main.cpp
    .venv/bin/python bench/prefill_attention_ab.py /tmp/pa_main.cpp [--cases 512,2048,8192,512@4096,mix] \
        [--repeats 5] [--threads 1] [--engine avx512_bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from ab_quant_kernels import build_a

from glmserve.kernels.build import load
from glmserve.kernels.isa import active_isa

HEADS, KV_HEADS, DIM = 9, 3, 64
MIX_ROWS = ([100, 37, 1000, 250], [100, 300, 1000, 900])  # queries, keys per row


def rows_of(case: str) -> tuple[list[int], list[int]]:
    """(queries, keys) per row of a case name."""
    if case == "mix":
        return MIX_ROWS
    tokens, _, cached = case.partition("@")
    return [int(tokens)], [int(tokens) + int(cached or 0)]


def inputs(queries: list[int], keys: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random float32 q [T, HEADS, DIM], k, v [rows, longest, KV_HEADS, DIM] and the lengths."""
    longest = max(keys)
    q = torch.randn(sum(queries), HEADS, DIM, generator=gen)
    k, v = (torch.randn(len(keys), longest, KV_HEADS, DIM, generator=gen) for _ in range(2))
    return q, k, v, torch.tensor(queries), torch.tensor(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a_source", type=Path, help="A: a prefill_attention.cpp (e.g. main's)")
    parser.add_argument("--cases", default="512,2048,8192,512@4096,mix")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    a_mod, b_mod = build_a(args.a_source), load("prefill_attention", active_isa())
    if not b_mod.prefill_attention_available():
        raise SystemExit("prefill_attention does not run on this CPU (needs AVX512-BF16 or AMX)")
    engine = args.engine or b_mod.prefill_attention_engines()[0]
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    scale = DIM**-0.5
    print(f"engine {engine}, {args.threads} thread(s), {'thread CPU' if args.threads == 1 else 'wall'} time, "
          f"medians of {args.repeats}")
    print("| case | A ms | B ms | B / A time |")
    print("|---|---|---|---|")
    for case in args.cases.split(","):
        queries, keys = rows_of(case)
        q, k, v, ql, kl = inputs(queries, keys, gen)
        for dtype in (torch.bfloat16, torch.float32):
            x = (q.to(dtype), k.to(dtype), v.to(dtype), ql, kl, scale, False, engine)
            if not torch.equal(a_mod.prefill_attention(*x), b_mod.prefill_attention(*x)):
                raise SystemExit(f"{case}: A and B differ ({dtype} inputs)")
        x = (q, k, v, ql, kl, scale, False, engine)
        flops = sum(4 * DIM * HEADS * (c - t + 1 + c) * t / 2 for t, c in zip(queries, keys))
        calls = max(1, int(2e8 / flops))
        times: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.repeats):
            for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                op = (a_mod if side == "A" else b_mod).prefill_attention
                start = clock()
                for _ in range(calls):
                    op(*x)
                times[side].append((clock() - start) / calls * 1e3)
        a, b = statistics.median(times["A"]), statistics.median(times["B"])
        print(f"| {case} | {a:.2f} | {b:.2f} | {b / a:.3f} |", flush=True)


if __name__ == "__main__":
    main()
