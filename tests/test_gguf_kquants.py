"""GGUF's Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks read into the block forms our kernels run
(glmserve/quant/gguf_kquants.py), against gguf-py's dequantization of the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from gguf_random_blocks import k_blocks, q6_k_blocks

from glmserve.quant.gguf_kquants import RUNS_AS, convert_blocks
from glmserve.quant.reference import dequantize
from glmserve.quant.schemes import gguf_spec

ROWS, COLS = 6, 768  # three superblocks a row


def raw_blocks(gguf_type: str) -> np.ndarray:
    """[ROWS, bytes a row] of random blocks: llama.cpp's quantization of random weights where gguf-py has it
    (Q5_0, Q5_1; one all-zero block), else random codes and scales (tests/gguf_random_blocks.py)."""
    rng = np.random.default_rng(len(gguf_type) + ord(gguf_type[1]))
    if gguf_type in ("Q5_0", "Q5_1"):
        w = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
        w[0, :32] = 0
        return gguf_quantize(w, GGMLQuantizationType[gguf_type])
    supers = ROWS * COLS // 256
    raw = (q6_k_blocks(rng, supers) if gguf_type == "Q6_K" else k_blocks(rng, supers, int(gguf_type[1])))[0]
    return raw.reshape(ROWS, -1)


def block_absmax(x: np.ndarray) -> np.ndarray:
    return np.repeat(np.abs(x).reshape(ROWS, -1, 32).max(axis=-1), 32, axis=-1)


@pytest.mark.parametrize("gguf_type", list(RUNS_AS))
def test_values_are_gguf_py_dequantization(gguf_type):
    raw = raw_blocks(gguf_type)
    weight = convert_blocks(raw, gguf_type, (ROWS, COLS))
    assert weight.spec == gguf_spec(RUNS_AS[gguf_type]) and weight.shape == (ROWS, COLS)
    expected = gguf_dequantize(raw, GGMLQuantizationType[gguf_type]).reshape(ROWS, COLS)
    ours = dequantize(weight).numpy()
    codes = weight.codes.numpy()
    if gguf_type in ("Q5_0", "Q5_1"):  # the file's codes, scales and mins: exact
        assert codes.min() >= (-16 if gguf_type == "Q5_0" else 0) and codes.max() <= (15 if gguf_type == "Q5_0" else 31)
        assert np.array_equal(ours, expected)
        return
    error = np.abs(ours - expected)
    if gguf_type == "Q6_K":  # quantized again to int8 per 32: half a step, plus the fp16 rounding of d
        assert np.all(error <= (1 / 254 + 2 ** -10) * block_absmax(expected) + 1e-9)
        return
    assert codes.min() >= 0 and codes.max() <= (15 if gguf_type == "Q4_K" else 31)
    scale = np.repeat(weight.scales.float().numpy(), 32, axis=-1)
    minimum = np.repeat(weight.mins.float().numpy(), 32, axis=-1)
    bound = 2 ** -11 * (1 + 2 ** -10) * (np.abs(scale) * codes + np.abs(minimum))  # each fp16 rounded once
    assert np.all(error <= bound + 1e-9)
    assert error.max() > 0  # the two-level scales really were flattened, not kept


@pytest.mark.parametrize("gguf_type, shape, cut, match", [
    ("Q4_K", (ROWS, COLS), 1, "2591 bytes, expected 2592"),
    ("Q6_K", (ROWS, 512 + 32), 0, "not a multiple of 256"),
    ("Q5_1", (ROWS, COLS + 16), 0, "not a multiple of 32"),
])
def test_wrong_sizes_are_refused(gguf_type, shape, cut, match):
    raw = raw_blocks(gguf_type).reshape(-1)
    with pytest.raises(ValueError, match=match):
        convert_blocks(raw[:raw.size - cut], gguf_type, shape)


def test_converted_weight_runs_on_the_cpu_kernel_as_its_dequantization():
    """A Q4_K weight's converted blocks through the backend: the float product of its dequantized weight, up to
    the kernel's int8 activations (per 32, as llama.cpp's)."""
    from glmserve.quant.cpu_backend import CpuBlockBackend

    backend = CpuBlockBackend()
    weight = convert_blocks(raw_blocks("Q4_K"), "Q4_K", (ROWS, COLS))
    if not backend.supports(weight.spec, None, torch.device("cpu")):
        pytest.skip("no compiled kernel")
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(0))
    y = backend.apply(backend.prepare(weight, None, torch.device("cpu")), x, None)
    w = dequantize(weight)
    x_block_max = x.abs().reshape(3, -1, 32).amax(dim=-1).repeat_interleave(32, dim=1)
    bound = (x_block_max / 254 + 1e-6 * x.abs()) @ w.abs().T  # each activation within half its int8 step
    assert ((y - x @ w.T).abs() <= 1.01 * bound + 1e-5).all()
