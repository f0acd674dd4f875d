"""The contract between sparse/ and the attention layers it scores, and how scorers attach to them.

sparse/ owns this contract and never imports layers/: a layer that runs sparse decode attention
(glmserve/layers/attention.py `PagedAttention`) satisfies `ScoredLayer`, and hands its scorers the rows
to score as `ScoringRows`.

A scorer ("indexer") belongs to one attention layer and serves one mode ("block", "learned"). Each layer
keeps its scorers in `ScoredLayer.indexers: dict[mode, Indexer]`. Models list their scored layers
(`paged_attention_layers()`, empty for MLA models) and the modes they serve (`sparse_modes()`);
sparse/ takes those lists and never walks a model.

    class Indexer(Protocol):
        unit_size: int
        def on_kv_written(self, slot_mapping, k, cache) -> None: ...
        def unit_scores(self, q, rows) -> torch.Tensor: ...

- `unit_size`: how many consecutive positions of a sequence one score covers. 16 (the KV block size)
  for the block indexer, 1 (token level) for the learned and native indexers. Unit u of a row covers
  positions [u * unit_size, (u + 1) * unit_size) of that sequence.
- `on_kv_written(slot_mapping [T] int64, k [T, Hkv, D], cache [2, Hkv, slots, D])`: called by the
  layer on every step (prefill and decode tokens), right after it wrote the new K/V at `slot_mapping`;
  the scorer updates its own metadata (block bounds, its own key cache, ...) indexed by cache slot or
  block id (= slot // block_size), so that prefix-cache hits (same physical blocks) find it ready.
  Writes into a block always start at its offset 0 (a fresh or reused block), then run in order.
- `unit_scores(q [B, H, D], rows: ScoringRows) -> [B, ceil(L / unit_size)]`: scores of the decode
  group's queries (after rope, the model's dtype) for every unit of each row; `rows.kv_slots` [B, L]
  (slot of each key position, 0 past the context), `rows.context_lens` [B], `rows.block_tables`
  [B, W] (physical block ids) describe the rows. Higher = more worth attending. Units past a row's
  context may hold any finite value or -inf: selection never picks them.

Selection (`glmserve.sparse.selection`) turns the scores plus each row's `SparseAttentionParams`
into the attended slots; a scorer never selects by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class ScoringRows:
    """The decode rows a scorer scores: where each row's keys are in the KV pool."""

    kv_slots: torch.Tensor  # [B, L] slot of each key position (0 past the context)
    context_lens: torch.Tensor  # [B] int64: keys per row
    block_tables: torch.Tensor  # [B, W] physical block ids


@runtime_checkable
class Indexer(Protocol):
    unit_size: int

    def on_kv_written(self, slot_mapping: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> None: ...

    def unit_scores(self, q: torch.Tensor, rows: ScoringRows) -> torch.Tensor: ...


class ScoredLayer(Protocol):
    """What sparse/ reads of one attention layer: its shapes, its slice of the KV pool
    ([2, kv_heads, slots, head_dim]), its position among the model's layers and its scorers by mode."""

    num_kv_heads: int
    head_dim: int
    scale: float
    kv_cache: torch.Tensor | None
    layer_index: int
    indexers: dict[str, Indexer]


def attach_indexers(layers: Sequence[ScoredLayer], mode: str, make: Callable[[int, ScoredLayer], Indexer]) -> None:
    """Gives each of a model's `layers` (in layer order) the scorer `make(layer_index, layer)` for `mode`."""
    if not layers:
        raise ValueError(f"no paged attention layers to attach a {mode!r} indexer to")
    for i, layer in enumerate(layers):
        layer.indexers[mode] = make(i, layer)


def attached_modes(layers: Sequence[ScoredLayer]) -> tuple[str, ...]:
    """The scorer modes ("block", "learned") attached to every one of a model's `layers` (none without layers)."""
    return tuple(m for m in ("block", "learned") if layers and all(m in layer.indexers for layer in layers))
