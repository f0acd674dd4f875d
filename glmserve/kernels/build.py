"""Compiling and loading one kernel source for one instruction-set variant with torch's cpp_extension,
on first use, cached in `build_directory(name)` under TORCH_EXTENSIONS_DIR (else torch's own default), one
directory per version of the sources. A build that fails (no compiler, no ninja, unsupported platform) leaves
the callers on their PyTorch path, except with CI=true, where it is an error: a CI run must not pass by skipping
the kernels.

Builds of one extension are serialized by an flock on its directory, which the kernel releases when its
holder dies. torch's own lock file is not: a process killed mid-build (a test server stopped at teardown, a
timed-out test) leaves it behind and every later load waits on it forever. Whoever holds our flock knows no
other glmserve process is building, so it removes such a leftover before it loads.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from glmserve.errors import KernelBuildError
from glmserve.kernels.isa import BY_NAME

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
# csrc/<name>.cpp, one extension each per variant
SOURCES = ("paged_decode", "sparse", "quant_matmul", "float_quant_matmul", "prefill_ops", "prefill_attention",
           "prefill_attention_f32", "sampling", "bf16_gemm")
# -fopenmp: at::parallel_for is inline in ATen's headers with torch's OpenMP backend (torch/include/ATen/
# ParallelOpenMP.h: `#pragma omp parallel` under `#ifdef _OPENMP`), so without it every parallel loop of ours ran
# on one thread whatever torch.set_num_threads said. It is a compile flag only: cpp_extension passes extra_cflags
# to the compiler, not to the link, so the .so does not link the system libgomp (no NEEDED libgomp); its GOMP_* /
# omp_* references resolve at load time through libtorch_cpu.so's dependencies to the libgomp torch's wheel
# bundles and already loaded. One OpenMP runtime, one thread pool, and torch.set_num_threads binds our loops too
# (tests/test_kernels.py checks both). It also turns on the `#pragma omp simd` hints in csrc.
BASE_CFLAGS = ("-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp")


def in_ci() -> bool:
    """CI=true (as GitHub Actions, GitLab and most CI systems set it): missing kernels fail instead of skipping."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def extension_name(source: str, isa: str) -> str:
    """Distinct per variant, so that every variant is built and cached side by side."""
    return f"glmserve_{source}_{isa}"


def build_directory(source: str, isa: str) -> Path:
    """One extension's build directory per version of its source and the torch installation: the folder name
    carries a hash of csrc/`source`.cpp, the compiler flags and torch's location, so checkouts with the same kernel
    and environment (worktrees on one venv) share one build, a change to one source rebuilds only that source's
    variants, and a checkout whose kernel or venv differs (a clean clone for CI) never loads or overwrites
    another's."""
    return extensions_root() / f"{extension_name(source, isa)}-{_source_digest(source, isa)}"


@functools.cache
def _source_digest(source: str, isa: str) -> str:
    # the variant's flags and the torch installation too: build.ninja holds its include and library paths, so two
    # environments (a venv and a CI clone's venv) sharing one cache would each find the other's command changed and
    # rebuild, in turn
    import torch

    flags = " ".join((*BASE_CFLAGS, *BY_NAME[isa].cflags))
    digest = hashlib.sha1(f"{flags} {torch.__version__} {Path(torch.__file__).parent}".encode())
    # the csrc headers it includes too, so that a header's change rebuilds its includers (and only them)
    for path in [SOURCE_DIR / f"{source}.cpp", *(SOURCE_DIR / h for h in included_headers(source))]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def included_headers(source: str) -> tuple[str, ...]:
    """The csrc headers csrc/`source`.cpp includes (`#include "name.h"`, one level: headers include none)."""
    text = (SOURCE_DIR / f"{source}.cpp").read_text()
    return tuple(sorted(set(re.findall(r'^#include "([A-Za-z0-9_]+\.h)"', text, flags=re.MULTILINE))))


def extensions_root() -> Path:
    """The directory the kernels are built in: TORCH_EXTENSIONS_DIR when set, else torch's default
    (~/.cache/torch_extensions/py<version>_cpu). The tests pin TORCH_EXTENSIONS_DIR to this before they move
    HOME, so that they load what setup built instead of building it again."""
    override = os.environ.get("TORCH_EXTENSIONS_DIR")
    if override:
        return Path(override)
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return _default_build_root() / f"{python}_cpu"


def _default_build_root() -> Path:
    """torch.utils.cpp_extension.get_default_build_root()'s directory, computed as it computes it (torch 2.13:
    realpath of torch._appdirs' user cache dir for "torch_extensions") without importing cpp_extension, which
    imports setuptools: ~0.2 s of every server start that only imports built kernels. tests/test_kernels.py
    checks both agree."""
    from torch import _appdirs

    return Path(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")))


@contextlib.contextmanager
def _exclusive_build(directory: Path) -> Iterator[None]:
    """Holds the flock of one extension's build directory (closing the file releases it); clears torch's lock
    file left by a dead builder."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "glmserve.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing %s, left by a kernel build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


def _staged_source(directory: Path, source: str) -> Path:
    """csrc/`source`.cpp (with the headers it includes, beside it) copied once into the build directory, the path
    the build compiles. torch writes the source's absolute path into build.ninja and ninja rebuilds when that
    command or the source's mtime changes, so compiling each checkout's own file rebuilt the shared directory for
    every worktree (and a fresh checkout's newer mtime did too). The directory is named by the hash of the source
    and its headers, so an existing copy is the same text."""
    staged = directory / "src" / f"{source}.cpp"
    if not staged.exists():
        staged.parent.mkdir(exist_ok=True)
        for name in [*included_headers(source), f"{source}.cpp"]:  # the source last: its presence means all are
            partial = staged.parent / f"{name}.partial"
            partial.write_bytes((SOURCE_DIR / name).read_bytes())
            partial.rename(staged.parent / name)
    return staged


def _import_built(directory: Path, name: str) -> ModuleType | None:
    """The extension's library when a build finished in `directory` (named by the source's hash: a library there
    was built from these sources and flags), imported directly; torch's load() would hash the sources again and
    run ninja, 0.1-0.2 s per kernel at every start (bench/RESULTS.md). None where there is none or it does not
    import (a build killed mid-link): then load() builds it."""
    library = directory / f"{name}.so"
    if not library.exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as e:
        log.warning("C++ CPU kernel %s: %s does not import (%s); building it again", name, library, e)
        return None
    return module


def _build(source: str, isa: str, directory: Path) -> ModuleType:
    """Compiles and imports the extension with torch's cpp_extension (imported here: a start that finds every
    kernel built never imports it)."""
    from torch.utils.cpp_extension import load as build_extension

    return build_extension(name=extension_name(source, isa), sources=[str(_staged_source(directory, source))],
                           extra_cflags=[*BASE_CFLAGS, *BY_NAME[isa].cflags], build_directory=str(directory),
                           verbose=False)


@functools.cache
def load(source: str, isa: str) -> ModuleType | None:
    """The extension built from csrc/`source`.cpp for variant `isa`, or None when it cannot be built
    (KernelBuildError instead with CI=true)."""
    name = extension_name(source, isa)
    try:
        directory = build_directory(source, isa)
        with _exclusive_build(directory):
            module = _import_built(directory, name) or _build(source, isa, directory)
    except Exception as e:
        if in_ci():
            raise KernelBuildError(f"C++ CPU kernel {name} failed to build: {e}") from e
        log.warning("C++ CPU kernel %s unavailable (%s); using the PyTorch path", name, e)
        return None
    log.info("C++ CPU kernel %s loaded", name)
    return module
