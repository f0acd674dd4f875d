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

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"


def _load(name: str, source: str, function: str) -> Callable | None:
    """`function` of the extension `name` built from csrc/`source`, or None (torch-only or no compiler)."""
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
    return getattr(module, function)


@functools.cache
def paged_decode_op() -> Callable | None:
    """paged_decode(q [B,H,D] f32, k_cache [Hkv,S,D], v_cache, slots [B,L] i64, ctx_lens [B] i64, scale)."""
    return _load("glmserve_paged_decode", "paged_decode.cpp", "paged_decode")


@functools.cache
def block_scores_op() -> Callable | None:
    """block_scores(q [B,H,D] f32, bounds [blocks,2,Hkv,D], tables [B,W] i64, num_units [B] i64, scale) -> [B,W]."""
    return _load("glmserve_block_scores", "block_scores.cpp", "block_scores")


if __name__ == "__main__":  # `python -m glmserve.layers.cpu_kernels` builds the cache ahead of time
    print("paged_decode:", "built" if paged_decode_op() else "unavailable")
    print("block_scores:", "built" if block_scores_op() else "unavailable")
