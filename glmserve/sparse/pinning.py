"""Question-pinned units: what the end of the prompt attends to stays selected for the whole decode.

After SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
arXiv:2404.14469): the queries of the last prompt tokens (the "observation window", usually the question)
already attend to the parts of the context that the answer will need. SnapKV uses them to compress the
KV cache; we keep the cache whole and use them to pin units of the selection instead (our own code):

- when a chunk of prefill ends a sparse ("block" / "learned") sequence's prompt, each layer computes the
  dense attention of the last `observe_tokens` queries of that chunk (a prefix-cache hit recomputes them,
  `Sequence.recomputed_tail`, so pins do not depend on what was cached; only a final chunk shorter than
  the window observes fewer) over the sequence's whole context, and keeps for each key position the most
  that any observed query in any head gives it (SnapKV selects per head; our selection is per layer, so a
  position one head needs must not be averaged away by the others);
- blocks of PIN_BLOCK (16) positions score their summed attention, max-pooled with the neighbouring block
  on each side (SnapKV pools its scores the same way; here it matters because a needle often straddles two
  blocks: on SmolLM2 NIAH at 8K, the answer's first digits sat in one block and the rest in the next, and
  without the neighbour only the first digits were copied);
- the layers vote: their block scores, summed. A block that the few retrieval layers attend to sharply
  outranks one that many layers touch lightly (on SmolLM2, with heads and queries averaged, the needle was
  among the best 7 blocks of only 2 of 30 layers at 8K; with peaks summed over layers it was among the best
  4 blocks in all 18 of bench_sparse's retrieval prompts);
- the best candidate blocks (not wholly sinks or local window) fill at most half of the budget left after
  sinks and local window (rows without `top_k`: half of PIN_BUDGET less sinks and local window); for
  token-level scorers (learned, unit 1) the pins are every token of those blocks;
- pins belong to the sequence (`Sequence.sparse_pins` [P], ascending unit indices) and hold in every layer:
  blocks are shared between sequences through the prefix cache, so they are never a block property.
  Every decode step keeps sinks + local window + the pins + its own best units, all within the budget
  (`selection.unit_keep_mask`; the C++ `select_slots` honours the same pins).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from glmserve.kv.kv_format import dequantize
from glmserve.kv.slots import slots_of
from glmserve.sparse.indexer import ScoredLayer
from glmserve.sparse.selection import NONE, SparseRows, unit_keep_mask
from glmserve.sparse_settings import MODE_DEFAULTS

if TYPE_CHECKING:
    from glmserve.kv.offload import OffloadedChunk, OffloadedSpan, RunningKVOffload

PIN_BUDGET = MODE_DEFAULTS["block"]["top_k"]  # threshold-only rows: pins take at most half of this budget
PIN_BLOCK = 16  # pins are chosen by blocks of 16 positions (the block indexer's unit; whole blocks for tokens)
POOL_RADIUS = 1  # a block scores at least the mass of its neighbours on each side


def pin_rows(rows: SparseRows, context_lens: torch.Tensor) -> SparseRows:
    """The rows' settings for choosing pins: top-k mode with half of each budget (rows without one: half of
    `PIN_BUDGET`), no threshold."""
    always = torch.minimum(context_lens, rows.sink_tokens + rows.local_tokens)
    budget = torch.where(rows.top_k >= 0, rows.top_k, PIN_BUDGET)
    half = always + (budget - always).clamp(min=0) // 2
    return SparseRows(rows.mode_ids, half, torch.full_like(rows.threshold, NONE), rows.sink_tokens,
                      rows.local_tokens, rows.modes, rows.model_default_only)


def block_mass(mass: torch.Tensor) -> torch.Tensor:
    """Per-position attention mass [R, L] -> per-block scores [R, ceil(L / PIN_BLOCK)]: each block's summed
    mass, max-pooled with its neighbours (SnapKV's pooling: a needle may straddle two blocks)."""
    mass = F.pad(mass, (0, -mass.shape[1] % PIN_BLOCK)).view(mass.shape[0], -1, PIN_BLOCK).sum(-1)
    return F.max_pool1d(mass[:, None], 2 * POOL_RADIUS + 1, stride=1, padding=POOL_RADIUS)[:, 0]


def choose_pins(votes: torch.Tensor, unit_size: int, context_lens: torch.Tensor, rows: SparseRows) -> torch.Tensor:
    """Block scores [R, blocks of PIN_BLOCK] -> pinned units of `unit_size` [R, P], ascending, -1 padding: the
    best candidate blocks within the pin budget (`pin_rows`), given as the units they cover."""
    keep, candidate = unit_keep_mask(votes, PIN_BLOCK, context_lens, pin_rows(rows, context_lens),
                                     votes.shape[1], dense_within_budget=False)
    per_block = PIN_BLOCK // unit_size
    units = (keep & candidate)[:, :, None].expand(-1, -1, per_block).flatten(1)
    return ascending_indices(units[:, : -(-int(context_lens.max()) // unit_size)])


def ascending_indices(mask: torch.Tensor) -> torch.Tensor:
    """[R, U] bool -> [R, max count] int64: the set indices of each row, ascending, then -1."""
    counts = mask.sum(1)
    width = int(counts.max()) if mask.shape[0] else 0
    order = torch.sort(torch.where(mask, torch.arange(mask.shape[1], device=mask.device), mask.shape[1]), dim=1)[0]
    order = order[:, :width]
    return torch.where(order < mask.shape[1], order, -1)


@dataclass
class QuestionObservation:
    """The rows of one prefill step whose chunk ends a pinned sparse sequence's prompt: their last queries,
    their context, and the layers' votes (filled while the model runs, turned into pins after)."""

    sequences: list[Any]  # the engine's Sequence of each row
    query_index: torch.Tensor  # [R, W] flat token index of each observed query in the step (padding repeats)
    query_valid: torch.Tensor  # [R, W] bool
    query_pos: torch.Tensor  # [R, W] position of each observed query
    kv_slots: torch.Tensor  # [R, L] slot of each context position (0 past the context)
    context_lens: torch.Tensor  # [R]
    rows: SparseRows
    offloaded: list[tuple[int, list[OffloadedChunk]]] = field(default_factory=list)  # rows with chunks offloaded
    source: RunningKVOffload | None = None  # where those chunks are (glmserve/kv/offload.py)
    votes: torch.Tensor | None = None  # [R, blocks]: the block scores of every layer so far, summed
    unit_sizes: dict[str, int] = field(default_factory=dict)  # pinned mode in the group -> its scorer's unit

    @classmethod
    def for_prefill(cls, sequences: list[Any], tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                    first_token: torch.Tensor, block_size: int, device: torch.device,
                    spans: list[OffloadedSpan | None], source: RunningKVOffload | None) -> QuestionObservation | None:
        """The prefill group's rows (tables [R, W], starts / lens / first_token [R]: first position, tokens of the
        chunk, flat index of its first token; `spans`: each row's offloaded chunks in `source`) restricted to
        those whose chunk ends a pinned sequence."""
        chosen = [i for i, s in enumerate(sequences)
                  if s.sparse.pins_question and int(starts[i] + lens[i]) == s.num_tokens]
        if not chosen:
            return None
        idx = torch.tensor(chosen)
        starts, lens, first_token, tables = starts[idx], lens[idx], first_token[idx], tables[idx]
        params = [sequences[i].sparse for i in chosen]
        observed = torch.minimum(lens, torch.tensor([p.observe_tokens for p in params]))
        width = int(observed.max())
        back = torch.arange(width)[None, :].flip(1)  # width-1 .. 0 tokens before the chunk's last
        query_valid = back < observed[:, None]
        offset = (lens[:, None] - 1 - back).clamp(min=0)
        ctx = starts + lens
        key_pos = torch.arange(int(ctx.max()))
        in_context = key_pos[None, :] < ctx[:, None]
        kv_slots = torch.where(in_context, slots_of(tables, key_pos[None, :], block_size), 0)
        return cls([sequences[i] for i in chosen], (first_token[:, None] + offset).to(device),
                   query_valid.to(device), (starts[:, None] + offset).to(device), kv_slots.to(device),
                   ctx.to(device), SparseRows.from_params(params, device),
                   [(row, spans[i].chunks) for row, i in enumerate(chosen) if spans[i] is not None], source)

    def record(self, q: torch.Tensor, attn: ScoredLayer) -> None:
        """One layer's vote from its post-rope queries q [T, H, D] of the step (the layer's K/V is written)."""
        vote = block_mass(self.peak_attention(q, attn))
        self.votes = vote if self.votes is None else self.votes + vote
        for mode in self.rows.modes:  # every row observed pins its question
            self.unit_sizes[mode] = attn.indexers[mode].unit_size

    def peak_attention(self, q: torch.Tensor, attn: ScoredLayer) -> torch.Tensor:
        """[R, L]: per key position of the context, the most attention (dense softmax) that any observed query
        in any head gives it."""
        r, w = self.query_index.shape
        hkv, d = attn.num_kv_heads, attn.head_dim
        queries = q[self.query_index.reshape(-1)].view(r, w, hkv, -1, d).float()  # [R, W, Hkv, g, D]
        rows = attn.kv_cache[0].index_select(1, self.kv_slots.reshape(-1))
        keys = dequantize(rows, torch.float32).view(hkv, r, -1, d)
        for row, chunks in self.offloaded:  # their positions read the null block (kv/slots.py): read keys back
            for chunk, kv in zip(chunks, self.source.read_layer_slices(chunks, attn.layer_index, q.device, keys.dtype)):
                keys[:, row, chunk.start:chunk.start + chunk.tokens] = kv[0]
        logits = torch.einsum("rwhgd,hrld->rwhgl", queries, keys) * attn.scale
        key_pos = torch.arange(keys.shape[2], device=q.device)
        visible = (key_pos[None, None, :] <= self.query_pos[:, :, None]) & self.query_valid[:, :, None]
        probs = torch.softmax(logits.masked_fill(~visible[:, :, None, None, :], float("-inf")), dim=-1)
        return probs.nan_to_num(0.0).flatten(1, 3).amax(1)  # padded queries see nothing

    def assign(self) -> None:
        """Hands each sequence the pins that the layers' summed votes choose ([P], in its own mode's units)."""
        if self.votes is None:
            return
        chosen = {mode: choose_pins(self.votes, unit, self.context_lens, self.rows)
                  for mode, unit in self.unit_sizes.items()}
        for row, seq in enumerate(self.sequences):
            pins = chosen[seq.sparse.mode][row]
            seq.sparse_pins = pins[pins >= 0].clone()


def decode_pins(sequences: list[Any], device: torch.device) -> torch.Tensor | None:
    """Pins of a decode group's rows as one tensor [B, P] (-1 padding), or None when no row has any."""
    pins = [s.sparse_pins for s in sequences]
    if all(p is None for p in pins):
        return None
    none = torch.empty(0, dtype=torch.long, device=device)
    return pad_sequence([none if p is None else p for p in pins], batch_first=True, padding_value=-1)
