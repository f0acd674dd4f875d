"""A/B of two builds of the paged decode kernel (e.g. main's, compiled without -fopenmp, and one with it),
interleaved in one process at batch 32, at 1 and 2 torch intra-op threads.

    .venv/bin/python bench/bench_kernel_omp_ab.py A.so B.so [--context 1024] [--repeats 15]

Both libraries are glmserve_paged_decode_<isa>.so files from kernel build directories. Shapes follow the
embedded default model (SmolLM2-135M: 9 query heads, 3 kv heads, head size 64), a float32 cache. Prints the
median milliseconds per call of each build, B / A time ratios, and the load average before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch


def _import(path: str, tag: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[f"_bench_{tag}"] = module  # keep both loaded
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    builds = {"A": _import(args.a, "a"), "B": _import(args.b, "b")}
    batch, heads, kv_heads, dim = 32, 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, dim, generator=gen)
    k = torch.randn(kv_heads, batch * args.context, dim, generator=gen)
    v = torch.randn(kv_heads, batch * args.context, dim, generator=gen)
    slots = torch.arange(batch * args.context, dtype=torch.int64).view(batch, args.context)
    ctx = torch.full((batch,), args.context, dtype=torch.int64)
    ref = builds["A"].paged_decode(q, k, v, slots, ctx, dim ** -0.5)
    assert torch.allclose(builds["B"].paged_decode(q, k, v, slots, ctx, dim ** -0.5), ref, atol=1e-5, rtol=1e-5)
    print("loadavg before:", Path("/proc/loadavg").read_text().strip())
    for threads in (1, 2):
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.repeats):
            for tag in ("A", "B") if r % 2 == 0 else ("B", "A"):
                start = time.perf_counter()
                builds[tag].paged_decode(q, k, v, slots, ctx, dim ** -0.5)
                times[tag].append((time.perf_counter() - start) * 1e3)
        a, b = statistics.median(times["A"]), statistics.median(times["B"])
        print(f"threads {threads}: A {a:.2f} ms, B {b:.2f} ms, B/A time {b / a:.2f}")
    print("loadavg after:", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
