"""The float path's GEMMs on this CPU: SmolLM2's linear shapes through each library/layout, side by side.

    PYTHONPATH=$PWD .venv/bin/python bench/gemm_micro.py [--tokens 1,32,512] [--repeats 5] [--layers qkv,down]

For every shape [tokens, 576] x [576, N] of the model (qkv 960, o 576, gate_up 3072, down 1536->576,
lm_head 49152) it times, interleaved in one run (medians of `--repeats` rounds):
  linear      F.linear(x, W) with W [N, K] as nn.Linear keeps it (float32; torch sends it to MKL sgemm)
  wt          x @ W.T materialized as a contiguous [K, N] (the other weight layout)
  mkldnn      oneDNN float32 with the weight packed once (torch.utils.mkldnn.to_mkldnn), when built in
  bf16        F.linear in bfloat16 (oneDNN; AMX / AVX512-BF16 where the CPU has them)
  q4_int8     the weight as GGUF Q4_1 through our cpu_block int8 kernel (activations quantized per call)
  q4_dense    the same Q4_1 weight dequantized per call into bf16, then the bf16 F.linear (the backend's
              path from DENSE_MIN_ROWS rows on AMX CPUs: glmserve/quant/cpu_backend.py)
and prints GFLOP/s with each variant's ratio to `linear`.

    PYTHONPATH=$PWD .venv/bin/python bench/gemm_micro.py --dense [--tokens 16,32,64,128,512,2048] [--layers ...]

compares instead the paths of a Q4_1 weight (the embedded model's format) at prefill-sized batches, bf16
activations in and bf16 out, on CPUs with AMX or AVX512-BF16 (DENSE_COLUMNS), with each variant's ratio to
`per_call`:
  per_call    the weight dequantized per call into a bf16 scratch, then F.linear (oneDNN reorders it per call)
  f32         F.linear in float32 on the dequantized weight (float32 activations; MKL / oneDNN sgemm)
  bf16        F.linear on a dense bf16 copy of the same weight, made once (torch's bf16 matmul: oneDNN, AMX)
  prepacked   oneDNN's prepacked bf16 weight (torch.ops.mkldnn._linear_pointwise), made once and kept
  amx         our AMX bf16 GEMM reading the packed weight (kernel amx_bf16_linear; AMX CPUs)
  amx_a       with --a-source FILE: amx_bf16_linear of another quant_matmul.cpp (e.g. main's), built under a name
              of its own (bench/ab_quant_kernels.py build_a), for an A/B of the kernel in one process
  amx+silu    gate_up only: amx, then silu_and_mul on its bf16 product (the MLP before the fused store)
  amx_swiglu  gate_up only: amx_bf16_linear_swiglu, SwiGLU in the GEMM's store (the same floats as amx+silu)
  avx512bf16  our vdpbf16ps GEMM reading the packed weight (kernel avx512_bf16_linear; CPUs with AVX512-BF16)
  int8        our int8 kernel (quant_linear: AMX int8 tiles from 16 rows, else VNNI; float32 activations,
              quantized per call)
Threads: GLMSERVE_BENCH_THREADS (1 by default); with more than one, use the wall clock (--clock cpu sums the
threads' CPU time). AMX's peak is 1,024 bf16 FLOP per cycle and core (one 16x16x32 tdpbf16ps per 16 cycles):
bench/amx_peak.cpp measures what this machine's tile loop reaches.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
import torch.utils.mkldnn
import workloads as wl
from ab_quant_kernels import build_a

from glmserve import kernels
from glmserve.quant.cpu_backend import CpuBlockBackend, PackedWeight
from glmserve.quant.quantize import quantize
from glmserve.quant.spec import QuantSpec

Q4_1 = QuantSpec(4, symmetric=False, strategy="group", group_size=32, gguf_type="Q4_1")
COLUMNS = ("wt", "mkldnn", "bf16", "q4_int8", "q4_dense")
DENSE_COLUMNS = ("f32", "bf16", "prepacked", "amx", "amx_a", "amx+silu", "amx_swiglu", "avx512bf16", "int8")

HIDDEN = 576
SHAPES = {"qkv": (HIDDEN, 960), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 3072), "down": (1536, HIDDEN),
          "lm_head": (HIDDEN, 49152)}


def per_call_s(fn: Callable[[], object], min_s: float = 0.05, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per call, calling `fn` until `min_s` has passed on `clock`."""
    fn()
    calls, start = 0, clock()
    while clock() - start < min_s:
        fn()
        calls += 1
    return (clock() - start) / calls


def variants(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    wt = w.t().contiguous()
    xb, wb = x.bfloat16(), w.bfloat16()
    out = {
        "linear": lambda: F.linear(x, w),
        "wt": lambda: x @ wt,
        "bf16": lambda: F.linear(xb, wb),
    }
    if torch.backends.mkldnn.is_available():
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data.copy_(w)
        packed = torch.utils.mkldnn.to_mkldnn(linear)  # oneDNN-packed weight; dense in, dense out
        out["mkldnn"] = lambda: packed(x)
    cpu = torch.device("cpu")
    q4 = CpuBlockBackend().prepare(quantize(w, Q4_1), None, cpu)
    out["q4_int8"] = lambda: q4.linear(x, False, q4.codes, q4.scales, q4.mins, True, q4.out_features)
    if kernels.op("dequantize_packed", cpu, torch.float32) is not None:
        out["q4_dense"] = per_call_dense(q4, x.bfloat16())
    return out


def per_call_dense(p: PackedWeight, xb: torch.Tensor) -> Callable[[], torch.Tensor]:
    """xb (bf16) times the packed weight dequantized whole into a bf16 scratch at every call, then F.linear (the
    dense path before our AMX GEMM; GLMSERVE_AMX_GEMM=0)."""
    dequantized = kernels.op("dequantize_packed", torch.device("cpu"), torch.float32)
    scratch = torch.empty(p.out_features * p.codes.shape[1] * 32, dtype=torch.bfloat16)
    return lambda: F.linear(xb, dequantized(p.codes, p.scales, p.mins, p.u4, p.out_features, True, scratch)
                            [:, :p.in_features])


def dense_variants(x: torch.Tensor, w: torch.Tensor, a_module: ModuleType | None = None,
                   gated: bool = False) -> dict[str, Callable[[], object]]:
    """The Q4_1 weight's paths for prefill-sized batches (the module docstring's --dense columns); amx_a where
    `a_module` (another build of quant_matmul) is given, amx+silu and amx_swiglu where the weight is a merged
    gate-up (`gated`)."""
    cpu = torch.device("cpu")
    p = CpuBlockBackend().prepare(quantize(w, Q4_1), None, cpu)
    xb = x.bfloat16()
    w16 = CpuBlockBackend().dequantize_rows(p, torch.arange(p.out_features), torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w16, 512)
    w32 = w16.float()
    out = {
        "per_call": per_call_dense(p, xb),
        "f32": lambda: F.linear(x, w32),
        "bf16": lambda: F.linear(xb, w16),
        "prepacked": lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], ""),
        "int8": lambda: p.linear(x, False, p.codes, p.scales, p.mins, True, p.out_features),
    }
    if kernels.amx_bf16():
        amx = kernels.op("amx_bf16_linear", cpu, torch.float32)
        out["amx"] = lambda: amx(xb, p.codes, p.scales, p.mins, p.u4, p.out_features)
        if gated:
            silu = kernels.op("silu_and_mul", cpu, torch.bfloat16)
            swiglu = kernels.op("amx_bf16_linear_swiglu", cpu, torch.float32)
            out["amx+silu"] = lambda: silu(amx(xb, p.codes, p.scales, p.mins, p.u4, p.out_features))
            out["amx_swiglu"] = lambda: swiglu(xb, p.codes, p.scales, p.mins, p.u4, p.out_features)
    if kernels.avx512_bf16():
        ours = kernels.op("avx512_bf16_linear", cpu, torch.float32)
        out["avx512bf16"] = lambda: ours(xb, p.codes, p.scales, p.mins, p.u4, p.out_features)
    if a_module is not None:
        out["amx_a"] = lambda: a_module.amx_bf16_linear(xb, p.codes, p.scales, p.mins, p.u4, p.out_features)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,32,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: time.perf_counter; cpu: time.process_time (this process's CPU time: on a shared "
                             "machine, time slices lost to other processes do not count)")
    parser.add_argument("--dense", action="store_true", help="Q4_1 prefill paths on AMX / AVX512-BF16 (DENSE_COLUMNS)")
    parser.add_argument("--a-source", type=Path, help="with --dense: column amx_a, this quant_matmul.cpp's kernel")
    args = parser.parse_args()
    if args.dense and not (kernels.amx_bf16() or kernels.avx512_bf16()):
        parser.error("--dense needs a CPU with AMX-BF16 or AVX512-BF16 and the avx512 kernels")
    if args.a_source and not args.dense:
        parser.error("--a-source goes with --dense")
    a_module = build_a(args.a_source) if args.a_source else None
    make, base, columns = ((functools.partial(dense_variants, a_module=a_module), "per_call", DENSE_COLUMNS)
                           if args.dense else (variants, "linear", COLUMNS))
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(wl.THREADS)
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, {args.clock} clock; GFLOP/s, median of {args.repeats} interleaved "
          "rounds; "
          f"ratio = variant / {base}; load average {os.getloadavg()}")
    print(f"| tokens | layer | {base} | " + " | ".join(columns) + " |")
    print("|---" * (3 + len(columns)) + "|")
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            for name in args.layers.split(","):
                k, n = SHAPES[name]
                x, w = torch.randn(tokens, k), torch.randn(n, k) / k**0.5
                fns = make(x, w, gated=name == "gate_up") if args.dense else make(x, w)
                times: dict[str, list[float]] = {v: [] for v in fns}
                for _ in range(args.repeats):
                    for v, fn in fns.items():
                        times[v].append(per_call_s(fn, clock=clock))
                flops = 2 * tokens * k * n
                rate = {v: flops / statistics.median(t) / 1e9 for v, t in times.items()}
                cells = [f"{rate[base]:.1f}"] + [
                    f"{rate[v]:.1f} ({rate[v] / rate[base]:.2f}×)" if v in rate else "—"
                    for v in columns
                ]
                print(f"| {tokens} | {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
