"""Shared fixtures: tiny random checkpoints per architecture, built once per session; the whole session (and
every `glmserve` subprocess it starts, which inherits the environment) runs in its own empty home and cache
directories, so nothing a machine keeps in ~/.cache/glmserve (a trained learned indexer, sessions) changes
a result."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402


def isolate_home() -> Path:
    """Points HOME, XDG_CACHE_HOME and GLMSERVE_CACHE_DIR at a fresh empty directory (removed at exit), before
    glmserve reads them. The caches of other tools keep their real place: the torch extension build cache
    (so the C++ kernels are not rebuilt per run) and the Hugging Face cache."""
    from glmserve.kernels.build import extensions_root  # reads no glmserve cache

    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_root())  # where setup built them
    os.environ.setdefault("HF_HOME", str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) /
                                         "huggingface"))
    root = Path(tempfile.mkdtemp(prefix="glmserve-tests-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    os.environ["HOME"] = str(root / "home")
    os.environ["XDG_CACHE_HOME"] = str(root / "home" / ".cache")
    os.environ["GLMSERVE_CACHE_DIR"] = str(root / "glmserve-cache")
    (root / "home" / ".cache").mkdir(parents=True)
    return root


ISOLATED_ROOT = isolate_home()

from glmserve.kernels import available_isas  # noqa: E402 (after the home is isolated)


@pytest.fixture(scope="session")
def isolated_root() -> Path:
    """The temp directory that holds the session's home and glmserve cache."""
    return ISOLATED_ROOT


@pytest.fixture(autouse=True, scope="session")
def engine_device():
    """Engines built with device "auto" run on GLMSERVE_TEST_DEVICE (default cpu), in float32 when that is a
    GPU, so that one suite with one set of tolerances checks the CUDA path too (the GPU check run sets
    GLMSERVE_TEST_DEVICE=cuda). Tests that name a device or dtype are unaffected."""
    from glmserve.engine import llm_engine

    device = os.environ.get("GLMSERVE_TEST_DEVICE", "cpu")
    resolve_device, resolve_dtype = llm_engine.resolve_device, llm_engine.resolve_dtype
    llm_engine.resolve_device = lambda name: resolve_device(device if name == "auto" else name)
    if device != "cpu":
        llm_engine.resolve_dtype = lambda name, dev: resolve_dtype("float32" if name == "auto" else name, dev)
    yield device
    llm_engine.resolve_device, llm_engine.resolve_dtype = resolve_device, resolve_dtype


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (SmolLM2-135M-Instruct GGUF) in our engine, fp32, loaded once, on the float
    path (its blocks dequantized) that the tests compare with transformers."""
    from glmserve import LLM

    return LLM(model=None, dtype="float32", quantization="none", max_num_seqs=16, max_num_batched_tokens=512,
               max_model_len=2048, kv_cache_memory_bytes=256 << 20)


def _use_kernels(isa: str, monkeypatch) -> str:
    """Routes every kernel call to the C++ variant `isa`; skips when its kernels did not build (with CI=true
    a failed build raises instead, so the test fails) or GLMSERVE_TORCH_ONLY=1 turns them off."""
    from glmserve import kernels
    from glmserve.kernels.dispatch import dtypes

    monkeypatch.setenv("GLMSERVE_CPU_ISA", isa)
    missing = [name for name in kernels.OPS if kernels.op(name, torch.device("cpu"), dtypes(name)[0]) is None]
    if missing:
        pytest.skip(f"C++ kernels unavailable ({isa}): {', '.join(missing)}")
    return isa


@pytest.fixture(params=available_isas())
def cpu_isa(request, monkeypatch) -> str:
    """Each instruction-set variant of the C++ kernels this CPU runs (GLMSERVE_CPU_ISA), so that the AVX2
    build is tested on an AVX-512 machine too."""
    return _use_kernels(request.param, monkeypatch)


@pytest.fixture(params=[*available_isas(), "torch"])
def kernel_backend(request, monkeypatch) -> str:
    """Each C++ kernel variant (as `cpu_isa`), then the pure PyTorch paths (GLMSERVE_TORCH_ONLY=1)."""
    if request.param == "torch":
        monkeypatch.setenv("GLMSERVE_TORCH_ONLY", "1")
        return request.param
    return _use_kernels(request.param, monkeypatch)


@pytest.fixture(scope="module")
def float32_prefill():
    """Prefill attention and MLP activations in float32 on every CPU (on AMX CPUs they default to bf16), for the
    modules whose tests compare paths for exact equality: the result then does not depend on the CPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLMSERVE_BF16_ATTENTION", "0")
        patch.setenv("GLMSERVE_BF16_ACTIVATIONS", "0")
        yield


@pytest.fixture
def bf16_gemm_from_two_rows(monkeypatch) -> None:
    """Batches of 2+ rows take the linears' bf16 GEMM (decode batches too, as 64+ rows do on AMX), where this CPU has
    one (AMX, or AVX512-BF16 with GLMSERVE_AVX512_BF16_ROWS); the GEMM rows are read as the weights load."""
    from glmserve import kernels
    from glmserve.quant import cpu_backend

    if kernels.amx_bf16():
        monkeypatch.setattr(cpu_backend, "DENSE_MIN_ROWS", 2)
    elif kernels.avx512_bf16():
        monkeypatch.setenv(cpu_backend.AVX512_BF16_ROWS_ENV, "2")
    else:
        pytest.skip("no bf16 GEMM on this CPU (AMX or AVX512-BF16)")
