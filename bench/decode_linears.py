"""Where a decode batch's quantized linears spend their time, per SmolLM2-135M shape and batch size: the activation
quantization, the int8 kernel on already quantized activations, the whole int8 call (`quant_linear`), the backend's
`apply` (Python included) and, on AMX CPUs, the bf16 GEMM on the same packed weight (`amx_bf16_linear`, the path
`apply` takes from DENSE_MIN_ROWS rows); for the lm_head also the int8 call followed by the greedy sampler's max
over the logits (`first_max`), which reads what the kernel wrote.

    GLMSERVE_BENCH_THREADS=1 PYTHONPATH=$PWD taskset -c 0 .venv/bin/python bench/decode_linears.py \
        [--batches 16 32 48 64] [--repeats 5]

One thread; every case timed by the calling thread's CPU time (a loop of ~30 ms per sample), the cases of one
shape and batch interleaved, medians of `--repeats`. Weights: random, quantized round-to-nearest as the default
model's formats (Q4_1 math for the layers, Q8_0 for the tied lm_head). Prints microseconds per call and GMAC/s of the
int8 kernel, with the load average before and after.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from ab_quant_kernels import CPU, FORMATS, cpu_and_wall
from bench_quant_kernels import SHAPES

from glmserve.engine.sampler import first_max
from glmserve.kernels.build import load
from glmserve.quant.cpu_backend import CpuBlockBackend
from glmserve.quant.quantize import quantize

Q4_1, Q8_0 = FORMATS["Q4_1-like"], FORMATS["Q8_0-like"]


def cpu_us(fn: Callable[[], object]) -> float:
    """Microseconds of the calling thread's CPU time per call of fn, over a loop of ~30 ms."""
    return cpu_and_wall(fn, seconds=0.03)[0] * 1e6


def calls(kernel, backend: CpuBlockBackend, p, x: torch.Tensor, lm_head: bool) -> dict[str, Callable[[], object]]:
    """The timed cases for packed weight p and activations x (see the module docstring)."""
    weights = (p.codes, p.scales, p.mins, p.u4, p.out_features)
    acts = kernel.quantize_activations(x, False)
    cases = {
        "quantize": functools.partial(kernel.quantize_activations, x, False),
        "int8 kernel": functools.partial(kernel.quant_matmul, *acts, *weights),
        "quant_linear": functools.partial(kernel.quant_linear, x, False, *weights),
        "apply": functools.partial(backend.apply, p, x, None),
    }
    if p.gemm is not None:
        cases["bf16 GEMM"] = functools.partial(p.gemm, x, *weights)
    if lm_head:
        cases["lm_head + max"] = lambda: first_max(kernel.quant_linear(x, False, *weights))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 48, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernel = load("quant_matmul", "avx512")
    if kernel is None:
        raise SystemExit("needs the avx512 build of quant_matmul")
    amx = kernel.set_amx(True)
    backend = CpuBlockBackend()
    print("loadavg before:", Path("/proc/loadavg").read_text().strip())
    print(f"AMX int8 tiles: {amx}; us per call (CPU time, medians of {args.repeats}); GMAC/s of the int8 kernel")
    print("| shape | M | quantize | int8 kernel | quant_linear | apply | bf16 GEMM | lm_head + max | int8 GMAC/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        out, inp = SHAPES[shape]
        spec = Q8_0 if shape.startswith("lm_head") else Q4_1
        w = torch.randn(out, inp, generator=torch.Generator().manual_seed(out + inp)) * 0.02
        p = backend.prepare(quantize(w, spec), None, CPU)
        for m in args.batches:
            x = torch.randn(m, inp, generator=torch.Generator().manual_seed(m))
            cases = calls(kernel, backend, p, x, shape.startswith("lm_head"))
            samples: dict[str, list[float]] = {k: [] for k in cases}
            names = list(cases)
            for r in range(args.repeats):
                for k in names[r % len(names):] + names[:r % len(names)]:
                    samples[k].append(cpu_us(cases[k]))
            us = {k: statistics.median(v) for k, v in samples.items()}
            cells = " | ".join(f"{us[k]:.1f}" if k in us else "–" for k in
                               ("quantize", "int8 kernel", "quant_linear", "apply", "bf16 GEMM", "lm_head + max"))
            print(f"| {shape} | {m} | {cells} | {m * out * inp / us['int8 kernel'] / 1e3:.0f} |", flush=True)
    print("loadavg after:", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
