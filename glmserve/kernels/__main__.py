"""`python -m glmserve.kernels` (setup): builds every kernel for every instruction-set variant this CPU runs,
as many at once as there are CPUs (one subprocess per CPU, each building its share one after another: an
extension is one translation unit, so torch's ninja build of it is serial), then loads each here, prints what
it built and which variant is active; with CI=true a kernel that fails to build exits non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from glmserve.errors import KernelBuildError
from glmserve.kernels.build import SOURCES, extension_name, in_ci, load
from glmserve.kernels.dispatch import torch_only
from glmserve.kernels.isa import active_isa, available_isas

BUILD_SHARE = """
import sys
from glmserve.errors import KernelBuildError
from glmserve.kernels.build import load
for job in sys.argv[1:]:
    try:
        load(*job.split(":"))
    except KernelBuildError:
        pass
"""


def _build_in_subprocess(jobs: list[tuple[str, str]]) -> None:
    """Compiles these extensions ("source:isa") in one process of their own; errors reappear when `main` loads."""
    if jobs:
        subprocess.run([sys.executable, "-c", BUILD_SHARE, *(f"{s}:{i}" for s, i in jobs)], check=False,
                       capture_output=True)


def main() -> int:
    if torch_only():
        print("GLMSERVE_TORCH_ONLY=1: C++ kernels not built (PyTorch path)")
        return 0
    todo = [(source, isa) for isa in available_isas() for source in SOURCES]
    workers = max(1, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(_build_in_subprocess, [todo[w::workers] for w in range(workers)]))
    failed = []
    for source, isa in todo:
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
