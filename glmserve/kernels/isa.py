"""The instruction-set variants our C++ kernels are compiled for (the same source, built once per variant
with its compiler flags), which of them this CPU runs, and which one is active (GLMSERVE_CPU_ISA forces one).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from glmserve.errors import InvalidRequestError

ISA_ENV = "GLMSERVE_CPU_ISA"


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: `cflags` enable the instruction sets that `cpu_flags` (as /proc/cpuinfo
    spells them) must all be present to run it."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]


VARIANTS: tuple[Variant, ...] = (  # best first
    Variant("avx512", ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                       "-mavx512vnni"),
            frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})),
    # also AMD EPYC without AVX-512; F16C (fp16 <-> float32, one instruction per 8) comes with every AVX2 CPU
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})),
    Variant("scalar", (), frozenset()),  # the compiler's baseline: any CPU
)
BY_NAME = {v.name: v for v in VARIANTS}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none: only the scalar variant runs)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@functools.cache
def available_isas() -> tuple[str, ...]:
    """The variants this CPU can run, best first (always ends with "scalar")."""
    return tuple(v.name for v in VARIANTS if v.cpu_flags <= cpu_flags())


def active_isa() -> str:
    """The variant the dispatcher uses: GLMSERVE_CPU_ISA when set (for tests and benchmarks), else the best
    one this CPU runs."""
    return _checked(os.environ.get(ISA_ENV) or available_isas()[0])


def amx_bf16() -> bool:
    """True on a CPU with AMX bf16 tiles while the avx512 variant is active: there oneDNN's bf16 matmuls (and
    so bf16 SDPA) run 2.5-5x faster than float32 from ~128 rows (bench/RESULTS.md, "Engine speed"), and the
    prefill-sized paths take bf16. GLMSERVE_CPU_ISA=avx2 or scalar stands for a CPU without AMX."""
    return "amx_bf16" in cpu_flags() and active_isa() == "avx512"


def avx512_bf16() -> bool:
    """True on a CPU with AVX512-BF16 (vdpbf16ps: bf16 pairs dotted into float32 lanes) while the avx512 variant is
    active: AMD Zen 4 and later, Intel Cooper Lake and Sapphire Rapids on. Kernels that use it compile those
    functions with a target attribute (the avx512 variant's flags do not include it) and check this at run time."""
    return "avx512_bf16" in cpu_flags() and active_isa() == "avx512"


@functools.cache
def _checked(name: str) -> str:
    if name not in BY_NAME:
        raise InvalidRequestError(f"{ISA_ENV}={name!r}: must be one of {', '.join(BY_NAME)}")
    missing = BY_NAME[name].cpu_flags - cpu_flags()
    if missing:
        raise InvalidRequestError(f"{ISA_ENV}={name}: this CPU lacks {', '.join(sorted(missing))} "
                                  f"(it runs {', '.join(available_isas())})")
    return name
