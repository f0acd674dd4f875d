"""Quantized CPU kernels (quant/cpu_backend.py, quant/cpu_float_backend.py) vs float32 F.linear vs the reference
backend, side by side in one run, on SmolLM2-135M's linear shapes (QKV merged, o_proj, gate+up merged,
down_proj, lm_head); each format on the backend the registry picks for it.

Random weights (speed does not depend on the values), quantized round-to-nearest: int4 group 32 with zero
points (the math and bytes of GGUF Q4_1), int4 group 32 symmetric (Q4_0), int8 group 32 (Q8_0), W8A8
(per-channel weights, per-token activations); FP8 E4M3 per channel and in 128x128 blocks, both with the fp8
schemes' per-token fp8 activations, and NVFP4 (E2M1, E4M3 scale per 16, fp32 global). Per case the median of
--repeats timings, each of enough calls to last ~5 ms; reported as ratios (float32 time / kernel time,
reference time / kernel time) and effective GB/s of weight bytes read (the packed bytes for the kernel, 4 bytes
per weight for float32). The reference (dequantize per call) is timed on the layer shapes only: at the lm_head
shape one call takes seconds.

    TORCH_EXTENSIONS_DIR=/tmp/ext-NAME python bench/bench_quant_kernels.py [--threads 1 2] [--batches 1 8 32 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from glmserve import kernels
from glmserve.quant import backend as registry
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import ReferenceBackend
from glmserve.quant.schemes import SCHEMES
from glmserve.quant.spec import QuantSpec

SHAPES = {  # name -> (out, in) of SmolLM2-135M (hidden 576, 9 + 3 + 3 heads of 64, intermediate 1536)
    "qkv 576->960": (960, 576),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
}
REFERENCE_MAX = 4 << 20  # weights up to which the reference backend is timed
TOKEN = QuantSpec(8, strategy="token", dynamic=True)
FORMATS = {
    "Q4_1-like (int4 g32 asym)": (QuantSpec(4, symmetric=False, strategy="group", group_size=32), None),
    "Q4_0-like (int4 g32)": (QuantSpec(4, strategy="group", group_size=32), None),
    "Q8_0-like (int8 g32)": (QuantSpec(8, strategy="group", group_size=32), None),
    "W8A8 (int8 channel, token)": (QuantSpec(8, strategy="channel"), TOKEN),
    "FP8 (channel, fp8 token)": (SCHEMES["fp8"].weight, SCHEMES["fp8"].activations),
    "FP8 block 128x128 (fp8 token)": (SCHEMES["fp8-block"].weight, SCHEMES["fp8-block"].activations),
    "NVFP4 (E2M1, E4M3 per 16)": (SCHEMES["nvfp4"].weight, None),
}


def seconds_per_call(fn, *args, repeats: int, fastest: bool = False) -> float:
    """Median (or, `fastest`, the minimum) over `repeats` of the mean time of fn(*args) in a loop of ~5 ms."""
    fn(*args)
    start = time.perf_counter()
    fn(*args)
    once = time.perf_counter() - start
    calls = max(1, int(0.005 / max(once, 1e-7)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        times.append((time.perf_counter() - start) / calls)
    return min(times) if fastest else statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fastest", action="store_true",
                        help="the fastest repeat instead of the median (the least interrupted one on a loaded machine)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    cpu = torch.device("cpu")
    reference = ReferenceBackend()
    print(f"kernel variant: {kernels.active_isa()}; torch {torch.__version__}")
    print("| shape | batch | threads | format | weight MB | kernel us | float32 us | reference us | float32 / kernel "
          "| reference / kernel | kernel GB/s | float32 GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for shape in args.shapes:
        out, inp = SHAPES[shape]
        w = torch.randn(out, inp, generator=torch.Generator().manual_seed(out + inp)) * 0.02
        packed = {}
        for f, (s, a) in FORMATS.items():
            if f in args.formats:
                ours = registry.select(s, a, cpu)
                packed[f] = (ours, ours.prepare(quantize(w, s), a, cpu), reference.prepare(quantize(w, s), a, cpu))
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batches:
                x = torch.randn(batch, inp)
                t_float = seconds_per_call(F.linear, x, w, repeats=args.repeats, fastest=args.fastest)
                for fmt, (ours, p, ref) in packed.items():
                    t_ours = seconds_per_call(ours.apply, p, x, None, repeats=args.repeats, fastest=args.fastest)
                    t_ref = (seconds_per_call(reference.apply, ref, x, None, repeats=3) if out * inp <= REFERENCE_MAX
                             else float("nan"))
                    row = dict(shape=shape, batch=batch, threads=threads, format=fmt, backend=ours.name,
                               weight_mb=p.nbytes / 1e6,
                               kernel_us=t_ours * 1e6, float_us=t_float * 1e6, reference_us=t_ref * 1e6,
                               float_over_kernel=t_float / t_ours, reference_over_kernel=t_ref / t_ours,
                               kernel_gbps=p.nbytes / t_ours / 1e9, float_gbps=w.numel() * 4 / t_float / 1e9)
                    rows.append(row)
                    cells = [shape, batch, threads, fmt, f"{row['weight_mb']:.2f}", f"{row['kernel_us']:.0f}",
                             f"{row['float_us']:.0f}", f"{row['reference_us']:.0f}",
                             f"{row['float_over_kernel']:.2f}x", f"{row['reference_over_kernel']:.1f}x",
                             f"{row['kernel_gbps']:.1f}", f"{row['float_gbps']:.1f}"]
                    cells = [str(c).replace("nanx", "-").replace("nan", "-") for c in cells]
                    print("| " + " | ".join(cells) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
