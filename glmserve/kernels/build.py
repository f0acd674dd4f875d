"""Compiling and loading one kernel source for one instruction-set variant with torch's cpp_extension,
on first use, cached by torch (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). A build that fails
(no compiler, no ninja, unsupported platform) leaves the callers on their PyTorch path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from glmserve.kernels.isa import BY_NAME

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("paged_decode", "sparse")  # csrc/<name>.cpp, one extension each per variant
BASE_CFLAGS = ("-O3", "-ffast-math", "-fno-finite-math-only")


def extension_name(source: str, isa: str) -> str:
    """Distinct per variant, so that every variant is built and cached side by side."""
    return f"glmserve_{source}_{isa}"


@functools.cache
def load(source: str, isa: str) -> ModuleType | None:
    """The extension built from csrc/`source`.cpp for variant `isa`, or None when it cannot be built."""
    name = extension_name(source, isa)
    try:
        from torch.utils.cpp_extension import load as build_extension

        module = build_extension(name=name, sources=[str(SOURCE_DIR / f"{source}.cpp")],
                                 extra_cflags=[*BASE_CFLAGS, *BY_NAME[isa].cflags], verbose=False)
    except Exception as e:
        log.warning("C++ CPU kernel %s unavailable (%s); using the PyTorch path", name, e)
        return None
    log.info("C++ CPU kernel %s loaded", name)
    return module
