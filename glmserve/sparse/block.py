"""Training-free block indexer: per-block key bounds and query-aware upper-bound scores.

Follows Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", arXiv:2406.10774): for each KV block and kv head keep the element-wise min and max of
its keys; for a query q the largest q.k any key of the block can reach is
    sum_d max(q_d * min_d, q_d * max_d) = relu(q) . max + min(q, 0) . min,
computed as two matmuls. Our own implementation on glmserve's paged pool:

- bounds live beside the KV pool, indexed by the same physical block ids: one block-major tensor
  `bounds` [num_blocks, 2, Hkv, D] per layer (min, max; one block's bounds are contiguous, so the
  gather of a row's blocks copies whole rows) — 1 / block_size of the K/V pool's size (min and max
  of the keys per block, against keys and values per token);
- they are maintained on every write (`on_kv_written`): a write at offset 0 of a block restarts its
  bounds from that key (a fresh or reused block always starts there), then the new keys are folded in
  with a scatter min/max. No infinities are ever stored, so blocks never written (the null block,
  padding) score 0 without NaN. A prefix-cache hit reuses the same physical block, whose bounds still
  describe exactly the tokens it holds; a partial last block is bounded by the keys written so far;
  blocks whose K/V is loaded straight into the pool (KV tiers, sessions) are recomputed from the pool
  (`refresh`, a `KVBlockIO` load listener); with a quantized KV format (glmserve/kv/kv_format.py) both bound
  the dequantized keys that attention reads, so the bounds stay exact;
- on CPU in float32 both the bounds update and the scores run in our C++ kernels
  (glmserve/kernels/csrc/sparse.cpp; the scores read each row's bounds in place by block table);
  elsewhere scatter min/max and a gather + one matrix-vector product compute the same numbers;
- one score per block and decode row: the sum over the query heads of their scaled upper bounds
  (selection is per row for all heads, since our decode kernel takes one slot list per row). We first
  took the maximum over heads (keep a block if any head could want it); on SmolLM2 passkey retrieval
  at ~2K tokens (6 keys, answer decoded) the sum found the key 6/6 at budgets 512 and 256 where the
  maximum found it 3/6 and 1/6 (dense: 5/6): one head's loose bound decides too often, while the sum,
  like the head-summed attention the learned indexer distills, ranks blocks by what the heads agree on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from glmserve import kernels
from glmserve.kv.kv_format import dequantize
from glmserve.sparse.indexer import ScoredLayer, ScoringRows, attach_indexers


class BlockIndexer:
    """Quest-style key bounds of one attention layer; implements `glmserve.sparse.indexer.Indexer`."""

    def __init__(self, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int, scale: float,
                 dtype: torch.dtype, device: torch.device):
        self.unit_size = block_size
        self.scale = scale
        # torch.empty: a block's pages are only touched (counted in RSS) once its keys are written, and its first
        # key resets its bounds (on_kv_written); block 0 is the null block that padded table entries point at
        self.bounds = torch.empty((num_blocks, 2, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.bounds[0].zero_()

    @property
    def lo(self) -> torch.Tensor:
        return self.bounds[:, 0]

    @property
    def hi(self) -> torch.Tensor:
        return self.bounds[:, 1]

    def on_kv_written(self, slot_mapping: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> None:
        """k [T, Hkv, D] was written at slot_mapping [T]: blocks written from offset 0 restart from that key,
        then every new key is folded in."""
        bounds_update = kernels.op("bounds_update", k.device, k.dtype)
        if bounds_update is not None:  # one sequential pass in C++: a few microseconds per decode token
            in_place = k.stride(-1) == 1 and k.stride(-2) == k.shape[-1]  # a token's heads together: no copy
            bounds_update(slot_mapping.contiguous(), k if in_place else k.contiguous(), self.bounds, self.unit_size)
            return
        blocks = slot_mapping // self.unit_size
        keys = k.to(self.bounds.dtype)
        starts = (slot_mapping % self.unit_size == 0).nonzero()[:, 0]
        self.bounds.index_copy_(0, blocks[starts], keys[starts, None].expand(-1, 2, -1, -1))
        index = blocks.view(-1, 1, 1).expand_as(keys)
        self.lo.scatter_reduce_(0, index, keys, reduce="amin")
        self.hi.scatter_reduce_(0, index, keys, reduce="amax")

    def refresh(self, blocks: torch.Tensor, cache: torch.Tensor) -> None:
        """Recomputes the bounds of whole `blocks` from the pool (cache [2, Hkv, slots, W], any KV format): for
        K/V loaded into the pool without passing through attention (KV tiers, sessions)."""
        blocks = blocks.to(self.bounds.device)
        u = self.unit_size
        slots = (blocks[:, None] * u + torch.arange(u, device=blocks.device)).reshape(-1)
        rows = cache[0].index_select(1, slots).view(cache.shape[1], len(blocks), u, -1)
        keys = dequantize(rows, self.bounds.dtype)  # [Hkv, n, U, D]
        both = torch.stack([keys.amin(2), keys.amax(2)]).permute(2, 0, 1, 3)  # [n, 2, Hkv, D]
        self.bounds.index_copy_(0, blocks, both.to(self.bounds.dtype))

    def unit_scores(self, q: torch.Tensor, rows: ScoringRows) -> torch.Tensor:
        """q [B, H, D] -> [B, W]: per logical block, the sum over heads of the upper bound of the scaled logit."""
        tables = rows.block_tables  # [B, W]
        block_scores = kernels.op("block_scores", q.device, q.dtype)
        if block_scores is not None:  # reads the bounds in place: no gather copy
            units = (-(-rows.context_lens // self.unit_size)).contiguous()
            return block_scores(q.contiguous(), self.bounds, tables.contiguous(), units, self.scale)
        b, w = tables.shape
        nb = self.bounds.shape[0]
        bounds = self.bounds.view(nb, -1).index_select(0, tables.reshape(-1)).view(b, w, -1)  # [B, W, 2 * Hkv * D]
        return self.bound_scores(q, bounds)

    def bound_scores(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """q [B, H, D], bounds rows [B, W, 2 * Hkv * D] (a block's [2, Hkv, D] flattened) -> scores [B, W].

        The sum over heads is linear in the bounds: the negative parts of a kv head's query heads, summed,
        meet its min row part, the positive parts its max part; one matrix-vector product per row."""
        b = q.shape[0]
        _, _, hkv, d = self.bounds.shape
        qg = q.view(b, hkv, -1, d).float()
        vec = torch.stack([qg.clamp(max=0).sum(2), qg.clamp(min=0).sum(2)], dim=1)  # [B, 2, Hkv, D]
        bound = torch.bmm(rows.to(vec.dtype), vec.view(b, -1, 1))  # [B, W, 1]
        return bound[..., 0] * self.scale  # [B, W]


def block_bounds_bytes(layers: Sequence[ScoredLayer], dtype: torch.dtype) -> int:
    """Bytes of key bounds per KV block over all of a model's paged attention `layers`."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(2 * layer.num_kv_heads * layer.head_dim * size for layer in layers)


def gather_block_bounds(layers: Sequence[ScoredLayer], blocks: torch.Tensor) -> torch.Tensor:
    """The block indexer's bounds of `blocks` in every one of a model's `layers`: [layers, n, 2, Hkv, D] (kept
    with KV chunks that leave the pool, glmserve/kv/offload.py)."""
    bounds = [layer.indexers["block"].bounds for layer in layers]
    return torch.stack([b.index_select(0, blocks.to(b.device)) for b in bounds])


def refresh_block_bounds(layers: Sequence[ScoredLayer], blocks: torch.Tensor) -> None:
    """After K/V of `blocks` was loaded straight into the pool (`KVBlockIO` load listener): every layer's
    block indexer recomputes their bounds."""
    for layer in layers:
        if "block" in layer.indexers:
            layer.indexers["block"].refresh(blocks, layer.kv_cache)


def attach_block_indexers(layers: Sequence[ScoredLayer], num_blocks: int, block_size: int, dtype: torch.dtype,
                          device: torch.device) -> None:
    """A BlockIndexer for each of a model's paged attention `layers` (mode "block")."""
    attach_indexers(layers, "block", lambda i, layer: BlockIndexer(
        layer.num_kv_heads, layer.head_dim, num_blocks, block_size, layer.scale, dtype, device))
