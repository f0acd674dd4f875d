"""Attention over one part of the keys, with its log-sum-exp, and the merge of such parts.

Softmax attention over keys split into parts A and B equals the parts' outputs weighted by their share of
the normalizer: with lse_X = log sum_j exp(s_j) over part X,
    out = out_A * exp(lse_A - lse) + out_B * exp(lse_B - lse),   lse = log(exp(lse_A) + exp(lse_B)).
This is the merge of blockwise/flash attention (Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax"; Dao et al. 2022, FlashAttention); KV offload (glmserve/kv/offload.py) uses it to attend to chunks
that are not in the pool one at a time. Also here: the gather of K/V by slot and the paged decode attention
with its log-sum-exp that both the pool and the offloaded chunks go through.

On CPU the log-sum-exp comes from PyTorch's own flash kernel (`_scaled_dot_product_flash_attention_for_cpu`
returns it; grouped-query heads supported); elsewhere from matmuls in query tiles of bounded size.
"""

from __future__ import annotations

import torch

from glmserve import kernels
from glmserve.kv.kv_format import dequantize

QUERY_TILE = 256  # queries per matmul tile on the generic path


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, Q, D], k/v [B, Hkv, L, D], mask bool [B, 1, Q, L] (True = attend) or None
    -> out [B, H, Q, D] in q's dtype, lse [B, H, Q] float32. Every query must attend to at least one key."""
    if q.device.type == "cpu" and q.dtype == torch.float32:
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, lse.float()
    b, h, n, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, h // hkv, n, d)
    outs, lses = [], []
    for start in range(0, n, QUERY_TILE):
        scores = torch.matmul(qg[:, :, :, start:start + QUERY_TILE], k.unsqueeze(2).transpose(-1, -2)).float()
        scores = scores * scale  # [B, Hkv, g, q, L]
        if mask is not None:
            scores.masked_fill_(~mask[:, :, None, start:start + QUERY_TILE], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None]).to(v.dtype)
        outs.append(torch.matmul(probs, v.unsqueeze(2)))
        lses.append(lse)
    return torch.cat(outs, dim=3).reshape(b, h, n, d), torch.cat(lses, dim=3).reshape(b, h, n)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two parts' (out [..., D], lse [...]) -> the attention over both parts' keys."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse)[..., None].to(out_a.dtype) + out_b * torch.exp(lse_b - lse)[..., None].to(
        out_b.dtype)
    return out, lse


def gather_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] slots of `cache` ([2, Hkv, slots, W], any KV format) -> keys, values [Hkv, B, L, D] in `dtype`."""
    b, length = slots.shape
    flat = slots.reshape(-1)
    shape = (cache.shape[1], b, length, cache.shape[3])
    return (dequantize(cache[0].index_select(1, flat).view(shape), dtype),
            dequantize(cache[1].index_select(1, flat).view(shape), dtype))


def paged_attention_with_lse(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode queries q [B, H, D] over the first `lengths` [B] of `slots` [B, L] in `cache` ([2, Hkv, slots, W],
    any KV format) -> out [B, H, D], log-sum-exp [B, H] (float32). On CPU in float32 our C++ kernel reads K/V in
    place (quantized rows dequantized in the kernel)."""
    kernel = kernels.op("paged_decode_lse", q.device, q.dtype)
    if kernel is not None:
        out, lse = kernel(q.contiguous(), cache[0], cache[1], slots, lengths, scale)
        return out, lse
    keys, values = gather_kv(cache, slots, q.dtype)  # [Hkv, B, L, D]
    mask = torch.arange(slots.shape[1], device=q.device)[None, :] < lengths[:, None]  # [B, L]
    out, lse = attention_with_lse(q[:, :, None], keys.transpose(0, 1), values.transpose(0, 1), scale,
                                  mask[:, None, None, :])
    return out[:, :, 0], lse[:, :, 0]


def every_key(length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [1, L], lengths [1]) for `paged_attention_with_lse` over all `length` keys of a one-row cache."""
    return torch.arange(length, device=device)[None], torch.tensor([length], device=device)
