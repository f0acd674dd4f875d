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
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.mkldnn
import workloads as wl

from glmserve import kernels
from glmserve.quant.cpu_backend import CpuBlockBackend, dense_apply
from glmserve.quant.quantize import quantize
from glmserve.quant.spec import QuantSpec

Q4_1 = QuantSpec(4, symmetric=False, strategy="group", group_size=32, gguf_type="Q4_1")
COLUMNS = ("wt", "mkldnn", "bf16", "q4_int8", "q4_dense")

HIDDEN = 576
SHAPES = {"qkv": (HIDDEN, 960), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 3072), "down": (1536, HIDDEN),
          "lm_head": (HIDDEN, 49152)}


def per_call_s(fn: Callable[[], object], min_s: float = 0.05) -> float:
    """Seconds per call, calling `fn` until `min_s` has passed."""
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


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
        q4.dequantize = kernels.op("dequantize_packed", cpu, torch.float32)
        out["q4_dense"] = lambda: dense_apply(q4, x)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,32,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(wl.THREADS)
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}; GFLOP/s, median of {args.repeats} interleaved rounds; "
          "ratio = variant / linear")
    print("| tokens | layer | linear | " + " | ".join(COLUMNS) + " |")
    print("|---" * (3 + len(COLUMNS)) + "|")
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            for name in args.layers.split(","):
                k, n = SHAPES[name]
                x, w = torch.randn(tokens, k), torch.randn(n, k) / k**0.5
                fns = variants(x, w)
                times: dict[str, list[float]] = {v: [] for v in fns}
                for _ in range(args.repeats):
                    for v, fn in fns.items():
                        times[v].append(per_call_s(fn))
                flops = 2 * tokens * k * n
                rate = {v: flops / statistics.median(t) / 1e9 for v, t in times.items()}
                cells = [f"{rate['linear']:.1f}"] + [
                    f"{rate[v]:.1f} ({rate[v] / rate['linear']:.2f}×)" if v in rate else "—"
                    for v in COLUMNS
                ]
                print(f"| {tokens} | {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
