"""Attention of rows whose sequence has KV chunks outside the pool (offloaded: glmserve/kv/offload.py).

Such rows list only their resident keys in the group's `kv_slots`. A prefill row or a dense decode row attends
to that resident part first, then to each offloaded chunk's slice of this layer in turn, read back in order and
merged by log-sum-exp (glmserve/layers/partial_attention.py). A block-sparse decode row whose chunks keep their
block bounds selects over its whole context instead: resident blocks scored from the pool's bounds, offloaded
ones from the bounds kept with each chunk, and only the offloaded blocks holding a picked token are read back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from glmserve.kv.kv_format import dequantize
from glmserve.kv.slots import slots_of
from glmserve.layers.partial_attention import (
    attention_with_lse,
    every_key,
    gather_kv,
    merge_attention,
    paged_attention_with_lse,
)
from glmserve.sparse.indexer import ScoredLayer, ScoringRows
from glmserve.sparse.selection import SparseRows, keep_mask
from glmserve.sparse_settings import SparseAttentionParams

if TYPE_CHECKING:
    from glmserve.kv.offload import OffloadedChunk, RunningKVOffload

# (a chunk's K/V slice [2, Hkv, T, D], a row's queries) -> (out, log-sum-exp) over that slice
PartAttention = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class OffloadedRows:
    """Rows of a group whose sequence has KV chunks outside the pool, and where to read them back from."""

    rows: list[int]
    chunks: list[list[OffloadedChunk]]
    source: RunningKVOffload
    params: list[SparseAttentionParams] | None = None  # decode group: the rows' own sparse settings
    pins: list[torch.Tensor | None] | None = None  # decode group: the rows' question pins (sparse/pinning.py)

    def select_apart(self) -> set[int]:
        """Decode rows in block mode whose chunks keep their bounds: they select over their whole context
        (`decode_block_sparse_offloaded`), so their dense resident part is not needed."""
        return {row for row, chunks, params in zip(self.rows, self.chunks, self.params)
                if params.mode == "block" and chunks[0].bounds_shape is not None}


def merge_offloaded(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, chunks: list[OffloadedChunk],
                    source: RunningKVOffload, layer_index: int, attend: PartAttention) -> torch.Tensor:
    """One row's result over its resident keys (out, lse) merged with `attend(kv, q)` over each offloaded
    chunk's slice of layer `layer_index`, read back in order; returns the merged out."""
    for kv in source.read_layer_slices(chunks, layer_index, q.device, q.dtype):
        out, lse = merge_attention(out, lse, *attend(kv, q))
    return out


def decode_offloaded(layer: ScoredLayer, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     offloaded: OffloadedRows, apart: set[int], context_lens: torch.Tensor,
                     block_tables: torch.Tensor | None) -> None:
    """Completes in place the decode rows of `offloaded` in out [B, H, D] (lse [B, H]: over their resident keys):
    the rows in `apart` (`OffloadedRows.select_apart`) are computed over their whole context, the others merge
    their offloaded chunks."""
    for i, (row, chunks) in enumerate(zip(offloaded.rows, offloaded.chunks)):
        if row in apart:
            out[row] = decode_block_sparse_offloaded(layer, q[row:row + 1], chunks, offloaded.source,
                                                     int(context_lens[row]), block_tables[row:row + 1],
                                                     offloaded.params[i], offloaded.pins[i])
            continue
        out[row] = merge_offloaded(
            q[row:row + 1], out[row:row + 1], lse[row:row + 1], chunks, offloaded.source, layer.layer_index,
            lambda kv, q_row: paged_attention_with_lse(q_row, kv, *every_key(kv.shape[2], q.device), layer.scale))[0]


def prefill_offloaded(layer: ScoredLayer, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      offloaded: OffloadedRows) -> None:
    """Completes in place the prefill rows of `offloaded` in out [B, H, Q, D] (padded queries q [B, H, Q, D], lse over
    their resident keys): each offloaded chunk's keys precede all of a row's queries, so no mask."""
    for row, chunks in zip(offloaded.rows, offloaded.chunks):
        out[row] = merge_offloaded(
            q[row:row + 1], out[row:row + 1], lse[row:row + 1], chunks, offloaded.source, layer.layer_index,
            lambda kv, q_row: attention_with_lse(q_row, kv[0][None], kv[1][None], layer.scale))[0]


def decode_block_sparse_offloaded(layer: ScoredLayer, q: torch.Tensor, chunks: list[OffloadedChunk],
                                  source: RunningKVOffload, resident_len: int, table: torch.Tensor,
                                  params: SparseAttentionParams, pins: torch.Tensor | None) -> torch.Tensor:
    """One block-sparse row whose sequence has offloaded chunks, q [1, H, D] -> [H, D] (`resident_len` keys in the
    pool, block table [1, W] with null entries for the offloaded blocks): its resident blocks are scored from the
    pool's bounds, its offloaded ones from the bounds kept with each chunk; the usual rule picks positions over
    the whole context; only the offloaded blocks holding a picked token are read back, and one attention call
    covers the resident and the read picks. Its question pins (`pins` [P], glmserve/sparse/pinning.py, chosen
    over the whole context) count as everywhere else."""
    indexer = layer.indexers["block"]
    unit = indexer.unit_size  # == the pool's block size
    index = layer.layer_index
    span_start, chunk_tokens = chunks[0].start, chunks[0].tokens
    span_end = span_start + len(chunks) * chunk_tokens
    ctx = resident_len + span_end - span_start
    ctx_t = torch.tensor([ctx], device=q.device)
    positions = torch.arange(ctx, device=q.device)
    slots = slots_of(table, positions[None], unit)[0]  # offloaded positions: the null block (kv/slots.py)
    scores = indexer.unit_scores(q, ScoringRows(slots[None], ctx_t, table))
    # offloaded blocks read the null block (kv/slots.py table_tensor): scored from the bounds kept with their chunks
    bounds = torch.cat([chunk.read_bounds(index) for chunk in chunks]).to(q.device)
    scores[0, span_start // unit:span_end // unit] = indexer.bound_scores(q, bounds.view(1, bounds.shape[0], -1))[0]
    keep = keep_mask(scores, unit, ctx_t, SparseRows.from_params([params], q.device), ctx,
                     None if pins is None else pins[None])[0]
    picked = keep.nonzero()[:, 0]
    in_span = (picked >= span_start) & (picked < span_end)
    resident = picked[~in_span]
    k, v = (part[:, 0] for part in gather_kv(layer.kv_cache, slots[resident][None], q.dtype))  # [Hkv, L, D] each
    picked_offloaded = picked[in_span] - span_start
    if picked_offloaded.numel():
        blocks_per_chunk = chunk_tokens // unit
        blocks = torch.unique(picked_offloaded // unit)  # offloaded blocks holding a pick, ascending
        per_chunk = blocks // blocks_per_chunk
        needed = torch.unique(per_chunk).tolist()
        source.count_skipped(len(chunks) - len(needed))
        source.count_read_slices(len(needed))
        read = dequantize(torch.cat([chunks[i].read_blocks(index, blocks[per_chunk == i] - i * blocks_per_chunk)
                                     for i in needed], dim=2).to(q.device), q.dtype)  # [2, Hkv, blocks * unit, D]
        # the picks' places among the read tokens
        places = torch.searchsorted(blocks, picked_offloaded // unit) * unit + picked_offloaded % unit
        k = torch.cat([k, read[0].index_select(1, places)], dim=1)
        v = torch.cat([v, read[1].index_select(1, places)], dim=1)
    out, _ = paged_attention_with_lse(q, torch.stack([k, v]), *every_key(k.shape[1], q.device), layer.scale)
    return out[0]
