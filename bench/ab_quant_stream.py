"""A/B of two versions of the int8 block kernel (kernels/csrc/quant_matmul.cpp) with its weights coming from DRAM, as
in a decode step: `quant_matmul` over many distinct Q4_1-like weights of SmolLM2-135M's layer shapes (qkv, o, gate-up,
down; `--copies` of each set, 53 MB at 24: more than the L3 caches of the 2-vCPU hosts), A and B alternating per
round over the same packed weights and quantized activations. bench/ab_quant_kernels.py times one shape over and
over, whose weights then stay in the caches; this one measures what reading them costs. Checks first that both
builds give the same floats. Prints per batch size the median time of a sweep over all the weights, the weight bytes
read per second, and A / B time.

    git show main:glmserve/kernels/csrc/quant_matmul.cpp > /tmp/qm/qm_main.cpp   # with its headers beside it
    GLMSERVE_BENCH_THREADS=1 taskset -c 0 .venv/bin/python bench/ab_quant_stream.py /tmp/qm/qm_main.cpp \
        [--batches 1 4 32 512] [--copies 24] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from ab_quant_kernels import CPU, FORMATS, build_a

from glmserve import kernels
from glmserve.kernels.build import load
from glmserve.kernels.isa import active_isa
from glmserve.quant.cpu_backend import CpuBlockBackend
from glmserve.quant.quantize import quantize

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in): qkv, o, gate-up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a_source", type=Path, help="A: a quant_matmul.cpp (e.g. main's)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 32, 512])
    parser.add_argument("--copies", type=int, default=24, help="distinct weights per layer shape")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("GLMSERVE_BENCH_THREADS", "1")))
    builds = {"A": build_a(args.a_source), "B": load("quant_matmul", active_isa())}
    backend = CpuBlockBackend()
    weights = []
    for i, (out, inp) in enumerate(LAYER_SHAPES * args.copies):
        w = torch.randn(out, inp, generator=torch.Generator().manual_seed(i)) * 0.02
        p = backend.prepare(quantize(w, FORMATS["Q4_1-like"]), None, CPU)
        weights.append(((p.codes, p.scales, p.mins, p.u4, p.out_features), inp))
    total = sum(p[0].numel() + 2 * (p[1].numel() + p[2].numel()) for p, _ in weights)
    quantize_acts = kernels.op("quantize_activations", CPU, torch.float32)
    print(f"loadavg before: {Path('/proc/loadavg').read_text().strip()}; {len(weights)} weights, {total / 1e6:.1f} MB, "
          f"threads {torch.get_num_threads()}, medians of {args.rounds} rounds")
    print("| M | A ms | B ms | A GB/s | B GB/s | A / B time |")
    print("|---|---|---|---|---|---|")
    for m in args.batches:
        acts = {inp: quantize_acts(torch.randn(m, inp, generator=torch.Generator().manual_seed(m)), False)
                for inp in {inp for _, inp in weights}}
        for p, inp in weights:
            assert torch.equal(builds["A"].quant_matmul(*acts[inp], *p), builds["B"].quant_matmul(*acts[inp], *p))
        times: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                start = time.perf_counter()
                for p, inp in weights:
                    builds[side].quant_matmul(*acts[inp], *p)
                times[side].append(time.perf_counter() - start)
        a, b = (statistics.median(times[s]) for s in ("A", "B"))
        print(f"| {m} | {a * 1e3:.2f} | {b * 1e3:.2f} | {total / a / 1e9:.1f} | {total / b / 1e9:.1f} | {a / b:.2f}x |",
              flush=True)
    print(f"loadavg after: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
