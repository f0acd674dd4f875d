"""A quantized model's float lm_head: F.linear on the float32 weight (MKL's sgemv / sgemm, what the engine ran before)
against HalfLinear on the same values kept as bf16 (layers/half_linear.py, the float kernel's `half_linear`), at
SmolLM2-135M's head shape (49,152 x 576) and decode batch sizes, timed interleaved in one process on every
instruction-set variant this CPU runs (GLMSERVE_CPU_ISA), the weight read from memory as in a decode step (113 MB /
57 MB: far beyond the caches). Prints per case the median microseconds of each (the calling thread's CPU time),
the weight bytes per second it reads and HalfLinear / F.linear time.

    GLMSERVE_BENCH_THREADS=1 .venv/bin/python bench/bench_half_head.py [--batches 1 8 32] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from ab_quant_kernels import time_interleaved

from glmserve import kernels
from glmserve.kernels.isa import available_isas
from glmserve.layers.half_linear import HalfLinear

CPU = torch.device("cpu")
VOCAB, HIDDEN = 49152, 576


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("GLMSERVE_BENCH_THREADS", "1")))
    weight = (torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16().float()
    print(f"threads {torch.get_num_threads()}, medians of {args.repeats}; us: CPU time of the calling thread")
    print("| variant | M | F.linear f32 us | HalfLinear bf16 us | f32 GB/s | bf16 GB/s | half / f32 time |")
    print("|---|---|---|---|---|---|---|")
    for isa in available_isas():
        os.environ["GLMSERVE_CPU_ISA"] = isa
        head = HalfLinear(weight, torch.bfloat16, kernels.op("half_linear", CPU, torch.float32))
        for m in args.batches:
            x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(m))
            calls = {"f32": lambda x: F.linear(x, weight), "half": head}
            us, _ = time_interleaved(calls, x, repeats=args.repeats)
            rates = {k: (weight.numel() * (4 if k == "f32" else 2)) / t / 1e3 for k, t in us.items()}
            print(f"| {isa} | {m} | {us['f32']:.0f} | {us['half']:.0f} | {rates['f32']:.1f} | {rates['half']:.1f} | "
                  f"{us['half'] / us['f32']:.2f} |", flush=True)
    print("loadavg after:", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
