"""Hand-computed cases for the 4-bit findings of bench/RESULTS.md (quantization quality): round to nearest W4 asym
group 32 on a weight that already is one Q4_1 block (per 32 inputs a float minimum m and step d, values m + k d),
and the fine-grained FP8 activation tiles with a shorter last tile."""

from __future__ import annotations

import torch

from glmserve.quant.compressed_tensors import QuantizedModule, decode, dense_weight, encode
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize, fake_quantize_activations
from glmserve.quant.schemes import FP8_GROUP128, FP8_TOKENS, scheme

D = 0.0625  # a power of two: the block's step, exact in fp16
CODES = torch.tensor([k % 16 for k in range(32)])  # every code 0..15 (twice): the block spans m .. m + 15 d


def _q4_1_block(m_steps: float) -> torch.Tensor:
    """One row of 32 inputs: Q4_1 values m + k d with m = -m_steps * d."""
    return ((CODES - m_steps) * D).reshape(1, 32)


def test_rtn_asym_reproduces_a_q4_1_block_whose_minimum_is_on_the_grid():
    w = _q4_1_block(7.0)  # m = -7 d: an integer zero point holds it
    q = quantize(w, scheme("w4a16-asym").weight)
    assert q.scales.item() == D and q.zeros.item() == 7
    assert torch.equal(q.codes.long().reshape(-1), CODES)
    assert torch.equal(dequantize(q), w)


def test_rtn_asym_shifts_an_off_grid_q4_1_block_by_the_zero_points_rounding():
    """m = -7.3 d: step (max - min) / 15 = d exactly, zero point round(7.3) = 7, codes round(k - 0.3) = k, so every
    value comes back as (k - 7) d = w + 0.3 d: one constant offset per block (the cause of RTN W4's loss on the
    Q4_1-derived SmolLM2), while the file's own Q4_1 format (a float minimum) holds the block exactly."""
    w = _q4_1_block(7.3)
    q = quantize(w, scheme("w4a16-asym").weight)
    assert q.scales.item() == D and q.zeros.item() == 7
    assert torch.equal(q.codes.long().reshape(-1), CODES)
    assert torch.allclose(dequantize(q) - w, torch.full_like(w, 0.3 * D), atol=1e-7)
    q41 = quantize(w, scheme("q4_1").weight)
    assert torch.allclose(dequantize(q41), w, atol=1e-4)  # fp16 minimum: -0.45625 is within fp16's 2^-11 step


def test_compressed_tensors_round_trip_keeps_the_block_codes_and_zero_point():
    """Export / import of that block: signed codes k - 8 and zero point 7 - 8 = -1 in the file, back to k and 7."""
    w = torch.cat([_q4_1_block(7.3), _q4_1_block(3.0)])
    q = quantize(w, scheme("w4a16-asym").weight)
    tensors = encode(QuantizedModule(q))
    back = decode(tensors, q.spec, None)
    assert torch.equal(back.weight.codes, q.codes) and torch.equal(back.weight.zeros, q.zeros)
    assert back.weight.zeros.reshape(-1).tolist() == [7, 3]
    assert torch.equal(dense_weight(back), dequantize(q))


def test_fp8_tiles_scale_each_128_inputs_and_the_shorter_last_tile_alone():
    """192 inputs = one tile of 128 and one of 64. Tile 1's absmax is 448 * 1024 (scale 1024); tile 2 holds E4M3
    values times 2^-10 (scale 2^-10): each comes back exactly under its own scale, while one scale per token
    (1024) flushes tile 2 to zero."""
    x = torch.zeros(1, 192)
    x[0, 0], x[0, 1] = 448.0 * 1024, 3.0 * 1024
    tail = torch.tensor([448.0, 1.125, -0.5, 0.015625]) * 2.0 ** -10
    x[0, 130:134] = tail
    got = fake_quantize_activations(x, FP8_GROUP128)
    assert torch.equal(got, x)
    per_token = fake_quantize_activations(x, FP8_TOKENS)
    assert torch.equal(per_token[0, :128], x[0, :128]) and not per_token[0, 128:].any()


def test_fp8_tiles_equal_tile_by_tile_rounding_on_576_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 576, generator=g)
    x[:, 7] *= 300
    got = fake_quantize_activations(x, FP8_GROUP128)
    for t0 in range(0, 576, 128):  # 4 tiles of 128, then 64
        part = x[:, t0:t0 + 128]
        assert torch.equal(got[:, t0:t0 + 128], fake_quantize_activations(part, FP8_TOKENS))


def _q4_1_weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """A weight exactly on GGUF Q4_1 grids, as the embedded model's dequantized tensors are: per 32 inputs a float16
    step d and minimum m (m < 0 < m + 15 d) and codes 0..15, each block using both 0 and 15 (as llama.cpp's
    min/max rounding makes it), w = d * q + m in float32."""
    g = torch.Generator().manual_seed(seed)
    blocks = inp // 32
    d = (torch.rand(out, blocks, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (-d * (1 + 13 * torch.rand(out, blocks, 1, generator=g))).half().float()
    q = torch.randint(0, 16, (out, blocks, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).reshape(out, inp)


def test_rtn_float_min_reproduces_a_q4_1_grid_exactly():
    """Round to nearest with a float minimum (w4a16-fmin) recovers every block's d, m and codes bit for bit, and the
    weight; the integer zero point cannot (its zero point rounds -m / d, shifting whole blocks)."""
    w = _q4_1_weight(48, 96)
    q = quantize(w, scheme("w4a16-fmin").weight)
    blocks = w.reshape(48, 3, 32)
    assert q.scales.dtype == q.mins.dtype == torch.float16 and q.zeros is None
    assert torch.equal(q.mins.float(), blocks.amin(-1))
    assert torch.equal(dequantize(q), w)
    asym = dequantize(quantize(w, scheme("w4a16-asym").weight))
    assert (asym - w).abs().amax() > 1e-4


def test_rtn_float_min_on_an_off_grid_weight_is_within_half_a_step_and_no_worse_than_llama_cpp():
    """On a continuous weight, w4a16-fmin rounds each value to within half its block's step (its codes rounded
    against the stored float16 d and m), and its squared error is not above llama.cpp's Q4_1 (which rounds against
    the float32 d and m before storing them in float16)."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    ours = quantize(w, scheme("w4a16-fmin").weight)
    err = (dequantize(ours) - w).reshape(16, 2, 32).abs()
    assert (err <= ours.scales.float().unsqueeze(-1) * (0.5 + 2 ** -10)).all()
    q41 = dequantize(quantize(w, scheme("q4_1").weight))
    assert (dequantize(ours) - w).square().sum() <= (q41 - w).square().sum()


def test_gptq_with_an_identity_hessian_is_round_to_nearest_for_the_float_min():
    """GPTQ with H = I has no correlations to spread errors over: its codes are round to nearest's, and it keeps
    the float minimums (also without act order, where it sets each group's grid itself)."""
    from glmserve.quant.calibrate import gptq

    w = _q4_1_weight(8, 64, seed=1)
    spec = scheme("w4a16-fmin").weight
    for act_order in (True, False):
        q = gptq(w, torch.eye(64), spec, act_order=act_order)
        assert q.mins is not None and q.zeros is None and q.mins.dtype == torch.float16
        assert torch.equal(dequantize(q), w)


def test_compressed_tensors_round_trip_keeps_the_float_minimum():
    """The float minimum travels as a float32 zero point -m / d - 8 and comes back as the same float16 m."""
    w = _q4_1_weight(16, 64, seed=2)
    q = quantize(w, scheme("w4a16-fmin").weight)
    tensors = encode(QuantizedModule(q))
    assert tensors["weight_zero_point"].dtype == torch.float32
    back = decode(tensors, q.spec, None).weight
    assert torch.equal(back.mins, q.mins) and torch.equal(back.scales, q.scales) and back.zeros is None
    assert torch.equal(dequantize(back), w)
