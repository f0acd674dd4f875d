"""A/B of two versions of the paged decode kernel (csrc/paged_decode.cpp) in one process: A compiled from the given
source under a module name of its own (ab_quant_kernels.build_a), B this checkout's build of the active variant
(avx512, or avx2 without AVX-512), called in turn on the same queries and the same pools, per KV format, so that
machine load hits both alike. Batch `--batch` sequences of each context, SmolLM2's attention shape (9 query heads,
3 kv heads, head_dim 64), slots in shuffled blocks of `--block` (16; 0: each sequence's slots in one run); the calls
cycle over layer pools of at least `--pool-mb` MB of float32 K/V (a quarter of that in int8 pools), so that the keys
come from memory as in an engine step. `--mixed`: each sequence's length drawn uniformly from [context / 10, context] (a
server's batch of mixed lengths; the bench's 64 requests of 100..1,000 tokens); `--threads`: intra-op threads. Prints
ms per call (medians of `--repeats`) and B's speed-up over A.

    git show main:glmserve/kernels/csrc/paged_decode.cpp > /tmp/pd_main.cpp
    .venv/bin/python bench/paged_decode_ab.py /tmp/pd_main.cpp [--contexts 160,1024,4096] [--formats float32,bfloat16]
        [--batch 32] [--mixed] [--threads 1]

(Loading two built .so files of one kernel side by side does not work: the second load returns the first module.)
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
from glmserve.kv.kv_format import kv_format, store

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def decode_case(context: int, batch: int, pool_mb: int, gen: torch.Generator, mixed: bool = False,
                block: int = BLOCK):
    """Random q [batch, HEADS, DIM], k, v [slots, KV_HEADS, DIM], each sequence's `context` slots (shuffled blocks
    of `block`; 0: one contiguous run per sequence), lengths (`context`, or with `mixed` uniform in [context / 10,
    context]), and how many layer pools make at least `pool_mb` MB of float32 K/V."""
    run = block or context
    slots_per_layer = batch * -(-context // run) * run
    layers = max(1, -(-(pool_mb << 20) // (2 * KV_HEADS * slots_per_layer * DIM * 4)))
    k, v = (torch.randn(slots_per_layer, KV_HEADS, DIM, generator=gen) for _ in range(2))
    q = torch.randn(batch, HEADS, DIM, generator=gen)
    blocks = torch.randperm(slots_per_layer // run, generator=gen) if block else torch.arange(batch)
    slots = (blocks[:, None] * run + torch.arange(run)).reshape(batch, -1)[:, :context].contiguous()
    lengths = (torch.randint(max(1, context // 10), context + 1, (batch,), generator=gen) if mixed
               else torch.full((batch,), context))
    return q, k, v, slots, lengths, layers


def layer_pools(name: str, k: torch.Tensor, v: torch.Tensor, layers: int) -> list[torch.Tensor]:
    """`layers` pools [2, KV_HEADS, slots, W] holding k and v in KV format `name`."""
    fmt = kv_format(name)
    first = torch.empty(2, KV_HEADS, k.shape[0], fmt.row_width(DIM), dtype=fmt.storage)
    store(first[0], torch.arange(k.shape[0]), k)
    store(first[1], torch.arange(k.shape[0]), v)
    return [first] + [first.clone() for _ in range(layers - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a_source", type=Path, help="A: a paged_decode.cpp (e.g. main's)")
    parser.add_argument("--contexts", default="160,1024,4096")
    parser.add_argument("--formats", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--pool-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--mixed", action="store_true", help="lengths uniform in [context / 10, context]")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--block", type=int, default=BLOCK, help="slots per shuffled block (0: one run per sequence)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = {"A": build_a(args.a_source).paged_decode, "B": load("paged_decode", active_isa()).paged_decode}
    gen = torch.Generator().manual_seed(0)
    print(f"batch {args.batch}{' of mixed lengths' if args.mixed else ''}, {HEADS} heads / {KV_HEADS} kv heads / D "
          f"{DIM}, {args.threads} thread(s); ms per call (median of {args.repeats})")
    print("| context | KV format | A ms | B ms | B speed-up |")
    print("|---|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        q, k, v, slots, lengths, layers = decode_case(context, args.batch, args.pool_mb, gen, args.mixed,
                                                              args.block)
        for name in args.formats.split(","):
            pools = layer_pools(name, k, v, layers)
            first = pools[0]
            outs = {side: op(q, first[0], first[1], slots, lengths, DIM**-0.5) for side, op in ops.items()}
            torch.testing.assert_close(outs["B"], outs["A"], rtol=2e-5, atol=2e-5)
            times: dict[str, list[float]] = {"A": [], "B": []}
            n = max(args.calls, layers)
            for r in range(args.repeats):
                for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    start = time.perf_counter()
                    for i in range(n):
                        pool = pools[i % layers]
                        ops[side](q, pool[0], pool[1], slots, lengths, DIM**-0.5)
                    times[side].append((time.perf_counter() - start) / n * 1e3)
            a, b = statistics.median(times["A"]), statistics.median(times["B"])
            print(f"| {context} | {name} | {a:.3f} | {b:.3f} | {a / b:.2f}x |", flush=True)
            del pools


if __name__ == "__main__":
    main()
