"""One attention layer's prefill of a fresh prompt or of a chunk over cached context, with the metadata the engine
passes (layers/paged_metadata.py), on our prefill kernels or on torch's SDPA: shared by the kernels' layer tests."""

from __future__ import annotations

import pytest
import torch

from glmserve.layers.attention import AMX_ATTENTION_ENV, AttentionMetadata, GroupMetadata, PagedAttention

HEADS, KV_HEADS, DIM, NULL = 9, 3, 64, 16


def layer_output(monkeypatch: pytest.MonkeyPatch, kernel_on: bool, context: int, t: int,
                 pool_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One layer's prefill of `t` tokens after `context` cached ones (a `pool_dtype` pool), through our kernel
    (GLMSERVE_AMX_ATTENTION=1) or torch's SDPA (=0)."""
    monkeypatch.setenv(AMX_ATTENTION_ENV, "1" if kernel_on else "0")
    gen = torch.Generator().manual_seed(3)
    attn = PagedAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    attn.kv_cache = torch.zeros(2, KV_HEADS, NULL + context + t, DIM, dtype=pool_dtype)
    attn.kv_cache[:, :, NULL:NULL + context] = torch.randn(2, KV_HEADS, context, DIM, generator=gen)
    q = torch.randn(t, HEADS, DIM, generator=gen)
    k, v = torch.randn(2, t, KV_HEADS, DIM, generator=gen)
    length = context + t
    if context == 0:
        g = GroupMetadata(kv_slots=torch.empty(1, 0, dtype=torch.long), key_mask=None, num_tokens=t,
                          fresh_causal=True)
    else:
        mask = torch.arange(length)[None, :] <= (context + torch.arange(t))[:, None]
        g = GroupMetadata(kv_slots=torch.arange(NULL, NULL + length)[None], key_mask=mask[None, None], num_tokens=t,
                          query_index=torch.arange(t)[None], valid_index=torch.arange(t),
                          query_lens=torch.tensor([t]), key_lens=torch.tensor([length]))
    meta = AttentionMetadata(slot_mapping=torch.arange(NULL + context, NULL + length), decode=None, prefill=g)
    return attn(q, k, v, meta)
