"""The kernel dispatcher (glmserve/kernels/): which instruction-set variant is active and forced, the
PyTorch fallback by device, dtype and GLMSERVE_TORCH_ONLY, and setup's build step failing under CI=true."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glmserve import kernels
from glmserve.errors import InvalidRequestError
from glmserve.kernels import build
from glmserve.kernels.dispatch import dtypes

CPU = torch.device("cpu")


def test_variants_are_best_first_and_scalar_always_runs():
    isas = kernels.available_isas()
    assert isas[-1] == "scalar"
    assert list(isas) == [v for v in ("avx512", "avx2", "scalar") if v in isas]
    assert "avx2" in isas or "avx512" not in isas  # an AVX-512 CPU runs the AVX2 build too


def test_the_forced_variant_is_the_one_called(cpu_isa):
    assert kernels.active_isa() == cpu_isa
    for name in kernels.OPS:
        assert kernels.op(name, CPU, dtypes(name)[0]).__module__ == f"glmserve_{kernels.OPS[name]}_{cpu_isa}"


def test_best_variant_by_default(monkeypatch):
    monkeypatch.delenv("GLMSERVE_CPU_ISA", raising=False)
    assert kernels.active_isa() == kernels.available_isas()[0]


def test_forcing_an_unknown_variant_fails_clearly(monkeypatch):
    monkeypatch.setenv("GLMSERVE_CPU_ISA", "sse9")
    with pytest.raises(InvalidRequestError, match="must be one of avx512, avx2, scalar"):
        kernels.active_isa()


def test_torch_path_for_other_devices_dtypes_and_torch_only(cpu_isa, monkeypatch):
    assert kernels.op("paged_decode", torch.device("meta"), torch.float32) is None
    assert kernels.op("paged_decode", CPU, torch.bfloat16) is None
    monkeypatch.setenv("GLMSERVE_TORCH_ONLY", "1")
    assert all(kernels.op(name, CPU, dtypes(name)[0]) is None for name in kernels.OPS)


def test_pinned_answers_once_per_op_and_unpins(cpu_isa, monkeypatch):
    """Inside kernels.pinned() an op's first answer holds (a model step does not read the environment per layer);
    outside, the environment is read again."""
    with kernels.pinned():
        first = kernels.op("paged_decode", CPU, torch.float32)
        assert first is not None and first.__module__.endswith(cpu_isa)
        monkeypatch.setenv("GLMSERVE_TORCH_ONLY", "1")
        assert kernels.op("paged_decode", CPU, torch.float32) is first
        assert kernels.op("store_kv", CPU, torch.float32) is None  # first asked after the change
        with kernels.pinned():  # nested: the outer answers hold
            assert kernels.op("paged_decode", CPU, torch.float32) is first
        assert kernels.op("paged_decode", torch.device("meta"), torch.float32) is None
    assert kernels.op("paged_decode", CPU, torch.float32) is None
    monkeypatch.delenv("GLMSERVE_TORCH_ONLY")
    assert kernels.op("paged_decode", CPU, torch.float32) is first


@pytest.mark.parametrize("ci", ["true", ""])
def test_setup_build_fails_under_ci_when_a_kernel_does_not_build(tmp_path, ci):
    """`python -m glmserve.kernels` with no working compiler: exit 1 with CI=true, else 0 (PyTorch path)."""
    env = {**os.environ, "CI": ci, "CXX": "false", "TORCH_EXTENSIONS_DIR": str(tmp_path),
           "GLMSERVE_TORCH_ONLY": "0"}
    run = subprocess.run([sys.executable, "-m", "glmserve.kernels"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == (1 if ci else 0), run.stderr
    assert "glmserve_paged_decode_scalar: unavailable" in run.stdout


@pytest.mark.skipif(kernels.torch_only(), reason="GLMSERVE_TORCH_ONLY=1: setup builds no kernels")
def test_the_suite_loads_the_kernels_setup_built():
    """Setup (`python -m glmserve.kernels`, HOME untouched) and this suite (its own HOME) share one build
    directory: each variant's shared library is already there, so no test compiles one again. Without CI=true a
    machine where setup could not build them (no compiler) skips, as the kernel tests do."""
    variants = [(source, isa) for isa in kernels.available_isas() for source in build.SOURCES]
    missing = [build.extension_name(*v) for v in variants
               if not (build.build_directory(*v) / f"{build.extension_name(*v)}.so").exists()]
    if missing and not build.in_ci():
        pytest.skip(f"setup built no {', '.join(missing)} here")
    assert not missing, missing


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path):
    """torch's lock file from a builder that died would make every later load wait forever; holding our
    flock, the loader knows nobody is building and removes it."""
    directory = tmp_path / "glmserve_sparse_scalar"
    directory.mkdir()
    (directory / "lock").touch()
    with build._exclusive_build(directory):
        assert not (directory / "lock").exists()


def test_the_build_compiles_a_copy_of_the_source_inside_its_directory(tmp_path):
    """build.ninja names the file it compiles; a copy inside the (source-hashed) build directory keeps that path and
    its mtime the same for every checkout, so a second worktree reuses the build instead of rebuilding it."""
    directory = tmp_path / "glmserve_sparse_scalar-0000"
    directory.mkdir()
    staged = build._staged_source(directory, "sparse")
    assert staged.parent.parent == directory
    assert staged.read_bytes() == (build.SOURCE_DIR / "sparse.cpp").read_bytes()
    before = staged.stat().st_mtime_ns
    os.utime(staged, ns=(before - 10**9, before - 10**9))  # as if staged by another checkout a second earlier
    assert build._staged_source(directory, "sparse") == staged
    assert staged.stat().st_mtime_ns == before - 10**9  # not rewritten: ninja sees nothing new


@pytest.mark.skipif(kernels.torch_only(), reason="GLMSERVE_TORCH_ONLY=1: setup builds no kernels")
def test_a_built_kernel_imports_without_torch_cpp_extension_or_ninja(tmp_path):
    """Server start: the library a finished build left in its (source-hashed) directory is imported directly;
    torch's load() would hash the sources and run ninja again. Only the .so is copied to a fresh root and ninja
    is off the PATH, so the load succeeds only by importing it; torch.utils.cpp_extension (and setuptools, ~0.2 s)
    is never imported."""
    name = build.extension_name("sparse", "scalar")
    built = build.build_directory("sparse", "scalar") / f"{name}.so"
    if not built.exists() and not build.in_ci():
        pytest.skip(f"setup built no {name} here")
    copy = tmp_path / build.build_directory("sparse", "scalar").name
    copy.mkdir()
    (copy / built.name).write_bytes(built.read_bytes())
    probe = ("from glmserve.kernels import build\n"
             "module = build.load('sparse', 'scalar')\n"
             "assert module is not None and hasattr(module, 'block_scores')\n"
             "assert not (build.build_directory('sparse', 'scalar') / 'build.ninja').exists()\n"
             "import sys\nassert 'torch.utils.cpp_extension' not in sys.modules")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PATH": "/nonexistent", "GLMSERVE_TORCH_ONLY": "0",
           "CI": "true"}  # CI: a failed build raises instead of falling back to None
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_default_build_root_is_torchs(monkeypatch):
    """Without TORCH_EXTENSIONS_DIR the kernels are where torch's cpp_extension builds them by default (computed
    without importing it)."""
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert build.extensions_root().parent == Path(get_default_build_root())


def test_parallel_loops_use_torchs_intra_op_threads(cpu_isa):
    """The kernels are compiled with -fopenmp (build.py): ATen's parallel_for is inline OpenMP, and without it
    every parallel loop of ours ran on one thread. Each item of a grain-1 loop records the thread that ran it."""
    module = build.load("paged_decode", cpu_isa)
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            assert sorted(set(module.parallel_thread_ids(64).tolist())) == list(range(threads))
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="n must be positive"):
        module.parallel_thread_ids(0)


@pytest.mark.skipif(kernels.torch_only(), reason="GLMSERVE_TORCH_ONLY=1: setup builds no kernels")
def test_the_kernels_share_torchs_openmp_runtime():
    """No kernel library links an OpenMP runtime of its own (its GOMP_* calls resolve to the libgomp torch
    loaded): with every variant loaded the process maps one libgomp, so torch.set_num_threads binds our loops."""
    probe = ("from glmserve import kernels\nfrom glmserve.kernels import build\n"
             "for isa in kernels.available_isas():\n"
             "    for source in build.SOURCES:\n"
             "        module = build.load(source, isa)\n"
             "        assert module is not None, (source, isa)\n"
             "        print('so', module.__file__)\n"
             "for path in sorted({line.split()[-1] for line in open('/proc/self/maps') if '/libgomp' in line}):\n"
             "    print('gomp', path)\n")
    run = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "CI": "true"}, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line.split(" ", 1) for line in run.stdout.splitlines()]
    assert len([path for kind, path in lines if kind == "gomp"]) == 1, run.stdout
    for library in (path for kind, path in lines if kind == "so"):
        dynamic = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
        assert "libgomp" not in dynamic and "libomp" not in dynamic, f"{library} links an OpenMP runtime"
