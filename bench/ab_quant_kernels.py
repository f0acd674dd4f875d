"""A/B of two versions of the int8 block kernel (kernels/csrc/quant_matmul.cpp): `quant_matmul` on SmolLM2-135M's
linear shapes and its lm_head at decode batch sizes, both builds loaded in one process and timed interleaved
(A, B and, on AMX CPUs, B's VNNI tiles in turn, the order rotating per repeat) on the same packed weights and the
same quantized activations. Checks first that every output of both builds, AMX and VNNI tiles, is the same floats.

    mkdir -p /tmp/qm && git show main:glmserve/kernels/csrc/quant_matmul.cpp > /tmp/qm/qm_main.cpp
    git show main:glmserve/kernels/csrc/amx.h > /tmp/qm/amx.h   # the header it includes, beside it
    .venv/bin/python bench/ab_quant_kernels.py /tmp/qm/qm_main.cpp [--batches 8 16 32 64] [--threads 1] [--repeats 9]

A is compiled from the given source (the active variant: avx512, or avx2 on a CPU without AVX-512; the kernels' own
flags) under its own module name, in a build directory named by its hash; B is this checkout's build of that variant.
Weights: random, round-to-nearest int4 group 32 with zero points (GGUF Q4_1's math and bytes: u4 codes, fp16 d and m)
and int8 group 32 (Q8_0's); the lm_head is Q8_0, as the default model's tied embedding. Prints per case the median
microseconds per call of each (wall time, and the calling thread's CPU time, which a loaded machine inflates less),
GMAC/s (batch x out x in per second, from the CPU time) and B / A time, with the load average before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_quant_kernels import SHAPES, seconds_per_call

from glmserve import kernels
from glmserve.kernels.build import BASE_CFLAGS, extensions_root, load
from glmserve.kernels.isa import BY_NAME, active_isa
from glmserve.quant.cpu_backend import CpuBlockBackend
from glmserve.quant.quantize import quantize
from glmserve.quant.spec import QuantSpec

CPU = torch.device("cpu")
FORMATS = {
    "Q4_1-like": QuantSpec(4, symmetric=False, strategy="group", group_size=32),
    "Q8_0-like": QuantSpec(8, strategy="group", group_size=32),
}


def build_a(source: Path):
    """The active variant (glmserve.kernels.isa.active_isa: avx512, or avx2 on CPUs without AVX-512) of a kernel
    source compiled under a module name of its own (glmserve_ab_<stem>_<variant>_<hash>): an extension loaded under
    the name of one already loaded comes back as that first module, so two builds of one kernel can only sit side by
    side under different names."""
    from torch.utils.cpp_extension import load

    digest = hashlib.sha1(source.read_bytes()).hexdigest()[:8]
    isa = active_isa()
    name = f"glmserve_ab_{source.stem}_{isa}_{digest}"
    directory = extensions_root() / name
    directory.mkdir(parents=True, exist_ok=True)
    # the headers come from this checkout's csrc (a source elsewhere, e.g. main's in /tmp, includes them too)
    headers = Path(__file__).resolve().parents[1] / "glmserve" / "kernels" / "csrc"
    return load(name=name, sources=[str(source)], extra_cflags=[*BASE_CFLAGS, *BY_NAME[isa].cflags],
                extra_include_paths=[str(headers)], build_directory=str(directory))


def cpu_and_wall(fn, *args, seconds: float = 0.005) -> tuple[float, float]:
    """Seconds per call of fn(*args) in a loop of about `seconds`: (the calling thread's CPU time, wall time)."""
    calls = max(1, int(seconds / seconds_per_call(fn, *args, repeats=1)))
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn(*args)
    return (time.thread_time() - cpu) / calls, (time.perf_counter() - start) / calls


def time_interleaved(calls: dict[str, Callable], *args: object,
                     repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median microseconds per call of each of `calls` on `args`, timed in turn, the order rotating per repeat: (the
    calling thread's CPU time, wall time) by name."""
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    wall: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for r in range(repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:
            c, w = cpu_and_wall(calls[k], *args)
            cpu[k].append(c)
            wall[k].append(w)
    return ({k: statistics.median(v) * 1e6 for k, v in cpu.items()},
            {k: statistics.median(v) * 1e6 for k, v in wall.items()})


def parse_ab_args(description: str, kernel: str, batches: list[int], shapes: list[str],
                  formats: list[str]) -> argparse.Namespace:
    """The A/B scripts' command line: A's source of `kernel` (a csrc file name) and the cases to time."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("a_source", type=Path, help=f"A: a {kernel}.cpp (e.g. main's)")
    parser.add_argument("--batches", type=int, nargs="+", default=batches)
    parser.add_argument("--shapes", nargs="+", default=shapes, choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=formats, choices=formats)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    return parser.parse_args()


def build_ab(kernel: str, args: argparse.Namespace) -> tuple[object, object]:
    """A (built from args.a_source) and B (this checkout's build) of `kernel`, with torch on args.threads threads;
    prints the load average before the timing starts."""
    torch.set_num_threads(args.threads)
    a, b = build_a(args.a_source), load(kernel, active_isa())
    print("loadavg before:", Path("/proc/loadavg").read_text().strip())
    return a, b


def main() -> None:
    args = parse_ab_args(__doc__.splitlines()[0], "quant_matmul", [8, 16, 32, 64], list(SHAPES), list(FORMATS))
    a, b = build_ab("quant_matmul", args)
    amx = a.set_amx(True) and b.set_amx(True)  # without AMX both run their VNNI (or AVX2) tiles: A and B only
    quantize_acts = kernels.op("quantize_activations", CPU, torch.float32)
    backend = CpuBlockBackend()
    print(f"AMX int8 tiles: {amx}; threads {args.threads}, medians of {args.repeats}; "
          "us: CPU time of the calling thread (wall)")
    print("| shape | format | M | A us | B us | B VNNI us | A GMAC/s | B GMAC/s | B VNNI GMAC/s | B / A time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, fmt in itertools.product(args.shapes, args.formats):
        out, inp = SHAPES[shape]
        if shape.startswith("lm_head") and fmt != "Q8_0-like":
            continue  # the default model's tied embedding is Q8_0
        w = torch.randn(out, inp, generator=torch.Generator().manual_seed(out + inp)) * 0.02
        p = backend.prepare(quantize(w, FORMATS[fmt]), None, CPU)
        weights = (p.codes, p.scales, p.mins, p.u4, p.out_features)
        for m in args.batches:
            acts = quantize_acts(torch.randn(m, inp, generator=torch.Generator().manual_seed(m)), False)

            def vnni(*xs):
                b.set_amx(False)
                try:
                    return b.quant_matmul(*xs)
                finally:
                    b.set_amx(True)

            calls = {"A": a.quant_matmul, "B": b.quant_matmul, **({"B VNNI": vnni} if amx else {})}
            outs = {k: f(*acts, *weights) for k, f in calls.items()}
            a.set_amx(False)
            outs["A VNNI"] = a.quant_matmul(*acts, *weights)
            a.set_amx(True)
            for k, v in outs.items():
                assert torch.equal(v, outs["A VNNI"]), f"{shape} {fmt} M={m}: {k} differs from A's VNNI tiles"
            us, us_wall = time_interleaved(calls, *acts, *weights, repeats=args.repeats)
            gmacs = {k: m * out * inp / t / 1e3 for k, t in us.items()}
            cells = " | ".join(f"{us[k]:.0f} ({us_wall[k]:.0f})" if k in us else "–" for k in ("A", "B", "B VNNI"))
            vnni_gmacs = f"{gmacs['B VNNI']:.0f}" if amx else "–"
            print(f"| {shape} | {fmt} | {m} | {cells} | {gmacs['A']:.0f} | {gmacs['B']:.0f} | {vnni_gmacs} | "
                  f"{us['B'] / us['A']:.2f} |", flush=True)
    print("loadavg after:", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
