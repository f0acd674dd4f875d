"""`python -m glmserve.kernels` (setup): builds every kernel for every instruction-set variant this CPU runs,
prints what it built and which variant is active."""

from __future__ import annotations

import sys

from glmserve.kernels.build import SOURCES, extension_name, load
from glmserve.kernels.dispatch import torch_only
from glmserve.kernels.isa import active_isa, available_isas


def main() -> int:
    if torch_only():
        print("GLMSERVE_TORCH_ONLY=1: C++ kernels not built (PyTorch path)")
        return 0
    for isa in available_isas():
        for source in SOURCES:
            print(f"{extension_name(source, isa)}: {'built' if load(source, isa) is not None else 'unavailable'}")
    print(f"active variant: {active_isa()} (this CPU runs {', '.join(available_isas())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
