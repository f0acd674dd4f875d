"""Our C++ CPU kernels, compiled on first use with the local compiler and cached by torch
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). When they cannot be built, the
callers fall back to the pure PyTorch path; GLMSERVE_TORCH_ONLY=1 forces that fallback.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"


@functools.cache
def _load(name: str, source: str) -> ModuleType | None:
    """The extension `name` built from csrc/`source`, or None (torch-only or no compiler)."""
    if os.environ.get("GLMSERVE_TORCH_ONLY") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name=name,
            sources=[str(SOURCES / source)],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, unsupported platform: use the torch path
        log.warning("C++ CPU kernel %s unavailable (%s); using the PyTorch path", name, e)
        return None
    return module


@functools.cache
def paged_decode_op() -> Callable | None:
    """paged_decode(q [B,H,D] f32, k_cache [Hkv,S,D], v_cache, slots [B,L] i64, ctx_lens [B] i64, scale)."""
    module = _load("glmserve_paged_decode", "paged_decode.cpp")
    return None if module is None else module.paged_decode


@functools.cache
def paged_decode_lse_op() -> Callable | None:
    """paged_decode_lse(same arguments) -> [out [B,H,D], lse [B,H]]: also each head's log-sum-exp of scores."""
    module = _load("glmserve_paged_decode", "paged_decode.cpp")
    return None if module is None else module.paged_decode_lse


def sparse_ops() -> ModuleType | None:
    """Sparse decode attention's kernels (csrc/sparse.cpp), or None:
    bounds_update(slots [T] i64, keys [T,Hkv,D] f32, bounds [blocks,2,Hkv,D], block_size) (in place);
    block_scores(q [B,H,D] f32, bounds [blocks,2,Hkv,D], tables [B,W] i64, num_units [B] i64, scale) -> [B,W];
    learned_scores(qi [B,Hi,d] f32, w [B,Hi] f32 (times the scale), keys [slots,d], tables [B,W] i64, block_size,
                   length, ctx [B] i64, distance_bias [NB] f32, sink_bias [S] f32) -> [B,length];
    select_slots(scores [B,U] f32, unit_size, ctx [B], top_k [B], threshold [B] f32, sink [B], local [B],
                 kv_slots [B,L], pins [B,P] i64 (pinned units, -1 = none)) -> [slots [B,W], lengths [B]]."""
    return _load("glmserve_sparse", "sparse.cpp")


if __name__ == "__main__":  # `python -m glmserve.layers.cpu_kernels` builds the cache ahead of time
    print("paged_decode:", "built" if paged_decode_op() else "unavailable")
    print("sparse:", "built" if sparse_ops() else "unavailable")
