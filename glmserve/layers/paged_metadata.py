"""The metadata builder of paged attention (`PagedAttention`, layers/attention.py): a step's rows ->
complete decode and prefill groups (`AttentionMetadata`), with tensor ops once per step.

`StepRows` is what every attention backend's builder takes from the runner (the MLA builder of
models/glm_moe_dsa.py too); `key_slots` and `padded_queries` are the pieces both backends share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from glmserve.kv.slots import slots_of
from glmserve.layers.attention import AttentionMetadata, GroupMetadata
from glmserve.layers.offloaded_attention import OffloadedRows
from glmserve.sparse.selection import SparseRows
from glmserve.sparse_settings import SparseAttentionParams

if TYPE_CHECKING:
    from glmserve.kv.offload import OffloadedSpan, RunningKVOffload
    from glmserve.sparse.pinning import QuestionObservation


@dataclass
class StepRows:
    """A step's rows as the attention metadata builders take them: decode rows (one new token) first, then
    prefill chunks; tensors on the CPU unless said."""

    tables: torch.Tensor  # [B, W] each row's block table, padded with the null block 0
    starts: torch.Tensor  # [B] tokens computed before this step
    lens: torch.Tensor  # [B] tokens of this step
    positions: torch.Tensor  # [T] position of each flat token (on the device)
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes (on the device)
    block_size: int
    device: torch.device
    sparse: list[SparseAttentionParams]  # each row's sparse settings
    pins: list[torch.Tensor | None]  # each row's question pins (sparse/pinning.py)
    decode_pins: torch.Tensor | None  # the decode rows' pins as one [B, P] tensor (-1 padding), or None
    spans: list[OffloadedSpan | None]  # each row's offloaded chunks in `offload`, or None
    offload: RunningKVOffload | None
    observe: QuestionObservation | None  # prefill rows whose prompt ends here choose their pinned units

    @property
    def num_decode(self) -> int:
        return int((self.lens == 1).sum())

    @property
    def first_tokens(self) -> torch.Tensor:
        """[B] flat index of each row's first token."""
        return torch.cumsum(self.lens, 0) - self.lens


def key_slots(tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
              offloaded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows' resident keys: (positions [B, L], in_context [B, L], slots [B, L]) for rows of `context_lens`
    keys whose (start, length) `offloaded` [B, 2] are offloaded (None: all resident). Slots past a row's keys
    (padding, the unwritten tail of its last block) are the zeroed null block's: masked scores times
    uninitialized values could otherwise give NaN."""
    offloaded = torch.zeros((len(context_lens), 2), dtype=torch.long) if offloaded is None else offloaded
    offloaded_start, offloaded_len = offloaded[:, :1], offloaded[:, 1:]
    resident = context_lens - offloaded_len[:, 0]
    j = torch.arange(int(resident.max()))[None, :]
    key_pos = torch.where(j < offloaded_start, j, j + offloaded_len)
    in_context = j < resident[:, None]
    slots = torch.where(in_context, slots_of(tables, key_pos, block_size), 0)
    return key_pos, in_context, slots


def padded_queries(lens: torch.Tensor, query_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill rows as padded queries: (query_index [B, Q] group-local token of each, padding repeating the
    row's last; valid_index [Tg] place of each real query in the [B * Q] grid)."""
    qi = torch.arange(int(lens.max()))
    query_index = query_offsets[:, None] + torch.minimum(qi[None, :], lens[:, None] - 1)
    valid = (qi[None, :] < lens[:, None]).reshape(-1).nonzero()[:, 0]
    return query_index, valid


def paged_metadata(rows: StepRows) -> AttentionMetadata:
    """The decode and prefill groups of paged attention for the step's rows."""
    n = rows.num_decode
    decode = _decode_group(rows, slice(0, n)) if n else None
    prefill = _prefill_group(rows, slice(n, len(rows.lens))) if n < len(rows.lens) else None
    return AttentionMetadata(slot_mapping=rows.slot_mapping, decode=decode, prefill=prefill)


def _decode_group(step: StepRows, rows: slice) -> GroupMetadata:
    dev = step.device
    g = _group(step, rows, None)
    spans = step.spans[rows]
    # a row with offloaded chunks selects apart (OffloadedRows.params, see PagedAttention._decode)
    params = [p if sp is None else SparseAttentionParams() for p, sp in zip(step.sparse[rows], spans)]
    if g.offloaded is not None:
        g.offloaded.params = [step.sparse[r] for r in g.offloaded.rows]
        g.offloaded.pins = [step.pins[r] for r in g.offloaded.rows]
    if any(p.mode != "dense" for p in params):  # rows all dense: the dense fast path
        g.sparse = SparseRows.from_params(params, dev, step.decode_pins)
    if g.sparse is not None or g.offloaded is not None:
        g.block_tables = step.tables[rows].to(dev)
    return g


def _prefill_group(step: StepRows, rows: slice) -> GroupMetadata:
    """The prefill rows as one group; several rows without offloaded chunks get one group each (`rows` of the
    group): a padded group of B rows costs B x longest chunk x longest context with a full mask, where rows of
    100..1,000 tokens apart need a few times less (and a fresh row takes the causal kernel on its own K/V)."""
    if len(step.lens[rows]) > 1 and all(sp is None for sp in step.spans[rows]):
        parts = [_group(step, slice(r, r + 1), torch.zeros(1, dtype=torch.long)) for r in range(rows.start, rows.stop)]
        return GroupMetadata(kv_slots=torch.empty(0), key_mask=None, num_tokens=sum(p.num_tokens for p in parts),
                             rows=parts, observe=step.observe)
    first = step.first_tokens[rows]
    g = _group(step, rows, first - first[0])
    g.observe = step.observe
    return g


def _group(step: StepRows, rows: slice, query_offsets: torch.Tensor | None) -> GroupMetadata:
    """The decode group (`query_offsets` None) or the prefill group of `rows`; keys are listed without the
    rows' offloaded chunks (resident keys only)."""
    dev = step.device
    tables, starts, lens, spans = step.tables[rows], step.starts[rows], step.lens[rows], step.spans[rows]
    num_tokens = int(lens.sum())
    if query_offsets is not None and len(lens) == 1 and int(starts[0]) == 0:
        return GroupMetadata(kv_slots=torch.empty(0), key_mask=None, num_tokens=num_tokens, fresh_causal=True)
    offloaded = torch.tensor([(sp.start, sp.length) if sp else (0, 0) for sp in spans], dtype=torch.long).view(-1, 2)
    key_pos, in_context, kv_slots = key_slots(tables, starts + lens, step.block_size, offloaded)
    offloaded_rows = [i for i, sp in enumerate(spans) if sp is not None]
    group_offloaded = (OffloadedRows(offloaded_rows, [spans[i].chunks for i in offloaded_rows], step.offload)
                       if offloaded_rows else None)
    if query_offsets is None:  # decode: one query per row
        mask = in_context[:, None, :]  # [B, 1, L] against scores [Hkv, B, g, L]
        return GroupMetadata(kv_slots=kv_slots.to(dev), key_mask=mask.to(dev), num_tokens=num_tokens,
                             context_lens=(starts + lens - offloaded[:, 1]).to(dev), offloaded=group_offloaded)
    query_pos = starts[:, None] + torch.arange(int(lens.max()))[None, :]  # [B, Q]
    mask = ((key_pos[:, None, :] <= query_pos[:, :, None]) & in_context[:, None, :])[:, None]  # [B, 1, Q, L]
    query_index, valid = padded_queries(lens, query_offsets)
    resident = group_offloaded is None  # every key of every row listed: the AMX kernel's lengths (attention.py)
    return GroupMetadata(
        kv_slots=kv_slots.to(dev), key_mask=mask.to(dev), num_tokens=num_tokens,
        query_index=query_index.to(dev), valid_index=valid.to(dev), offloaded=group_offloaded,
        query_lens=lens.long() if resident else None, key_lens=(starts + lens).long() if resident else None,
    )
