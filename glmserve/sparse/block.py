"""Training-free block indexer: per-block key bounds and query-aware upper-bound scores.

Follows Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", arXiv:2406.10774): for each KV block and kv head keep the element-wise min and max of
its keys; for a query q the largest q.k any key of the block can reach is
    sum_d max(q_d * min_d, q_d * max_d) = relu(q) . max + min(q, 0) . min,
computed as two matmuls. Our own implementation on glmserve's paged pool:

- bounds live beside the KV pool, indexed by the same physical block ids: one tensor
  [2, Hkv, num_blocks, D] per layer (min, max) — 2 / block_size of the K/V pool's size;
- they are maintained on every write (`on_kv_written`): a write at offset 0 of a block resets its
  bounds (a fresh or reused block always starts there), then the new keys are folded in with a
  scatter min/max. A prefix-cache hit reuses the same physical block, whose bounds still describe
  exactly the tokens it holds; a partial last block is bounded by the keys written so far;
- one score per block and decode row: the maximum over the query heads of the scaled upper bound
  (selection is per row for all heads, since our decode kernel takes one slot list per row, so a
  block is worth keeping when any head could give it a large logit; summing would let many heads
  with small logits outvote one head with a decisive one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from glmserve.layers.attention import GroupMetadata


class BlockIndexer:
    """Quest-style key bounds of one attention layer; implements `glmserve.sparse.indexer.Indexer`."""

    def __init__(self, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int, scale: float,
                 dtype: torch.dtype, device: torch.device):
        self.unit_size = block_size
        self.scale = scale
        self.bounds = torch.empty((2, num_kv_heads, num_blocks, head_dim), dtype=dtype, device=device)
        self.bounds[0].fill_(float("inf"))
        self.bounds[1].fill_(float("-inf"))

    def on_kv_written(self, slot_mapping: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> None:
        """k [T, Hkv, D] was written at slot_mapping [T]: reset blocks written from offset 0, fold keys in."""
        blocks = slot_mapping // self.unit_size
        fresh = blocks[slot_mapping % self.unit_size == 0]
        lo, hi = self.bounds[0], self.bounds[1]
        lo.index_fill_(1, fresh, float("inf"))
        hi.index_fill_(1, fresh, float("-inf"))
        keys = k.transpose(0, 1).to(self.bounds.dtype)  # [Hkv, T, D]
        index = blocks.view(1, -1, 1).expand_as(keys)
        lo.scatter_reduce_(1, index, keys, reduce="amin")
        hi.scatter_reduce_(1, index, keys, reduce="amax")

    def unit_scores(self, q: torch.Tensor, group: GroupMetadata) -> torch.Tensor:
        """q [B, H, D] -> [B, W] upper bound of the scaled logit per logical block (max over heads)."""
        tables = group.block_tables  # [B, W]
        b, w = tables.shape
        hkv, d = self.bounds.shape[1], self.bounds.shape[3]
        flat = tables.reshape(-1)
        lo = self.bounds[0].index_select(1, flat).view(hkv, b, w, d).float()
        hi = self.bounds[1].index_select(1, flat).view(hkv, b, w, d).float()
        # unwritten blocks (padding, the null block) hold +-inf bounds: give them zeros instead of NaN
        lo = torch.nan_to_num(lo, posinf=0.0, neginf=0.0)
        hi = torch.nan_to_num(hi, posinf=0.0, neginf=0.0)
        qg = q.float().view(b, hkv, -1, d).transpose(0, 1)  # [Hkv, B, g, D]
        bound = torch.matmul(qg.clamp(min=0), hi.transpose(-1, -2))
        bound += torch.matmul(qg.clamp(max=0), lo.transpose(-1, -2))  # [Hkv, B, g, W]
        return bound.amax(dim=(0, 2)) * self.scale  # [B, W]


def block_bounds_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of key bounds per KV block over all of the model's paged attention layers."""
    from glmserve.sparse.indexer import paged_attention_layers

    size = torch.empty((), dtype=dtype).element_size()
    return sum(2 * a.num_kv_heads * a.head_dim * size for a in paged_attention_layers(model))


def attach_block_indexers(model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                          device: torch.device) -> None:
    """A BlockIndexer for every paged attention layer of `model` (mode "block")."""
    from glmserve.sparse.indexer import attach_indexers

    attach_indexers(model, "block", lambda i, attn: BlockIndexer(
        attn.num_kv_heads, attn.head_dim, num_blocks, block_size, attn.scale, dtype, device))
