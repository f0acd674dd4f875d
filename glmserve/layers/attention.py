"""Dense attention over the paged KV cache (pure PyTorch, CPU and CUDA).

Per step the runner builds one `AttentionMetadata` shared by every layer. The flat batch
holds decode tokens first (one per sequence), then prefill chunks. Each layer:
1. writes its new K/V into the cache pool at `slot_mapping` (one index_copy_),
2. decode group: gathers each sequence's keys/values by slot index and runs one batched
   grouped-query attention (no expansion of KV heads),
3. prefill group: a single fresh prefill uses SDPA's causal kernel on the new K/V; otherwise
   the queries are padded per sequence and attend to their gathered context under a mask.

Sparse decode (`glmserve.sparse`): when the decode group carries per-row settings (`sparse`), each
non-dense row attends only to the slots its mode's scorer (`indexers[mode]`, fed on every write via
`on_kv_written`) and the selection rule pick; both decode paths take those slots + lengths. Prefill
stays dense.

KV streaming (glmserve/kv/offload.py): rows whose sequence has chunks outside the pool (`cold`) see
only their resident keys in `kv_slots`; both groups then attend to the resident part and to each cold
chunk's slice of this layer in turn, merged by log-sum-exp (glmserve/layers/partial_attention.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from glmserve.errors import InvalidRequestError
from glmserve.kv.slots import slots_of
from glmserve.layers.cpu_kernels import paged_decode_lse_op, paged_decode_op
from glmserve.layers.partial_attention import attention_with_lse, merge_attention
from glmserve.sparse.indexer import Indexer, ScoringRows
from glmserve.sparse.pinning import QuestionObservation
from glmserve.sparse.selection import SparseRows, keep_mask, select_slots
from glmserve.sparse_settings import SparseAttentionParams

if TYPE_CHECKING:
    from glmserve.kv.offload import ColdChunk, RunningKVOffload

# (a chunk's K/V slice [2, Hkv, T, D], a row's queries) -> (out, log-sum-exp) over that slice
PartAttention = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ColdRows:
    """Rows of a group whose sequence has KV chunks outside the pool, and where to stream them from."""

    rows: list[int]
    chunks: list[list[ColdChunk]]
    source: RunningKVOffload
    params: list[SparseAttentionParams] | None = None  # decode group: the rows' own sparse settings
    pins: list[torch.Tensor | None] | None = None  # decode group: the rows' question pins (sparse/pinning.py)


@dataclass
class GroupMetadata:
    kv_slots: torch.Tensor  # [B, L] slot index of each key position (padding points at slot 0)
    key_mask: torch.Tensor | None  # bool, True = attend: [B, 1, L] decode, [B, 1, Q, L] prefill; None if fresh
    num_tokens: int  # flat tokens of this group
    query_index: torch.Tensor | None = None  # [B, Q] flat token index per padded query (prefill)
    valid_index: torch.Tensor | None = None  # [num_tokens] positions in the padded [B*Q] grid
    fresh_causal: bool = False  # one sequence, no cached context: causal attention on new K/V
    context_lens: torch.Tensor | None = None  # [B] int64, decode group: keys per sequence
    block_tables: torch.Tensor | None = None  # [B, W] physical block ids, decode group
    sparse: SparseRows | None = None  # decode group: per-row sparse settings; None = every row dense
    cold: ColdRows | None = None  # rows with offloaded chunks (their kv_slots list resident keys only)
    observe: QuestionObservation | None = None  # prefill group: rows whose prompt ends here choose their pinned units

    def scoring_rows(self) -> ScoringRows:
        """The decode group's rows as the sparse scorers read them (glmserve/sparse/indexer.py)."""
        return ScoringRows(self.kv_slots, self.context_lens, self.block_tables)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decode: GroupMetadata | None
    prefill: GroupMetadata | None


class PagedAttention:
    """Attention for one layer against its slice of the KV pool ([2, kv_heads, slots, head_dim]).

    Head-major layout: a gather by slot gives [kv_heads, B, L, D] whose leading dims merge, so the
    batched matmuls of decode read it without another copy.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None
        self.indexers: dict[str, Indexer] = {}  # sparse mode -> this layer's scorer
        self.layer_index = 0  # position among the model's layers (set by its bind_kv_cache)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H*D]."""
        cache = self.kv_cache
        assert cache is not None, "KV cache not allocated"
        cache[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(cache.dtype))
        cache[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(cache.dtype))
        for indexer in self.indexers.values():
            indexer.on_kv_written(meta.slot_mapping, k, cache)
        outs = []
        offset = 0
        if meta.decode is not None:
            n = meta.decode.num_tokens
            outs.append(self._decode(q[:n], meta.decode))
            offset = n
        if meta.prefill is not None:
            outs.append(self._prefill(q[offset:], k[offset:], v[offset:], meta.prefill))
            if meta.prefill.observe is not None:
                meta.prefill.observe.record(q, self)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _gather(self, slots: torch.Tensor, dtype: torch.dtype, cache: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L] slots of `cache` ([2, Hkv, slots, D], default this layer's pool) -> keys, values [Hkv, B, L, D]."""
        cache = self.kv_cache if cache is None else cache
        b, length = slots.shape
        flat = slots.reshape(-1)
        shape = (self.num_kv_heads, b, length, self.head_dim)
        keys = cache[0].index_select(1, flat).view(shape).to(dtype)
        values = cache[1].index_select(1, flat).view(shape).to(dtype)
        return keys, values

    def select(self, q: torch.Tensor, g: GroupMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode queries q [B, H, D] -> (slots [B, L_sel], lengths [B]) each row attends to."""
        rows = g.sparse
        modes = rows.modes - {"dense"}
        missing = modes - self.indexers.keys()
        if missing:
            raise InvalidRequestError(f"sparse attention mode(s) {sorted(missing)} have no scorer on this layer")
        scoring = g.scoring_rows()
        scores = {m: self.indexers[m].unit_scores(q, scoring) for m in modes}
        units = {m: self.indexers[m].unit_size for m in modes}
        return select_slots(scores, units, g.context_lens, rows, g.kv_slots, rows.pins)

    def _decode(self, q: torch.Tensor, g: GroupMetadata) -> torch.Tensor:
        slots, lengths = (g.kv_slots, g.context_lens) if g.sparse is None else self.select(q, g)
        kernel = paged_decode_op() if q.device.type == "cpu" and q.dtype == torch.float32 else None
        if kernel is not None and g.cold is None:  # reads K/V in place from the pool: no gather copy
            return kernel(q.contiguous(), self.kv_cache[0], self.kv_cache[1], slots, lengths, self.scale)
        cold = g.cold
        apart = set() if cold is None else {  # block-sparse rows with offloaded chunks select over everything
            row for row, chunks, params in zip(cold.rows, cold.chunks, cold.params)
            if params.mode == "block" and chunks[0].bounds_shape is not None}
        if apart:  # their dense resident part is not needed: one key each
            lengths = lengths.clone()
            lengths[sorted(apart)] = 1
        out, lse = self._decode_partial(q, self.kv_cache, slots, lengths)
        for i, (row, chunks) in enumerate([] if cold is None else zip(cold.rows, cold.chunks)):
            if row in apart:
                out[row] = self._decode_block_sparse_streamed(q[row:row + 1], g, row, chunks, cold.params[i],
                                                              cold.pins[i])
                continue
            out[row] = self._merge_streamed(
                q[row:row + 1], out[row:row + 1], lse[row:row + 1], chunks, cold.source,
                lambda kv, q_row: self._decode_partial(q_row, kv, *_positions(
                    torch.arange(kv.shape[2], device=q.device))))[0]
        return out

    def _merge_streamed(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, chunks: list[ColdChunk],
                        source: RunningKVOffload, attend: PartAttention) -> torch.Tensor:
        """One row's result over its resident keys (out, lse) merged with `attend(kv, q)` over each offloaded
        chunk's slice of this layer, streamed in order; returns the merged out."""
        for kv in source.stream_layer(chunks, self.layer_index, q.device, q.dtype):
            out, lse = merge_attention(out, lse, *attend(kv, q))
        return out

    def _decode_block_sparse_streamed(self, q: torch.Tensor, g: GroupMetadata, row: int, chunks: list[ColdChunk],
                                      params: SparseAttentionParams, pins: torch.Tensor | None) -> torch.Tensor:
        """One block-sparse row whose sequence has offloaded chunks, q [1, H, D] -> [H, D]: its resident blocks
        are scored from the pool's bounds, its offloaded ones from the bounds kept with each chunk; the usual
        rule picks positions over the whole context; only the offloaded blocks holding a picked token are read
        back, and one attention call covers the resident and the read picks. Its question pins (`pins` [P],
        glmserve/sparse/pinning.py, chosen over the whole context) count as everywhere else."""
        indexer = self.indexers["block"]
        unit = indexer.unit_size  # == the pool's block size
        source, layer = g.cold.source, self.layer_index
        span_start, chunk_tokens = chunks[0].start, chunks[0].tokens
        span_end = span_start + len(chunks) * chunk_tokens
        ctx = int(g.context_lens[row]) + span_end - span_start
        table = g.block_tables[row:row + 1]
        ctx_t = torch.tensor([ctx], device=q.device)
        positions = torch.arange(ctx, device=q.device)
        slots = slots_of(table, positions[None], unit)[0]  # offloaded positions: the null block
        scores = indexer.unit_scores(q, ScoringRows(slots[None], ctx_t, table))
        # offloaded blocks read the null block (kv/slots.py table_tensor): scored from the bounds kept with their chunks
        bounds = torch.cat([chunk.read_bounds(layer) for chunk in chunks]).to(q.device)
        scores[0, span_start // unit:span_end // unit] = indexer.bound_scores(q, bounds.view(1, bounds.shape[0], -1))[0]
        keep = keep_mask(scores, unit, ctx_t, SparseRows.from_params([params], q.device), ctx,
                         None if pins is None else pins[None])[0]
        picked = keep.nonzero()[:, 0]
        streamed = (picked >= span_start) & (picked < span_end)
        resident = picked[~streamed]
        k, v = (part[:, 0] for part in self._gather(slots[resident][None], q.dtype))  # [Hkv, L, D] each
        cold = picked[streamed] - span_start
        if cold.numel():
            blocks_per_chunk = chunk_tokens // unit
            blocks = torch.unique(cold // unit)  # offloaded blocks holding a pick, ascending
            per_chunk = blocks // blocks_per_chunk
            needed = torch.unique(per_chunk).tolist()
            source.count_skipped(len(chunks) - len(needed))
            source.count_streamed(len(needed))
            read = torch.cat([chunks[i].read_blocks(layer, blocks[per_chunk == i] - i * blocks_per_chunk)
                              for i in needed], dim=2).to(q.device, q.dtype)  # [2, Hkv, blocks * unit, D]
            places = torch.searchsorted(blocks, cold // unit) * unit + cold % unit  # picks among the read tokens
            k = torch.cat([k, read[0].index_select(1, places)], dim=1)
            v = torch.cat([v, read[1].index_select(1, places)], dim=1)
        out, _ = self._decode_partial(q, torch.stack([k, v]), *_positions(torch.arange(k.shape[1], device=q.device)))
        return out[0]

    def _decode_partial(self, q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, D] over the first `lengths` of `slots` [B, L] in `cache` ([2, Hkv, slots, D])
        -> out [B, H, D], log-sum-exp [B, H] (float32)."""
        kernel = paged_decode_lse_op() if q.device.type == "cpu" and q.dtype == torch.float32 else None
        if kernel is not None:
            out, lse = kernel(q.contiguous(), cache[0], cache[1], slots, lengths, self.scale)
            return out, lse
        keys, values = self._gather(slots, q.dtype, cache)  # [Hkv, B, L, D]
        mask = torch.arange(slots.shape[1], device=q.device)[None, :] < lengths[:, None]  # [B, L]
        out, lse = attention_with_lse(q[:, :, None], keys.transpose(0, 1), values.transpose(0, 1), self.scale,
                                      mask[:, None, None, :])
        return out[:, :, 0], lse[:, :, 0]

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: GroupMetadata) -> torch.Tensor:
        if g.fresh_causal:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
            )
            return out[0].transpose(0, 1)
        keys, values = self._gather(g.kv_slots, q.dtype)
        b, qlen = g.query_index.shape
        qp = q[g.query_index.reshape(-1)].view(b, qlen, self.num_heads, self.head_dim).transpose(1, 2)
        if g.cold is None:
            out = F.scaled_dot_product_attention(
                qp, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=g.key_mask, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )  # [B, H, Q, D]
        else:  # rows with offloaded chunks merge in each chunk's keys (all before their queries)
            out, lse = attention_with_lse(qp, keys.transpose(0, 1), values.transpose(0, 1), self.scale, g.key_mask)
            for row, chunks in zip(g.cold.rows, g.cold.chunks):
                out[row] = self._merge_streamed(
                    qp[row:row + 1], out[row:row + 1], lse[row:row + 1], chunks, g.cold.source,
                    lambda kv, q_row: attention_with_lse(q_row, kv[0][None], kv[1][None], self.scale))[0]
        out = out.transpose(1, 2).reshape(b * qlen, self.num_heads, self.head_dim)
        return out[g.valid_index]


def _positions(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's key indices [L] -> (slots [1, L], lengths [1]) for `_decode_partial`."""
    return index[None].contiguous(), torch.tensor([index.shape[0]], device=index.device)
