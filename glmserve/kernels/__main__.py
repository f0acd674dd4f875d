"""`python -m glmserve.kernels` (setup): builds every kernel for every instruction-set variant this CPU runs,
prints what it built and which variant is active; with CI=true a kernel that fails to build exits non-zero."""

from __future__ import annotations

import sys

from glmserve.errors import KernelBuildError
from glmserve.kernels.build import SOURCES, extension_name, in_ci, load
from glmserve.kernels.dispatch import torch_only
from glmserve.kernels.isa import active_isa, available_isas


def main() -> int:
    if torch_only():
        print("GLMSERVE_TORCH_ONLY=1: C++ kernels not built (PyTorch path)")
        return 0
    failed = []
    for isa in available_isas():
        for source in SOURCES:
            name = extension_name(source, isa)
            try:
                built = load(source, isa) is not None
            except KernelBuildError as e:
                print(e, file=sys.stderr)
                built = False
            print(f"{name}: {'built' if built else 'unavailable'}")
            failed += [] if built else [name]
    print(f"active variant: {active_isa()} (this CPU runs {', '.join(available_isas())})")
    return 1 if failed and in_ci() else 0


if __name__ == "__main__":
    sys.exit(main())
