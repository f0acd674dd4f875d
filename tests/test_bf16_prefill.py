"""Prefill in bf16 on AMX CPUs: attention (layers/attention.py `prefill_compute_dtype`: which groups take it,
its error against the float32 SDPA on the fresh causal and the gathered-context paths) and the MLP's
activations between two bf16 GEMMs (layers/linear.py `bf16_between`, models/llama.py GatedMLP). The AMX
check is monkeypatched (and the AVX512-BF16 one set to False with it, but in the test of that rule), so these run
on any CPU (bf16 SDPA and GEMMs run everywhere, only slower without AMX; the kernels' `dequantize_packed` is in
every build)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glmserve import kernels
from glmserve.layers import attention
from glmserve.layers.attention import (
    BF16_ATTENTION_ENV,
    BF16_MIN_TOKENS,
    AttentionMetadata,
    GroupMetadata,
    PagedAttention,
    prefill_compute_dtype,
)
from glmserve.layers.linear import BF16_ACTIVATIONS_ENV, QuantizedLinear, bf16_between
from glmserve.layers.param_loading import Shard
from glmserve.models.llama import GatedMLP
from glmserve.quant.cpu_backend import AMX_GEMM_ENV, DENSE_MIN_ROWS
from glmserve.quant.schemes import scheme

HEADS, KV_HEADS, DIM, NULL = 9, 3, 64, 16  # SmolLM2-135M's attention; slots below NULL are never written


@pytest.fixture
def amx(monkeypatch):
    """Sets whether the CPU counts as having AMX (and no AVX512-BF16 without it): returns a setter."""
    def set_amx(value: bool) -> None:
        monkeypatch.setattr(kernels, "amx_bf16", lambda: value)
        monkeypatch.setattr(kernels, "avx512_bf16", lambda: False)
    return set_amx


def test_bf16_only_for_large_float32_cpu_groups_on_amx(amx, monkeypatch):
    q = torch.zeros(4, HEADS, DIM)
    amx(True)
    assert prefill_compute_dtype(q, BF16_MIN_TOKENS) == torch.bfloat16
    assert prefill_compute_dtype(q, BF16_MIN_TOKENS - 1) == torch.float32  # decode-sized: float32
    # a short chunk over a long cached context: its attention is the work (its keys are bf16 in the pool anyway)
    assert prefill_compute_dtype(q, 32, num_keys=4032) == torch.bfloat16
    assert prefill_compute_dtype(q, 32, num_keys=BF16_MIN_TOKENS - 1) == torch.float32
    assert prefill_compute_dtype(q.double(), 4096) == torch.float64  # only float32 queries change
    monkeypatch.setenv(BF16_ATTENTION_ENV, "0")
    assert prefill_compute_dtype(q, 4096) == torch.float32
    monkeypatch.delenv(BF16_ATTENTION_ENV)
    amx(False)  # AVX2-only or non-AMX CPUs keep float32
    assert prefill_compute_dtype(q, 4096) == torch.float32


def test_bf16_without_amx_only_where_our_kernel_runs(monkeypatch):
    """On an AVX512-BF16 CPU without AMX torch's bf16 SDPA is no faster than float32
    (bench/bench_prefill_attention.py), so a group takes bf16 only where our kernel runs its head dim."""
    monkeypatch.setattr(kernels, "amx_bf16", lambda: False)
    monkeypatch.setattr(kernels, "avx512_bf16", lambda: True)
    monkeypatch.setattr(attention, "bf16_prefill_kernel", lambda head_dim: print if head_dim == DIM else None)
    q = torch.zeros(4, HEADS, DIM)
    assert prefill_compute_dtype(q, BF16_MIN_TOKENS) == torch.bfloat16
    assert prefill_compute_dtype(q, BF16_MIN_TOKENS - 1) == torch.float32
    assert prefill_compute_dtype(torch.zeros(4, HEADS, 96), 4096) == torch.float32  # a head dim it does not take
    monkeypatch.setenv(BF16_ATTENTION_ENV, "0")
    assert prefill_compute_dtype(q, 4096) == torch.float32
    monkeypatch.delenv(BF16_ATTENTION_ENV)
    monkeypatch.setattr(attention, "bf16_prefill_kernel", lambda head_dim: None)  # GLMSERVE_AMX_ATTENTION=0
    assert prefill_compute_dtype(q, 4096) == torch.float32


def layer(context: int, gen: torch.Generator) -> PagedAttention:
    """A layer with a pool of NULL + 1024 slots whose first `context` keys after NULL are written."""
    attn = PagedAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    attn.kv_cache = torch.zeros(2, KV_HEADS, NULL + 1024, DIM)
    attn.kv_cache[:, :, NULL:NULL + context] = torch.randn(2, KV_HEADS, context, DIM, generator=gen)
    return attn


def fresh_meta(t: int) -> AttentionMetadata:
    g = GroupMetadata(kv_slots=torch.empty(1, 0, dtype=torch.long), key_mask=None, num_tokens=t, fresh_causal=True)
    return AttentionMetadata(slot_mapping=torch.arange(NULL, NULL + t), decode=None, prefill=g)


def chunk_meta(context: int, t: int) -> AttentionMetadata:
    """One sequence's chunk of `t` queries after `context` cached keys: causal mask over context + t keys."""
    length = context + t
    mask = torch.arange(length)[None, :] <= (context + torch.arange(t))[:, None]
    g = GroupMetadata(kv_slots=torch.arange(NULL, NULL + length)[None], key_mask=mask[None, None], num_tokens=t,
                      query_index=torch.arange(t)[None], valid_index=torch.arange(t))
    return AttentionMetadata(slot_mapping=torch.arange(NULL + context, NULL + length), decode=None, prefill=g)


def run(amx, enabled: bool, context: int, t: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    attn = layer(context, gen)
    q = torch.randn(t, HEADS, DIM, generator=gen)
    k, v = torch.randn(2, t, KV_HEADS, DIM, generator=gen)
    amx(enabled)
    meta = fresh_meta(t) if context == 0 else chunk_meta(context, t)
    return attn(q, k, v, meta)


@pytest.mark.parametrize("context", [0, 300], ids=["fresh-causal", "cached-context"])
def test_bf16_prefill_is_within_bf16_rounding_of_float32(amx, context):
    t = BF16_MIN_TOKENS + 40
    ref = run(amx, False, context, t)
    out = run(amx, True, context, t)
    assert out.dtype == torch.float32 and out.shape == ref.shape == (t, HEADS * DIM)
    rel = ((out - ref).norm() / ref.norm()).item()
    # q, k, v and the output each rounded to bf16 (2^-9 relative): measured ~3.4e-3; exact equality would
    # mean the bf16 path was not taken
    assert 0 < rel < 1e-2
    assert (out - ref).abs().max().item() < 5e-2


def test_a_short_chunk_over_a_long_context_takes_bf16_a_short_prompt_does_not(amx):
    """A few queries after BF16_MIN_TOKENS or more cached keys (a prefix-cache hit's suffix) take bf16 attention: the
    keys are the work; a short fresh prompt or a chunk over few keys stays float32 (the same floats as without AMX)."""
    t = 8
    ref = run(amx, False, 4 * BF16_MIN_TOKENS, t)
    rel = ((run(amx, True, 4 * BF16_MIN_TOKENS, t) - ref).norm() / ref.norm()).item()
    assert 0 < rel < 1e-2
    for context in (0, BF16_MIN_TOKENS - t - 1):
        assert torch.equal(run(amx, True, context, t), run(amx, False, context, t)), context


def test_flag_off_is_the_float32_path_exactly(amx, monkeypatch):
    t = BF16_MIN_TOKENS
    ref = run(amx, False, 0, t)
    monkeypatch.setenv(BF16_ATTENTION_ENV, "0")
    assert torch.equal(run(amx, True, 0, t), ref)


def quantized_mlp(hidden: int, inter: int, gen: torch.Generator) -> GatedMLP:
    """A GatedMLP whose gate-up and down are int4 (group 32) QuantizedLinears on our CPU kernels."""
    mlp = GatedMLP(hidden, inter)
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    weights = [torch.randn(n, k, generator=gen) * k**-0.5 for n, k in shapes]
    gate_up = QuantizedLinear(hidden, [inter, inter], scheme("w4a16"), False, torch.device("cpu"), torch.float32)
    down = QuantizedLinear(inter, [hidden], scheme("w4a16"), False, torch.device("cpu"), torch.float32)
    for i, w in enumerate(weights[:2]):
        gate_up.load_weight("weight", w, Shard(part=i))
    down.load_weight("weight", weights[2], Shard(part=None))
    gate_up.finalize()
    down.finalize()
    mlp.gate_up_proj, mlp.down_proj = gate_up, down
    return mlp


def test_mlp_keeps_bf16_between_its_gemms_only_where_both_run_bf16(amx, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    amx(True)  # read when the weights are prepared (quant/cpu_backend.py dense_path_for)
    if not kernels.isa.amx_bf16():  # the real CPU: without AMX tiles the dense path runs oneDNN's bf16 F.linear
        monkeypatch.setenv(AMX_GEMM_ENV, "0")
    mlp = quantized_mlp(128, 320, gen)
    x = torch.randn(DENSE_MIN_ROWS + 5, 128, generator=gen)
    assert bf16_between(x, mlp.gate_up_proj, mlp.down_proj)
    assert not bf16_between(x[:DENSE_MIN_ROWS - 1], mlp.gate_up_proj, mlp.down_proj)  # decode-sized: int8 tiles
    assert not bf16_between(x, mlp.gate_up_proj, torch.nn.Linear(320, 128))  # a float layer: no bf16 input
    out = mlp(x)
    assert out.dtype == torch.float32
    gate, up = F.linear(x, mlp.gate_up_proj.weight).split(320, dim=-1)  # the dequantized weights, in float32
    ref = F.linear(F.silu(gate) * up, mlp.down_proj.weight)
    monkeypatch.setenv(BF16_ACTIVATIONS_ENV, "0")
    assert not bf16_between(x, mlp.gate_up_proj, mlp.down_proj)
    widened = mlp(x)  # the same bf16 GEMMs, float32 between them
    # bf16 roundings of activations, weights and outputs (2^-9 relative each) against float32 on the same
    # int4 weights: measured ~4e-3 either way
    for y in (out, widened):
        assert ((y - ref).norm() / ref.norm()).item() < 1e-2
    # silu_and_mul (kernels/csrc/prefill_ops.cpp) computes from the bf16 gate-up in float32 and rounds once, as
    # the widened path's cast before down does: keeping bf16 between the GEMMs costs no accuracy
    assert torch.equal(out, widened)
