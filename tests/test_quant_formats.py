"""Quantization formats: every named scheme's round trip on random weights, GGUF blocks against gguf-py
(dequantization equal, quantized bytes bit-exact, bytes -> canonical -> bytes lossless), scheme errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from glmserve.errors import InvalidRequestError
from glmserve.quant.gguf_blocks import NATIVE, _round_away, dequantize_other, from_blocks, to_blocks
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize, expand_to
from glmserve.quant.schemes import SCHEMES, gguf_spec, scheme

# relative Frobenius error of quantize -> dequantize on N(0, 1) weights (each bound ~2x what RTN gives)
REL_ERROR = {"int8": 0.01, "int8-g64": 0.008, "int8-g32": 0.008, "w8a8": 0.01, "w4a16": 0.12, "w4a16-asym": 0.1,
             "w4a16-fmin": 0.1, "w4a16-g64": 0.13,
             "w4a16-asym-g64": 0.11, "fp8": 0.06, "fp8-a16": 0.06, "fp8-block": 0.06, "fp8-block-g128": 0.06,
             "fp8-g32": 0.06, "fp8-g16": 0.06, "nvfp4": 0.2, "q8_0": 0.008,
             "q4_0": 0.13, "q4_1": 0.1}


def _weights(out: int = 200, inp: int = 320, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    w[3, 5] = 9.0  # an outlier, so per-group scales differ across the row
    return w


@pytest.mark.parametrize("name", sorted(REL_ERROR))
def test_scheme_round_trip_error(name):
    w = _weights()
    spec = scheme(name).weight
    q = quantize(w, spec)
    assert q.shape == tuple(w.shape)
    back = dequantize(q)
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < REL_ERROR[name], rel
    if spec.type == "int":  # round to nearest: half a step, plus the fp16 rounding of GGUF's scales
        step = expand_to(q.scales, spec, q.shape).abs()  # Q4_0 scales are negative
        # Q4_0 maps the signed maximum to -8: the other side of the range ends at 7 steps (clipped by <= 1)
        bound = step * (1.0 if spec.gguf_type == "Q4_0" else 0.5)
        if q.scales.dtype == torch.float16:
            bound = bound + q.codes.float().abs() * step * 2.0**-11
        if q.mins is not None:
            bound = bound + expand_to(q.mins, spec, q.shape).abs() * 2.0**-11
        assert ((back - w).abs() <= bound * (1 + 1e-3) + 1e-6).all()


def test_every_scheme_is_tested_and_none_is_float():
    assert set(SCHEMES) == set(REL_ERROR) | {"none"}
    assert scheme("none").weight is None
    assert scheme("W8A8").activations.strategy == "token" and scheme("W8A8").activations.dynamic


def test_unknown_scheme_lists_the_names():
    with pytest.raises(InvalidRequestError, match="unknown quantization scheme 'int3'.*w4a16-asym.*nvfp4"):
        scheme("int3")


def test_group_size_must_divide_the_inputs():
    with pytest.raises(ValueError, match="multiple of"):
        quantize(torch.randn(8, 48), scheme("w4a16-g64").weight)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(8, 48), scheme("q4_1").weight)


def _gguf_test_weights() -> np.ndarray:
    w = _weights(48, 256, seed=3).numpy() * 0.05
    w[0, :32] = 0  # an all-zero block
    w[1, :32] = 0.25  # a constant block
    w[2, 32:64] = -np.abs(w[2, 32:64])  # all negative: Q4_0's signed maximum
    w[4, 64:96] *= 1e-4  # tiny values (fp16 scale subnormals)
    return w.astype(np.float32)


@pytest.mark.parametrize("gguf_type", NATIVE)
def test_gguf_blocks_equal_gguf_py(gguf_type):
    qtype = GGMLQuantizationType[gguf_type]
    w = _gguf_test_weights()
    raw = gguf_quantize(w, qtype)
    ours = from_blocks(raw, gguf_type, w.shape)
    assert ours.spec == gguf_spec(gguf_type)
    expected = gguf_dequantize(raw, qtype).reshape(w.shape)
    assert torch.equal(dequantize(ours), torch.from_numpy(expected))  # bit-exact
    assert np.array_equal(to_blocks(ours), raw.reshape(w.shape[0], -1))  # lossless both ways
    quantized = quantize(torch.from_numpy(w), gguf_spec(gguf_type))
    assert np.array_equal(to_blocks(quantized), raw.reshape(w.shape[0], -1))  # llama.cpp's rounding


def test_q8_0_rounding_is_half_away_from_zero():
    """ggml's roundf on every float32 the Q8_0 quantizer may meet: exact halves away from zero, the float below 0.5
    to 0 (where adding 0.5 in float32 would round up), against the same in float64 (exact for these inputs)."""
    ties = np.array([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 0.0, -0.0], dtype=np.float32)
    below_half = np.nextafter(np.float32(0.5), np.float32(0))
    x = np.concatenate([ties, [below_half, -below_half],
                        np.random.default_rng(0).uniform(-127, 127, 10_000).astype(np.float32)])
    wide = x.astype(np.float64)
    assert np.array_equal(_round_away(x), np.sign(wide) * np.floor(np.abs(wide) + 0.5))


def test_canonical_codes_ranges():
    w = torch.from_numpy(_gguf_test_weights())
    q40, q41 = quantize(w, gguf_spec("Q4_0")), quantize(w, gguf_spec("Q4_1"))
    assert q40.codes.dtype == torch.int8 and int(q40.codes.min()) >= -8 and int(q40.codes.max()) <= 7
    assert int(q41.codes.min()) >= 0 and int(q41.codes.max()) <= 15 and q41.mins is not None
    assert q40.scales.dtype == torch.float16 and q40.scales.shape == (48, 8)


def test_bad_block_bytes():
    with pytest.raises(ValueError, match="expected"):
        from_blocks(np.zeros(33, np.uint8), "Q8_0", (1, 32))
    with pytest.raises(ValueError, match="not a GGUF block format"):
        to_blocks(quantize(torch.randn(4, 32), scheme("int8").weight))


def test_k_quant_dequantizes_with_a_log_line(caplog):
    w = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    raw = gguf_quantize(w, GGMLQuantizationType.Q8_0)  # the fallback takes any gguf-py type
    with caplog.at_level("INFO", logger="glmserve.quant.gguf_blocks"):
        values = dequantize_other("blk.0.ffn_up.weight", raw, GGMLQuantizationType.Q8_0, (4, 256))
    assert "blk.0.ffn_up.weight is Q8_0" in caplog.text
    assert torch.equal(values, torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q8_0)))
