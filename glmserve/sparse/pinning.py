"""Question-pinned units: what the end of the prompt attends to stays selected for the whole decode.

After SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
arXiv:2404.14469): the queries of the last prompt tokens (the "observation window", usually the question)
already attend to the parts of the context that the answer will need. SnapKV uses them to compress the
KV cache; we keep the cache whole and use them to pin units of the selection instead (our own code):

- when a chunk of prefill ends a sparse ("block" / "learned") sequence's prompt, each layer computes the
  dense attention of the last `observe_tokens` queries of that chunk (a prefix-cache hit recomputes them,
  `Sequence.recomputed_tail`, so pins do not depend on what was cached; only a final chunk shorter than
  the window observes fewer) over the sequence's whole context, averaged over heads and queries: the
  attention mass of each key position;
- blocks of PIN_BLOCK (16) positions score their summed mass, max-pooled with the neighbouring block on
  each side (SnapKV pools its scores the same way; here it matters because a needle often straddles two
  blocks: on SmolLM2 NIAH at 8K, the answer's first digits sat in one block and the rest in the next, and
  without the neighbour only the first digits were copied);
- the best candidate blocks (not wholly sinks or local window) fill at most half of the budget left after
  sinks and local window (rows without `top_k`: half of PIN_BUDGET less sinks and local window); for
  token-level scorers (learned, unit 1) the pins are every token of those blocks;
- pins belong to the sequence, per layer (`Sequence.sparse_pins` [layers, P], ascending unit indices):
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

from glmserve.sparse.selection import NONE, SparseRows, unit_keep_mask
from glmserve.sparse.settings import MODE_DEFAULTS

if TYPE_CHECKING:
    from glmserve.layers.attention import PagedAttention

PINNED_MODES = ("block", "learned")
# a unit pinned by this many layers is pinned in all of them: on SmolLM2 a needle the question attends to was
# pinned by 7 of 30 layers and lost by the others (NIAH at 4K, depth 0.2: "63" for "63075" in every sparse
# mode); with this union, threshold 0.35 and top_k 2,048 found every needle of bench_sparse's cases (5 to 10
# layers were tried: 7 and more miss that case, 3 loses two 8K cases at top_k 512)
CONSENSUS_LAYERS = 5
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


def choose_pins(mass: torch.Tensor, unit_size: int, context_lens: torch.Tensor, rows: SparseRows) -> torch.Tensor:
    """Attention mass [R, L] of the observed queries -> pinned units of `unit_size` [R, P], ascending, -1
    padding. Pins are chosen by blocks of PIN_BLOCK positions, then given as the units they cover."""
    scores = block_mass(mass)
    keep, candidate = unit_keep_mask(scores, PIN_BLOCK, context_lens, pin_rows(rows, context_lens),
                                     scores.shape[1], dense_within_budget=False)
    per_block = PIN_BLOCK // unit_size
    units = (keep & candidate)[:, :, None].expand(-1, -1, per_block).flatten(1)
    return ascending_indices(units[:, : -(-mass.shape[1] // unit_size)])


def ascending_indices(mask: torch.Tensor) -> torch.Tensor:
    """[R, U] bool -> [R, max count] int64: the set indices of each row, ascending, then -1."""
    counts = mask.sum(1)
    width = int(counts.max()) if mask.shape[0] else 0
    order = torch.sort(torch.where(mask, torch.arange(mask.shape[1], device=mask.device), mask.shape[1]), dim=1)[0]
    order = order[:, :width]
    return torch.where(order < mask.shape[1], order, -1)


@dataclass
class Observation:
    """The rows of one prefill step whose chunk ends a pinned sparse sequence's prompt: their last queries,
    their context, and the pins each layer chose (filled while the model runs, handed to the sequences after)."""

    sequences: list[Any]  # the engine's Sequence of each row
    query_index: torch.Tensor  # [R, W] flat token index of each observed query in the step (padding repeats)
    query_valid: torch.Tensor  # [R, W] bool
    query_pos: torch.Tensor  # [R, W] position of each observed query
    kv_slots: torch.Tensor  # [R, L] slot of each context position (0 past the context)
    context_lens: torch.Tensor  # [R]
    rows: SparseRows
    pins: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> [R, P]

    @classmethod
    def for_prefill(cls, sequences: list[Any], tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                    first_token: torch.Tensor, block_size: int, device: torch.device) -> Observation | None:
        """The prefill group's rows (tables [R, W], starts / lens / first_token [R]: first position, tokens of the
        chunk, flat index of its first token) restricted to those whose chunk ends a pinned sequence."""
        chosen = [i for i, s in enumerate(sequences)
                  if s.sparse.mode in PINNED_MODES and s.sparse.observe_tokens > 0
                  and int(starts[i] + lens[i]) == s.num_tokens]
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
        kv_slots = torch.where(in_context, tables[:, key_pos // block_size] * block_size + key_pos % block_size, 0)
        return cls([sequences[i] for i in chosen], (first_token[:, None] + offset).to(device),
                   query_valid.to(device), (starts[:, None] + offset).to(device), kv_slots.to(device),
                   ctx.to(device), SparseRows.from_params(params, device))

    def record(self, q: torch.Tensor, attn: PagedAttention) -> None:
        """One layer's pins from its post-rope queries q [T, H, D] of the step (the layer's K/V is written)."""
        mass = self.attention_mass(q, attn)
        pins = torch.full((mass.shape[0], 0), -1, dtype=torch.long, device=mass.device)
        for mode in self.rows.modes & set(PINNED_MODES):
            chosen = choose_pins(mass, attn.indexers[mode].unit_size, self.context_lens, self.rows)
            width = max(pins.shape[1], chosen.shape[1])
            pins = torch.where(self.rows.rows_in(mode)[:, None], F.pad(chosen, (0, width - chosen.shape[1]), value=-1),
                               F.pad(pins, (0, width - pins.shape[1]), value=-1))
        self.pins[attn.layer_index] = pins

    def attention_mass(self, q: torch.Tensor, attn: PagedAttention) -> torch.Tensor:
        """[R, L]: the observed queries' dense softmax over the context, mean over heads and queries."""
        r, w = self.query_index.shape
        hkv, d = attn.num_kv_heads, attn.head_dim
        queries = q[self.query_index.reshape(-1)].view(r, w, hkv, -1, d).float()  # [R, W, Hkv, g, D]
        keys = attn.kv_cache[0].index_select(1, self.kv_slots.reshape(-1)).view(hkv, r, -1, d).float()
        logits = torch.einsum("rwhgd,hrld->rwhgl", queries, keys) * attn.scale
        key_pos = torch.arange(keys.shape[2], device=q.device)
        visible = (key_pos[None, None, :] <= self.query_pos[:, :, None]) & self.query_valid[:, :, None]
        probs = torch.softmax(logits.masked_fill(~visible[:, :, None, None, :], float("-inf")), dim=-1)
        probs = probs.nan_to_num(0.0)  # padded queries see nothing
        return probs.sum(dim=(1, 2, 3)) / (self.query_valid.sum(1, keepdim=True) * hkv * probs.shape[3])

    def assign(self) -> None:
        """Hands each sequence its pins of every layer ([layers, P], -1 padding trimmed per sequence)."""
        if not self.pins:
            return
        width = max(p.shape[1] for p in self.pins.values())
        stacked = torch.stack([F.pad(self.pins[i], (0, width - self.pins[i].shape[1]), value=-1)
                               for i in sorted(self.pins)], dim=1)  # [R, layers, P]
        stacked = with_consensus(stacked)
        counts = (stacked >= 0).sum(-1).amax(-1)
        for seq, pins, count in zip(self.sequences, stacked, counts.tolist()):
            seq.sparse_pins = pins[:, :count].clone()


def with_consensus(stacked: torch.Tensor) -> torch.Tensor:
    """[R, layers, P] pins -> the same with every unit that at least CONSENSUS_LAYERS layers pinned added to the
    pins of every layer (see CONSENSUS_LAYERS)."""
    r, layers, _ = stacked.shape
    units = int(stacked.max()) + 1 if stacked.numel() else 0
    if units <= 0:
        return stacked
    hit = torch.zeros((r, layers, units + 1), dtype=torch.bool, device=stacked.device)
    hit.scatter_(2, torch.where(stacked >= 0, stacked, units), True)
    hit = hit[..., :units]
    common = hit.sum(1) >= CONSENSUS_LAYERS  # [R, U]
    merged = hit | common[:, None, :]
    return ascending_indices(merged.view(r * layers, units)).view(r, layers, -1)


def decode_pins(sequences: list[Any], device: torch.device) -> torch.Tensor | None:
    """Pins of a decode group's rows as one tensor [layers, B, P] (-1 padding), or None when no row has any."""
    pins = [s.sparse_pins for s in sequences]
    layers = next((p.shape[0] for p in pins if p is not None), None)
    if layers is None:
        return None
    none = torch.empty((0, layers), dtype=torch.long, device=device)
    by_row = [none if p is None else p.T for p in pins]  # [P_row, layers] each
    return pad_sequence(by_row, batch_first=True, padding_value=-1).permute(2, 0, 1).contiguous()
