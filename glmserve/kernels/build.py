"""Compiling and loading one kernel source for one instruction-set variant with torch's cpp_extension,
on first use, cached by torch (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). A build that fails
(no compiler, no ninja, unsupported platform) leaves the callers on their PyTorch path, except with CI=true,
where it is an error: a CI run must not pass by skipping the kernels.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

from glmserve.errors import KernelBuildError
from glmserve.kernels.isa import BY_NAME

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("paged_decode", "sparse", "quant_matmul")  # csrc/<name>.cpp, one extension each per variant
BASE_CFLAGS = ("-O3", "-ffast-math", "-fno-finite-math-only")


def in_ci() -> bool:
    """CI=true (as GitHub Actions, GitLab and most CI systems set it): missing kernels fail instead of skipping."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def extension_name(source: str, isa: str) -> str:
    """Distinct per variant, so that every variant is built and cached side by side."""
    return f"glmserve_{source}_{isa}"


@functools.cache
def load(source: str, isa: str) -> ModuleType | None:
    """The extension built from csrc/`source`.cpp for variant `isa`, or None when it cannot be built
    (KernelBuildError instead with CI=true)."""
    name = extension_name(source, isa)
    try:
        from torch.utils.cpp_extension import load as build_extension

        module = build_extension(name=name, sources=[str(SOURCE_DIR / f"{source}.cpp")],
                                 extra_cflags=[*BASE_CFLAGS, *BY_NAME[isa].cflags], verbose=False)
    except Exception as e:
        if in_ci():
            raise KernelBuildError(f"C++ CPU kernel {name} failed to build: {e}") from e
        log.warning("C++ CPU kernel %s unavailable (%s); using the PyTorch path", name, e)
        return None
    log.info("C++ CPU kernel %s loaded", name)
    return module
