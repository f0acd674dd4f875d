"""Our causal float32 prefill attention (kernels op `prefill_attention_f32`, csrc/prefill_attention_f32.cpp: the avx2
build's, for CPUs without AVX-512) against torch's float32 SDPA with the causal mask at the queries' offset, on the same
inputs: fresh prompts and chunks over cached keys, several rows in one call, float32 and bf16 K/V, grouped-query heads,
head dims 64 and 128, lengths around its tiles (8 queries), work items (32) and key blocks (32), strided K/V as a fused
qkv output and the pool's gather give them; the same floats on one thread and two; clear errors on bad input; the other
variants report it unavailable; and the attention layer's prefill on it (fresh, and over cached context) against the
same layer on SDPA. Runs wherever the CPU runs the avx2 build (on AVX-512 machines too: GLMSERVE_CPU_ISA=avx2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glmserve import kernels
from glmserve.kernels import build
from tests.prefill_layer import DIM, HEADS, layer_output

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
    """float32 SDPA of q [T, Hq, D] over k, v [S, Hk, D] (their values as float32), query i at position S - T + i."""
    t, s = q.shape[0], k.shape[0]
    mask = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]
    qf, kf, vf = (x.float().transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def inputs(t: int, s: int, hq: int, hk: int, d: int, seed: int = 0):
    """q [t, hq, d], k and v [s, hk, d]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, hq, d, generator=gen), *(torch.randn(s, hk, d, generator=gen) for _ in range(2))


def one_row(op, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The kernel on one row: q's T queries at the end of k's S keys."""
    return op(q, k[None], v[None], torch.tensor([q.shape[0]]), torch.tensor([k.shape[0]]), scale)


@needs_avx2
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "d"), [((9, 3), 64), ((4, 4), 64), ((8, 2), 128)])
@pytest.mark.parametrize("t", [1, 7, 8, 31, 33, 100, 257])
@pytest.mark.parametrize("cached", [0, 45])
def test_kernel_matches_float32_sdpa(op, kv_dtype, heads, d, t, cached):
    q, k, v = inputs(t, t + cached, *heads, d, seed=t + d + cached)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    out = one_row(op, q, k, v, d**-0.5)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out, reference(q, k, v, d**-0.5), atol=2e-5, rtol=1e-4)


@needs_avx2
def test_rows_of_one_call_match_each_row_alone(op):
    """A fresh prompt, chunks over cached keys (one of no queries) and a single query, their keys padded to one length
    in the head-major layout the layer gathers from the pool ([Hk, B, L, D] permuted; junk past each row's keys)."""
    rows = [(70, 70), (33, 140), (0, 12), (1, 300), (64, 64 + 32)]  # (queries, keys)
    parts = [inputs(t, s, 9, 3, 64, seed=i) for i, (t, s) in enumerate(rows)]
    length = max(s for _, s in rows) + 5
    k = torch.full((3, len(rows), length, 64), float("nan"))
    v = torch.full((3, len(rows), length, 64), 7.0)
    for b, (_, kb, vb) in enumerate(parts):
        k[:, b, :kb.shape[0]] = kb.transpose(0, 1)
        v[:, b, :vb.shape[0]] = vb.transpose(0, 1)
    q = torch.cat([p[0] for p in parts])
    out = op(q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), torch.tensor([t for t, _ in rows]),
             torch.tensor([s for _, s in rows]), 0.125)
    assert out.shape == q.shape
    for part, got in zip(parts, out.split([t for t, _ in rows])):
        torch.testing.assert_close(got, reference(*part, 0.125), atol=2e-5, rtol=1e-4)
        assert torch.equal(got, one_row(op, *part, 0.125))  # each row computed alone


@needs_avx2
def test_strided_kv_of_a_fused_projection(op):
    t, hq, hk, d = 70, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(5))
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    torch.testing.assert_close(one_row(op, q, k, v, 0.125), reference(q, k, v, 0.125), atol=2e-5, rtol=1e-4)
    q_heads_major = q.transpose(0, 1).contiguous().transpose(0, 1)  # q's strides are free
    assert torch.equal(one_row(op, q_heads_major, k, v, 0.125), one_row(op, q, k, v, 0.125))


@needs_avx2
def test_threads_split_the_work_without_changing_the_result(op):
    q, k, v = inputs(300, 420, 9, 3, 64, seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = one_row(op, q, k, v, 0.125)
        torch.set_num_threads(2)
        two = one_row(op, q, k, v, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_avx2
def test_bad_input_is_a_clear_error(op):
    q, k, v = inputs(8, 8, 4, 2, 64)
    lens = torch.tensor([8])
    with pytest.raises(RuntimeError, match="q must be float32"):
        op(q.bfloat16(), k[None], v[None], lens, lens, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        op(q.half(), k[None], v[None], lens, lens, 0.125)
    with pytest.raises(RuntimeError, match="k and v of one dtype"):
        op(q, k[None], v[None].bfloat16(), lens, lens, 0.125)
    with pytest.raises(RuntimeError, match="q_lens sum to 7"):
        op(q, k[None], v[None], torch.tensor([7]), lens, 0.125)
    with pytest.raises(RuntimeError, match="queries <= keys"):
        op(q, k[None], v[None], lens, torch.tensor([9]), 0.125)
    with pytest.raises(RuntimeError, match="not a multiple"):
        op(q[:, :3], k[None], v[None], lens, lens, 0.125)
    with pytest.raises(RuntimeError, match="a multiple of 16"):
        op(q[..., :56], k[None, ..., :56], v[None, ..., :56], lens, lens, 0.125)
    with pytest.raises(RuntimeError, match="q \\[T, Hq, D\\], k and v \\[B, L, Hk, D\\]"):
        op(q, k, v, lens, lens, 0.125)


def test_other_variants_report_it_unavailable():
    for isa in kernels.available_isas():
        module = build.load("prefill_attention_f32", isa)
        if module is not None:
            assert module.prefill_attention_f32_available() == (isa == "avx2"), isa


@needs_avx2
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context", [0, 300], ids=["fresh-causal", "cached-context"])
def test_layer_on_the_kernel_matches_sdpa(op, monkeypatch, pool_dtype, context):
    ours = layer_output(monkeypatch, True, context, 150, pool_dtype)
    sdpa = layer_output(monkeypatch, False, context, 150, pool_dtype)
    assert ours.dtype == torch.float32 and ours.shape == sdpa.shape == (150, HEADS * DIM)
    torch.testing.assert_close(ours, sdpa, atol=2e-5, rtol=1e-4)
    assert not torch.equal(ours, sdpa)  # two paths: their float sums differ in the last bits
