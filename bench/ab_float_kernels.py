"""A/B of two versions of the FP8 / NVFP4 kernel (kernels/csrc/float_quant_matmul.cpp): `float_quant_linear` on
SmolLM2-135M's linear shapes at decode and prefill batch sizes, both builds loaded in one process and timed
interleaved on the same packed weights and activations (the order alternating per repeat).

    mkdir -p /tmp/fq && git show main:glmserve/kernels/csrc/float_quant_matmul.cpp > /tmp/fq/fq_main.cpp
    .venv/bin/python bench/ab_float_kernels.py /tmp/fq/fq_main.cpp [--batches 1 2 4 32] [--threads 1] [--repeats 9]

A is compiled from the given source (the active variant, with the kernels' own flags) under a module name of its
own (ab_quant_kernels.build_a); B is this checkout's build of that variant. The two may sum in another order, so
their outputs are checked to agree within 1e-5 of the rows' scale, not bit for bit. Formats: FP8 E4M3 per channel
with the fp8 scheme's per-token E4M3 activations (the seeds' recipe's attention), FP8 per channel with float
activations, FP8 128x128 blocks, NVFP4 (the recipe's FFN). Prints per case the median microseconds per call (the
calling thread's CPU time, and wall), GMAC/s from the CPU time, and B / A time.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from ab_quant_kernels import build_ab, parse_ab_args, time_interleaved
from bench_quant_kernels import SHAPES

from glmserve.kernels.isa import active_isa
from glmserve.quant.cpu_float_backend import CpuFloatBlockBackend
from glmserve.quant.quantize import quantize
from glmserve.quant.schemes import SCHEMES
from glmserve.quant.spec import QuantSpec

CPU = torch.device("cpu")
FORMATS = {  # name -> (weight spec, activation spec)
    "fp8": (SCHEMES["fp8"].weight, SCHEMES["fp8"].activations),
    "fp8-a16": (SCHEMES["fp8-a16"].weight, None),
    "fp8-block": (QuantSpec(8, type="float", strategy="block", block_structure=(128, 128)), None),
    "nvfp4": (SCHEMES["nvfp4"].weight, None),
}


def main() -> None:
    args = parse_ab_args(__doc__.splitlines()[0], "float_quant_matmul", [1, 2, 4, 32],
                         [s for s in SHAPES if not s.startswith("lm_head")], list(FORMATS))
    a, b = build_ab("float_quant_matmul", args)
    backend = CpuFloatBlockBackend()
    print(f"variant {active_isa()}, threads {args.threads}, medians of {args.repeats}; "
          "us: CPU time of the calling thread (wall)")
    print("| shape | format | M | A us | B us | A GMAC/s | B GMAC/s | B / A time |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, fmt in itertools.product(args.shapes, args.formats):
        out, inp = SHAPES[shape]
        spec, acts = FORMATS[fmt]
        w = torch.randn(out, inp, generator=torch.Generator().manual_seed(out + inp)) * 0.02
        p = backend.prepare(quantize(w, spec), acts, CPU)
        weights = (p.fp8_tokens, p.codes, p.scales, p.fp4, p.group, p.factor, p.post, p.out_features, p.columns,
                   p.float_part)
        for m in args.batches:
            x = torch.randn(m, inp, generator=torch.Generator().manual_seed(m))
            calls = {"A": a.float_quant_linear, "B": b.float_quant_linear}
            ya, yb = (f(x, *weights) for f in calls.values())
            assert torch.allclose(ya, yb, rtol=1e-5, atol=1e-5 * float(ya.abs().max())), f"{shape} {fmt} M={m}"
            us, us_wall = time_interleaved(calls, x, *weights, repeats=args.repeats)
            gmacs = {k: m * out * inp / t / 1e3 for k, t in us.items()}
            cells = " | ".join(f"{us[k]:.0f} ({us_wall[k]:.0f})" for k in calls)
            ratio = us["B"] / us["A"]
            print(f"| {shape} | {fmt} | {m} | {cells} | {gmacs['A']:.1f} | {gmacs['B']:.1f} | {ratio:.2f} |",
                  flush=True)
    print("loadavg after:", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
