"""Compiled code, the ground floor: our C++ CPU kernels (csrc/, built with torch's cpp_extension) behind one
dispatcher by device, dtype and instruction set (AVX-512 with VNNI, AVX2 + FMA, scalar). Imports nothing of
glmserve but errors.

    kernels.op("paged_decode", q.device, q.dtype)  # the C++ op, or None: take the PyTorch path

The variant is the best this CPU runs (GLMSERVE_CPU_ISA=avx512|avx2|scalar forces one; `active_isa()` says
which), GLMSERVE_TORCH_ONLY=1 disables them all. `python -m glmserve.kernels` builds every variant ahead of
time (setup).
"""

from glmserve.kernels.dispatch import OPS, op, pinned, torch_only
from glmserve.kernels.isa import active_isa, amx_bf16, available_isas, avx512_bf16

__all__ = ["OPS", "active_isa", "amx_bf16", "available_isas", "avx512_bf16", "op", "pinned", "torch_only"]
