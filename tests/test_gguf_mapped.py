"""GGUF block types beyond Q8_0 / Q4_0 / Q4_1 read into the block forms our kernels run
(glmserve/quant/gguf_mapped.py), against gguf-py's dequantization of the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from gguf_random_blocks import random_blocks
from test_gguf_loader import block_absmax

from glmserve.quant.cpu_backend import CpuBlockBackend
from glmserve.quant.gguf_mapped import (
    CODES_KEPT,
    IQ4_VALUES,
    MXFP4_VALUES,
    REQUANTIZED,
    RUNS_AS,
    TableCodesWeight,
    convert_blocks,
    maps,
)
from glmserve.quant.reference import dequantize
from glmserve.quant.schemes import gguf_spec
from glmserve.quant.weight import QuantizedWeight, concat_rows

ROWS, COLS = 12, 768  # three superblocks a row
FLATTENED = ("Q4_K", "Q5_K", "IQ4_XS", "Q6_K", "Q3_K", "Q2_K")  # two-level scales in one fp16 per 32 (Q6_K, Q3_K,
# Q2_K: per 16)
CODE_RANGE = {"Q5_0": (-16, 15), "Q5_1": (0, 31), "Q4_K": (0, 15), "Q5_K": (0, 31), "IQ4_NL": (-127, 113),
              "IQ4_XS": (-127, 113), "Q6_K": (-32, 31), "Q3_K": (-4, 3), "MXFP4": (-12, 12),
              "NVFP4": (-12, 12), "TQ1_0": (-1, 1), "TQ2_0": (-1, 2), "Q2_K": (0, 3)}


def raw_blocks(gguf_type: str) -> np.ndarray:
    """[ROWS, bytes a row]: llama.cpp's quantization of random weights where gguf-py has it (Q5_0, Q5_1; with an
    all-zero block), else random bytes (tests/gguf_random_blocks.py)."""
    rng = np.random.default_rng(sum(map(ord, gguf_type)))
    if gguf_type in ("Q5_0", "Q5_1"):
        w = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
        w[0, :32] = 0
        return gguf_quantize(w, GGMLQuantizationType[gguf_type])
    return random_blocks(rng, gguf_type, ROWS, COLS)


@pytest.mark.parametrize("gguf_type", list(RUNS_AS))
def test_values_are_gguf_py_dequantization(gguf_type):
    raw = raw_blocks(gguf_type)
    weight = convert_blocks(raw, gguf_type, (ROWS, COLS))
    assert weight.spec == gguf_spec(RUNS_AS[gguf_type]) and weight.shape == (ROWS, COLS)
    expected = gguf_dequantize(raw, GGMLQuantizationType[gguf_type]).reshape(ROWS, COLS)
    assert np.abs(expected).max() > 0
    ours = dequantize(weight).numpy()
    error = np.abs(ours - expected)
    if gguf_type in REQUANTIZED:  # int8 again per 32: half a step, plus the fp16 rounding of the new d (absolute
        # under fp16's smallest normal, 6.1e-5, as Q8_0's d of blocks below 0.0078 is: half its 2^-24 spacing x 127)
        assert np.all(error <= (1 / 254 + 2 ** -10) * block_absmax(expected) + 127 * 2 ** -25)
        return
    codes = weight.codes.numpy()
    low, high = CODE_RANGE[gguf_type]
    assert codes.min() >= low and codes.max() <= high
    if gguf_type not in FLATTENED:  # the file's codes, scales and mins as they are
        assert np.array_equal(ours, expected)
        return
    per = COLS // weight.scales.shape[1]  # inputs per scale
    scale = np.repeat(weight.scales.float().numpy(), per, axis=-1)
    minimum = 0 if weight.mins is None else np.repeat(weight.mins.float().numpy(), per, axis=-1)
    bound = 2 ** -11 * (1 + 2 ** -10) * (np.abs(scale * codes) + np.abs(minimum))  # each fp16 rounded once
    assert np.all(error <= bound + 1e-9)
    assert error.max() > 0  # the two-level scales really were flattened, not kept


def test_every_type_is_exact_flattened_or_requantized():
    assert set(RUNS_AS) == set(CODES_KEPT) | set(REQUANTIZED) and set(FLATTENED) <= set(CODES_KEPT)
    assert {"IQ2_XXS", "IQ3_S"} <= set(REQUANTIZED) and {"MXFP4", "NVFP4", "TQ1_0", "Q2_K"} <= set(CODES_KEPT)
    assert maps("Q4_K", 512) and not maps("Q4_K", 512 + 16) and not maps("F16", 512) and not maps("Q4_1", 512)


@pytest.mark.parametrize("gguf_type, shape, cut, match", [
    ("Q4_K", (ROWS, COLS), 1, "5183 bytes, expected 5184"),
    ("Q6_K", (ROWS, 512 + 32), 0, "not a multiple of 256"),
    ("Q5_1", (ROWS, COLS + 16), 0, "not a multiple of 32"),
])
def test_wrong_sizes_are_refused(gguf_type, shape, cut, match):
    raw = raw_blocks(gguf_type).reshape(-1)
    with pytest.raises(ValueError, match=match):
        convert_blocks(raw[:raw.size - cut], gguf_type, shape)


@pytest.mark.parametrize("gguf_type", ["Q4_K", "Q5_0", "IQ4_XS", "MXFP4", "IQ2_XXS", "Q6_K", "Q3_K", "NVFP4",
                                       "TQ1_0", "Q2_K"])  # u4, u5, t4 x 2, i8, q6, s4, f4, u4, q2
def test_converted_weight_runs_on_the_cpu_kernel_as_its_dequantization(gguf_type):
    """Converted blocks through the backend: the float product of the dequantized weight, up to the kernel's int8
    activations (per 32, as llama.cpp's)."""
    backend = CpuBlockBackend()
    weight = convert_blocks(raw_blocks(gguf_type), gguf_type, (ROWS, COLS))
    if not backend.supports(weight.spec, None, torch.device("cpu")):
        pytest.skip("no compiled kernel")
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(0))
    y = backend.apply(backend.prepare(weight, None, torch.device("cpu")), x, None)
    w = dequantize(weight)
    x_block_max = x.abs().reshape(3, -1, 32).amax(dim=-1).repeat_interleave(32, dim=1)
    bound = (x_block_max / 254 + 1e-6 * x.abs()) @ w.abs().T  # each activation within half its int8 step
    assert ((y - x @ w.T).abs() <= 1.01 * bound + 1e-4).all()


def test_iq4_weights_pack_as_nibble_indices_and_their_table():
    """IQ4_NL / IQ4_XS weights (TableCodesWeight: the table's values as Q8_0 codes) pack as 272-byte tile blocks
    (nibble indices, then the table: 4.25 bits a weight before scales, where Q8_0's codes take 8); they keep the
    table when stacked with each other, moved or row-selected, and become plain Q8_0 stacked with one; codes outside
    the table pack as int8 codes."""
    backend = CpuBlockBackend()
    nl, xs = (convert_blocks(raw_blocks(t), t, (ROWS, COLS)) for t in ("IQ4_NL", "IQ4_XS"))
    assert isinstance(nl, TableCodesWeight) and isinstance(xs.to(torch.device("cpu")), TableCodesWeight)
    if not backend.supports(nl.spec, None, torch.device("cpu")):
        pytest.skip("no compiled kernel")
    packed = backend.prepare(nl, None, torch.device("cpu"))
    assert packed.u4 and packed.codes.shape[2] == 272
    assert torch.equal(packed.codes[..., 256:].view(torch.int8), torch.from_numpy(IQ4_VALUES).expand(1, 24, 16))
    assert isinstance(concat_rows([nl, xs]), TableCodesWeight)
    plain = concat_rows([nl, QuantizedWeight(nl.spec, nl.codes, nl.scales)])
    assert type(plain) is QuantizedWeight and backend.prepare(plain, None, torch.device("cpu")).codes.shape[2] == 512
    odd = TableCodesWeight(nl.spec, nl.codes.clone(), nl.scales, nl.table)
    odd.codes[3, 5] = 0  # not one of IQ4's values
    assert backend.prepare(odd, None, torch.device("cpu")).codes.shape[2] == 512
    ids = torch.arange(ROWS)
    assert torch.equal(backend.dequantize_rows(packed, ids, torch.float32), dequantize(nl))


def test_mxfp4_runs_as_indices_into_its_table_unless_a_scale_leaves_fp16():
    """MXFP4 (llama.cpp's quantization, through gguf-py): nibble indices into the doubled E2M1 values, each block's
    E8M0 scale 2^(e - 128) exact in fp16, packed as t4 blocks with that table; a matrix with a used block whose
    scale fp16 cannot hold (e = 100: 2^-28) runs re-quantized to Q8_0, within half an int8 step of its values."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.02
    raw = gguf_quantize(w, GGMLQuantizationType.MXFP4)
    weight = convert_blocks(raw, "MXFP4", (ROWS, COLS))
    expected = gguf_dequantize(raw, GGMLQuantizationType.MXFP4).reshape(ROWS, COLS)
    assert isinstance(weight, TableCodesWeight) and np.array_equal(dequantize(weight).numpy(), expected)
    backend = CpuBlockBackend()
    if backend.supports(weight.spec, None, torch.device("cpu")):
        packed = backend.prepare(weight, None, torch.device("cpu"))
        assert packed.codes.shape[2] == 272
        assert torch.equal(packed.codes[0, 0, 256:].view(torch.int8), torch.from_numpy(MXFP4_VALUES))
    tiny = raw.reshape(ROWS, -1, 17).copy()
    tiny[0, 0, 0], tiny[0, 0, 1] = 100, 0x11  # codes 1: 2^-28 each
    fallback = convert_blocks(tiny, "MXFP4", (ROWS, COLS))
    assert type(fallback) is QuantizedWeight and fallback.spec == gguf_spec("Q8_0")
    values = gguf_dequantize(tiny.reshape(ROWS, -1), GGMLQuantizationType.MXFP4).reshape(ROWS, COLS)
    error = np.abs(dequantize(fallback).numpy() - values)
    assert np.all(error <= (1 / 254 + 2 ** -10) * block_absmax(values) + 127 * 2 ** -25)


def test_nvfp4_packs_as_table_indices_with_a_scale_per_16():
    """NVFP4 (TableCodesWeight with a scale per 16: the doubled E2M1 values, the UE4M3 scales halved) packs as 304-byte
    f4 tile blocks (nibble indices, the table of codes c + 32, the scales of inputs 16..31: 4.75 bits a weight before
    the tiles' scales) and reads back as its dequantization; stacked with a plain weight of its spec it packs as q6
    blocks (416 bytes) of the same values."""
    backend = CpuBlockBackend()
    weight = convert_blocks(raw_blocks("NVFP4"), "NVFP4", (ROWS, COLS))
    assert isinstance(weight, TableCodesWeight) and weight.spec == gguf_spec("Q6_K")
    if not backend.supports(weight.spec, None, torch.device("cpu")):
        pytest.skip("no compiled kernel")
    packed = backend.prepare(weight, None, torch.device("cpu"))
    assert packed.u4 and packed.codes.shape[2] == 304
    assert torch.equal(packed.codes[0, 0, 256:272].view(torch.int8), torch.from_numpy(MXFP4_VALUES) + 32)
    ids = torch.arange(ROWS)
    assert torch.equal(backend.dequantize_rows(packed, ids, torch.float32), dequantize(weight))
    plain = backend.prepare(concat_rows([weight, QuantizedWeight(weight.spec, weight.codes, weight.scales)]), None,
                            torch.device("cpu"))
    assert plain.codes.shape[2] == 416
    assert torch.equal(backend.dequantize_rows(plain, ids, torch.float32), dequantize(weight))
