"""Our causal float32 prefill attention (kernels op `prefill_attention_f32`, csrc/prefill_attention_f32.cpp: the avx2
build's, for CPUs without AVX-512) against torch's float32 SDPA on the same inputs: float32 and bf16 K/V, grouped-query
heads, head dims 64 and 128, lengths around its tiles (8 queries) and key blocks (32), strided K/V as a fused qkv
output gives them; the same floats on one thread and two; clear errors on bad input; the other variants report it
unavailable; and the attention layer's fresh prefill on it against the same layer on SDPA (which prompts longer than
F32_KERNEL_MAX_TOKENS keep). Runs wherever the CPU
runs the avx2 build (on AVX-512 machines too, through GLMSERVE_CPU_ISA=avx2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glmserve import kernels
from glmserve.kernels import build
from glmserve.layers import attention
from glmserve.layers.attention import AMX_ATTENTION_ENV, AttentionMetadata, GroupMetadata, PagedAttention

CPU = torch.device("cpu")
needs_avx2 = pytest.mark.skipif("avx2" not in kernels.available_isas(), reason="this CPU does not run the avx2 build")


@pytest.fixture
def op(monkeypatch):
    """The avx2 build's kernel (skips where it did not build; with CI=true a failed build raises)."""
    monkeypatch.setenv("GLMSERVE_CPU_ISA", "avx2")
    kernel = kernels.op("prefill_attention_f32", CPU, torch.float32)
    if kernel is None:
        pytest.skip("the avx2 kernels did not build")
    return kernel


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 causal SDPA of q [T, Hq, D] over k, v [T, Hk, D] (their values as float32)."""
    qf, kf, vf = (x.float().transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def inputs(t: int, hq: int, hk: int, d: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, d, generator=gen) for h in (hq, hk, hk))


@needs_avx2
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "d"), [((9, 3), 64), ((4, 4), 64), ((8, 2), 128)])
@pytest.mark.parametrize("t", [1, 7, 8, 31, 33, 100, 257])
def test_kernel_matches_float32_sdpa(op, kv_dtype, heads, d, t):
    q, k, v = inputs(t, *heads, d, seed=t + d)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    out = op(q, k, v, d**-0.5)
    want = reference(q, k, v, d**-0.5)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@needs_avx2
def test_strided_kv_of_a_fused_projection(op):
    t, hq, hk, d = 70, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(5))
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    torch.testing.assert_close(op(q, k, v, 0.125), reference(q, k, v, 0.125), atol=2e-5, rtol=1e-4)
    q_heads_major = q.transpose(0, 1).contiguous().transpose(0, 1)  # q's strides are free
    assert torch.equal(op(q_heads_major, k, v, 0.125), op(q, k, v, 0.125))


@needs_avx2
def test_threads_split_the_work_without_changing_the_result(op):
    q, k, v = inputs(300, 9, 3, 64, seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = op(q, k, v, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_avx2
def test_bad_input_is_a_clear_error(op):
    q, k, v = inputs(8, 4, 2, 64)
    with pytest.raises(RuntimeError, match="q must be float32"):
        op(q.half(), k, v, 0.125)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        op(q, k, v.bfloat16(), 0.125)
    with pytest.raises(RuntimeError, match="with q's T and D"):
        op(q, k[:4], v[:4], 0.125)
    with pytest.raises(RuntimeError, match="multiple of Hk"):
        op(q[:, :3], k, v, 0.125)
    with pytest.raises(RuntimeError, match="D of 16"):
        op(q[..., :56], k[..., :56], v[..., :56], 0.125)


def test_other_variants_report_it_unavailable():
    for isa in kernels.available_isas():
        module = build.load("prefill_attention_f32", isa)
        if module is not None:
            assert module.prefill_attention_f32_available() == (isa == "avx2"), isa


HEADS, KV_HEADS, DIM, NULL = 9, 3, 64, 16


def fresh_prefill(monkeypatch, kernel_on: bool, t: int, pool_dtype: torch.dtype) -> torch.Tensor:
    """One layer's fresh prefill of `t` tokens (float32 model, `pool_dtype` pool), on our kernel or on SDPA."""
    monkeypatch.setenv(AMX_ATTENTION_ENV, "1" if kernel_on else "0")
    gen = torch.Generator().manual_seed(4)
    attn = PagedAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    attn.kv_cache = torch.zeros(2, KV_HEADS, NULL + t, DIM, dtype=pool_dtype)
    q = torch.randn(t, HEADS, DIM, generator=gen)
    k, v = torch.randn(2, t, KV_HEADS, DIM, generator=gen)
    g = GroupMetadata(kv_slots=torch.empty(1, 0, dtype=torch.long), key_mask=None, num_tokens=t, fresh_causal=True)
    return attn(q, k, v, AttentionMetadata(slot_mapping=torch.arange(NULL, NULL + t), decode=None, prefill=g))


@needs_avx2
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_layer_on_the_kernel_matches_sdpa(op, monkeypatch, pool_dtype):
    ours = fresh_prefill(monkeypatch, True, 150, pool_dtype)
    sdpa = fresh_prefill(monkeypatch, False, 150, pool_dtype)
    assert ours.shape == sdpa.shape == (150, HEADS * DIM)
    torch.testing.assert_close(ours, sdpa, atol=2e-5, rtol=1e-4)
    assert not torch.equal(ours, sdpa)  # two paths: their float sums differ in the last bits
    monkeypatch.setattr(attention, "F32_KERNEL_MAX_TOKENS", 149)  # longer prompts keep SDPA
    assert torch.equal(fresh_prefill(monkeypatch, True, 150, pool_dtype), sdpa)
