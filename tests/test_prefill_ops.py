"""The fused layer ops of kernels/csrc/prefill_ops.cpp (add_rms_norm, rope_neox_, rope_store_kv, silu_and_mul), every
instruction-set variant against plain PyTorch: exact where the math is (the residual add), within float32
rounding (norm, rope, SiLU's exp) or one bf16 rounding (2^-8 relative) otherwise, on rows whose width is and is
not a multiple of the vector width; and the model code that
calls them (layers/norm.py `add_norm`, layers/rotary.py `apply_`, models/llama.py `silu_and_mul`) equal to
its PyTorch path."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from glmserve import kernels
from glmserve.kv.kv_format import format_of, kv_format
from glmserve.layers.norm import RMSNorm
from glmserve.layers.rotary import RotaryEmbedding
from glmserve.models.llama import silu_and_mul

CPU = torch.device("cpu")
BF16_ROUNDING = 2.0**-8  # one round to nearest in bf16 (8 bits of mantissa), relative


def _op(name: str, dtype: torch.dtype = torch.float32):
    kernel = kernels.op(name, CPU, dtype)
    assert kernel is not None
    return kernel


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-6)).max().item()


@pytest.mark.parametrize("hidden", [576, 83])  # 83: rows that end in a partial vector (the masked tail)
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
def test_add_rms_norm(cpu_isa, delta_dtype, hidden):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, hidden, generator=gen) * 3
    delta = None if delta_dtype is None else torch.randn(37, hidden, generator=gen).to(delta_dtype)
    weight = torch.rand(hidden, generator=gen) + 0.5
    summed = x if delta is None else x + delta.float()
    ref = F.rms_norm(summed, (hidden,), weight, 1e-5)
    for bf16_out in (False, True):
        stream = x.clone()
        out = _op("add_rms_norm")(stream, delta if delta is not None else torch.empty(0), weight, 1e-5, bf16_out)
        assert torch.equal(stream, summed)  # the residual add is exact
        assert out.dtype == (torch.bfloat16 if bf16_out else torch.float32)
        assert _relative(out, ref) < (BF16_ROUNDING if bf16_out else 1e-5)


def test_add_rms_norm_rejects_bad_input(cpu_isa):
    norm = _op("add_rms_norm")
    with pytest.raises(RuntimeError, match="contiguous float32"):
        norm(torch.randn(4, 8).t(), torch.empty(0), torch.ones(4), 1e-5, False)
    with pytest.raises(RuntimeError, match="delta"):
        norm(torch.randn(4, 8), torch.randn(4, 7), torch.ones(8), 1e-5, False)
    with pytest.raises(RuntimeError, match="weight"):
        norm(torch.randn(4, 8), torch.empty(0), torch.ones(7), 1e-5, False)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rope_neox_in_place(cpu_isa, partial):
    config = types.SimpleNamespace(rope_theta=10000.0, partial_rotary_factor=partial)
    rotary = RotaryEmbedding(config, 64, 4096)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(29, 15 * 64, generator=gen)
    qk = qkv[:, :12 * 64].view(29, 12, 64)  # q and k heads of a fused qkv output: rows strided by 15 heads
    positions = torch.randint(0, 4096, (29,), generator=gen)
    cos, sin = rotary.cos_sin(positions)
    ref = rotary.apply(qk, cos, sin)
    v = qkv[:, 12 * 64:].clone()
    _op("rope_neox_")(qk, cos[:, 0].contiguous(), sin[:, 0].contiguous())
    assert (qk - ref).abs().max().item() < 1e-5
    assert torch.equal(qkv[:, 12 * 64:], v)  # the v heads are not touched
    with pytest.raises(RuntimeError, match="even"):
        _op("rope_neox_")(qk, cos[:, 0, :3].contiguous(), sin[:, 0, :3].contiguous())


@pytest.mark.parametrize("dim", [64, 40])  # 40: half-rows of 20 (a partial vector)
def test_rope_neox_in_place_on_bf16_rows(cpu_isa, dim):
    """bf16 q/k heads of a fused bf16 qkv output: rotated in float32 and rounded once, as the float32 rotation of the
    same values rounded to bf16; the v heads untouched."""
    rotary = RotaryEmbedding(types.SimpleNamespace(rope_theta=10000.0), dim, 4096)
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(33, 15 * dim, generator=gen).to(torch.bfloat16)
    qk = qkv[:, :12 * dim].view(33, 12, dim)
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (33,), generator=gen))
    ref = rotary.apply(qk.float(), cos, sin)
    v = qkv[:, 12 * dim:].clone()
    _op("rope_neox_", torch.bfloat16)(qk, cos[:, 0].contiguous(), sin[:, 0].contiguous())
    assert qk.dtype == torch.bfloat16
    assert ((qk.float() - ref).abs() <= ref.abs() * BF16_ROUNDING + 1e-6).all()  # one rounding of the float32 result
    assert torch.equal(qkv[:, 12 * dim:], v)
    assert (rotary.apply_(qkv[:, :12 * dim].view(33, 12, dim).clone(), cos, sin).dtype == torch.bfloat16)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(("dim", "partial"), [(64, 1.0), (40, 0.5)])  # 40 / 0.5: a partial vector, partial rope
def test_rope_store_kv_equals_rope_then_store(cpu_isa, cache_dtype, dim, partial):
    """The decode step's rope + KV write in one pass: bit for bit rope_neox_ on the fused qkv rows, then store_kv,
    with q returned contiguous and k as the cache holds it (kv_format's roundtrip); qkv itself unchanged."""
    heads, kv_heads, t, num_slots = 6, 2, 5, 64
    rotary = RotaryEmbedding(types.SimpleNamespace(rope_theta=10000.0, partial_rotary_factor=partial), dim, 4096)
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen) * 3
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (t,), generator=gen))
    cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
    slots = torch.randperm(num_slots, generator=gen)[:t]
    width = kv_format(cache_dtype).row_width(dim)  # int8 rows: codes, then the scale
    ref_cache = (torch.randn(2, kv_heads, num_slots, width, generator=gen) * 30).to(cache_dtype)
    cache = ref_cache.clone()
    ref = qkv.clone().view(t, -1, dim)
    _op("rope_neox_")(ref[:, :heads + kv_heads], cos, sin)
    q_ref, k_ref, v_ref = ref.split((heads, kv_heads, kv_heads), dim=1)
    _op("store_kv")(ref_cache[0], ref_cache[1], slots, k_ref, v_ref)
    before = qkv.clone()
    q, k = _op("rope_store_kv")(qkv, heads, cos, sin, cache[0], cache[1], slots)
    assert torch.equal(qkv, before)
    assert q.is_contiguous() and torch.equal(q, q_ref)
    assert torch.equal(k, format_of(ref_cache).roundtrip(k_ref))
    assert torch.equal(cache, ref_cache)
    with pytest.raises(RuntimeError, match="outside"):
        _op("rope_store_kv")(qkv, heads, cos, sin, cache[0], cache[1], slots + num_slots)
    with pytest.raises(RuntimeError, match="qkv"):
        _op("rope_store_kv")(qkv[:, 1:], heads, cos, sin, cache[0], cache[1], slots)


@pytest.mark.parametrize("inter", [1536, 45])  # 45: rows that end in a partial vector (the masked tail)
def test_silu_and_mul(cpu_isa, inter):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(41, 2 * inter, generator=gen) * 4
    x[0, :8] = torch.tensor([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, 1e-30])  # the exp's clamps
    ref = F.silu(x[:, :inter]) * x[:, inter:]
    assert _relative(_op("silu_and_mul")(x), ref) < 1e-5
    xb = x.to(torch.bfloat16)
    ref_b = F.silu(xb[:, :inter].float()) * xb[:, inter:].float()  # from the same bf16 inputs, in float32
    out = _op("silu_and_mul", torch.bfloat16)(xb)
    assert out.dtype == torch.bfloat16 and _relative(out, ref_b) < BF16_ROUNDING
    with pytest.raises(RuntimeError, match="2I"):
        _op("silu_and_mul")(torch.randn(3, 5))


def test_model_ops_match_their_torch_path(kernel_backend):
    """The callers give the same result with the kernels (each variant) as on the PyTorch path."""
    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64, generator=gen) + 0.5
    x, delta = torch.randn(9, 64, generator=gen), torch.randn(9, 64, generator=gen)
    stream = x.clone()
    out = norm.add_norm(stream, delta, torch.bfloat16)
    assert torch.equal(stream, x + delta)
    assert out.dtype == torch.bfloat16
    assert _relative(out, F.rms_norm(x + delta, (64,), norm.weight, 1e-6)) < BF16_ROUNDING

    rotary = RotaryEmbedding(types.SimpleNamespace(rope_theta=500000.0), 64, 128)
    qk = torch.randn(9, 4, 64, generator=gen)
    cos, sin = rotary.cos_sin(torch.arange(9))
    ref = rotary.apply(qk, cos, sin)
    assert (rotary.apply_(qk, cos, sin) - ref).abs().max().item() < 1e-5

    gate_up = torch.randn(9, 2 * 32, generator=gen)
    assert _relative(silu_and_mul(gate_up), F.silu(gate_up[:, :32]) * gate_up[:, 32:]) < 1e-5
