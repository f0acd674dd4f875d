"""From unit scores and per-row settings to the key slots each decode query attends (batched, no
Python loop per row, unit or token).

The rule is the one documented in `glmserve.sparse_settings`: sinks and the local window always,
then the best units by budget (top-k mode) or by min-max normalized score (threshold mode). Rows in
different modes share one batch: each mode's keep mask is computed on that mode's scores and the
rows take the mask of their own mode (`SparseRows.mode_ids`), dense rows keep their whole context.

Public functions (callable on their own, e.g. by benchmarks):
- `SparseRows.from_params(params, device)`: per-row settings as tensors;
- `keep_mask(scores, unit_size, context_lens, rows, length) -> [B, length] bool`;
- `decode_keep_mask(scores_by_mode, unit_sizes, context_lens, rows, length)`: mixed modes;
- `compact(keep, kv_slots) -> (positions [B, L_sel], slots [B, L_sel], lengths [B])`, ascending;
- `select_slots(scores_by_mode, unit_sizes, context_lens, rows, kv_slots) -> (slots, lengths)`: what decode
  attention uses; on CPU with one scorer in the group, our C++ kernel (glmserve/kernels/csrc/sparse.cpp)
  applies the same rule per row without the [B, L] masks, else `decode_keep_mask` + `compact`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmserve import kernels
from glmserve.sparse_settings import MODES, SparseAttentionParams

NONE = -1  # top_k / threshold not set
_ARANGE: dict[torch.device, torch.Tensor] = {}


def positions_upto(length: int, device: torch.device) -> torch.Tensor:
    """arange(length) as a view of one cached tensor per device: a fresh long arange per layer and step
    costs more (allocation, page faults) than the comparisons that use it."""
    cached = _ARANGE.get(device)
    if cached is None or cached.shape[0] < length:
        cached = _ARANGE[device] = torch.arange(max(length, 2 * (0 if cached is None else cached.shape[0])),
                                                device=device)
    return cached[:length]


@dataclass
class SparseRows:
    """Per-row sparse settings of one decode group, as tensors on the compute device."""

    mode_ids: torch.Tensor  # [B] int64, index into MODES
    top_k: torch.Tensor  # [B] int64, NONE = not set
    threshold: torch.Tensor  # [B] float32, NONE = not set
    sink_tokens: torch.Tensor  # [B] int64
    local_tokens: torch.Tensor  # [B] int64
    modes: frozenset[str]  # modes present in the group
    model_default_only: bool  # every row is "native" without overrides (the model's own indexer as trained)
    pins: torch.Tensor | None = None  # [B, P] pinned units, every layer (-1 = none; glmserve.sparse.pinning)

    @classmethod
    def from_params(cls, params: list[SparseAttentionParams], device: torch.device,
                    pins: torch.Tensor | None = None) -> SparseRows:
        table = torch.tensor([
            (MODES.index(p.mode), NONE if p.top_k is None else p.top_k, p.sink_tokens, p.local_tokens)
            for p in params
        ], dtype=torch.long).view(len(params), 4)
        threshold = torch.tensor([NONE if p.threshold is None else p.threshold for p in params], dtype=torch.float32)
        cols = table.to(device).unbind(1)
        return cls(cols[0], cols[1], threshold.to(device), cols[2], cols[3], frozenset(p.mode for p in params),
                   all(p.is_model_default for p in params), pins)

    def rows_in(self, mode: str) -> torch.Tensor:
        return self.mode_ids == MODES.index(mode)


def pinned_units(pins: torch.Tensor | None, b: int, num_units: int, device: torch.device) -> torch.Tensor:
    """pins [B, P] unit indices (-1 = none; None = no pins) -> [B, num_units] bool."""
    mask = torch.zeros((b, num_units + 1), dtype=torch.bool, device=device)
    if pins is not None and pins.numel():
        mask.scatter_(1, torch.where((pins >= 0) & (pins < num_units), pins, num_units), True)
    return mask[:, :num_units]


def unit_keep_mask(scores: torch.Tensor, unit_size: int, context_lens: torch.Tensor, rows: SparseRows,
                   num_units: int, pins: torch.Tensor | None = None, dense_within_budget: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, >= num_units] -> (kept units [B, num_units], candidate units [B, num_units]), bool.

    Candidates hold at least one in-context position that sinks and local window do not keep. Pinned
    candidates (`pins` [B, P], see `glmserve.sparse.pinning`) are kept and take their share of the budget
    first; the other candidates go by the rule (budget, threshold normalized over all candidates)."""
    b = scores.shape[0]
    dev = scores.device
    scores = scores[:, :num_units].float()
    unit_start = torch.arange(num_units, device=dev)[None, :] * unit_size
    ctx, sink, local = context_lens[:, None], rows.sink_tokens[:, None], rows.local_tokens[:, None]
    # a candidate unit holds at least one in-context position that is not always kept
    unit_end = torch.minimum(unit_start + unit_size, ctx)  # exclusive
    covered = (unit_end <= sink) | (unit_start >= ctx - local)
    candidate = (unit_start < ctx) & ~covered
    pinned = pinned_units(pins, b, num_units, dev) & candidate
    masked = scores.masked_fill(~candidate, float("-inf"))

    has_budget = rows.top_k >= 0
    always = torch.minimum(context_lens, rows.sink_tokens + rows.local_tokens)
    budget_units = torch.where(has_budget, (rows.top_k - always).clamp(min=0) // unit_size, 0)
    budget_units = (budget_units - pinned.sum(1)).clamp(min=0)  # the pins' share comes first
    kmax = int(budget_units.max().clamp(max=num_units)) if b else 0
    by_budget = torch.zeros((b, num_units), dtype=torch.bool, device=dev)
    if kmax > 0:
        # a stable sort, not topk: equal scores go to the earlier unit, as in the C++ kernel
        values, indices = torch.sort(masked.masked_fill(pinned, float("-inf")), dim=-1, descending=True,
                                     stable=True)
        values, indices = values[:, :kmax], indices[:, :kmax]
        chosen = (torch.arange(kmax, device=dev)[None, :] < budget_units[:, None]) & torch.isfinite(values)
        by_budget.scatter_(1, indices, chosen)
    by_budget |= ~has_budget[:, None]  # no budget (threshold only): the threshold alone decides

    # threshold: min-max normalize over the candidates; all equal -> every candidate scores 1
    lo = masked.masked_fill(~candidate, float("inf")).amin(-1, keepdim=True)
    hi = masked.amax(-1, keepdim=True)
    span = hi - lo
    normalized = torch.where(span > 0, (masked - lo) / span.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
    has_threshold = rows.threshold >= 0
    by_threshold = candidate & (normalized >= rows.threshold[:, None])

    unit_keep = torch.where(has_threshold[:, None], by_threshold & by_budget, by_budget) & ~pinned | pinned
    if dense_within_budget:  # top-k mode with the whole context inside the budget: dense
        unit_keep |= (~has_threshold & has_budget & (context_lens <= rows.top_k))[:, None]
    return unit_keep, candidate


def keep_mask(scores: torch.Tensor, unit_size: int, context_lens: torch.Tensor, rows: SparseRows,
              length: int, pins: torch.Tensor | None = None) -> torch.Tensor:
    """scores [B, U] (U >= ceil(length / unit_size)) -> keep [B, length] bool, every row under this scorer;
    `pins` [B, P]: each row's pinned units (-1 = none), kept within its budget."""
    num_units = -(-length // unit_size)
    unit_keep, _ = unit_keep_mask(scores, unit_size, context_lens, rows, num_units, pins)
    # to tokens (few [B, length] ops: this is the part that grows with the context)
    # (repeat_interleave, not expand + reshape: a single unit would stay a stride-0 view the ORs below write to)
    keep = unit_keep.repeat_interleave(unit_size, dim=1)[:, :length]
    pos = positions_upto(length, scores.device)[None, :]
    keep |= pos < rows.sink_tokens[:, None]  # sinks
    keep |= pos >= (context_lens - rows.local_tokens)[:, None]  # local window
    keep &= pos < context_lens[:, None]
    return keep


def decode_keep_mask(scores_by_mode: dict[str, torch.Tensor], unit_sizes: dict[str, int],
                     context_lens: torch.Tensor, rows: SparseRows, length: int,
                     pins: torch.Tensor | None = None) -> torch.Tensor:
    """Keep mask [B, length] of a group whose rows may use different modes: dense rows keep their whole
    context, each other row the mask of its own mode's scores (`scores_by_mode[mode]`, every row) and
    its pinned units (`pins` [B, P], in units of its own mode; None = none)."""
    if len(scores_by_mode) == 1 and "dense" not in rows.modes:  # one mode for every row
        (mode, scores), = scores_by_mode.items()
        return keep_mask(scores, unit_sizes[mode], context_lens, rows, length, pins)
    keep = positions_upto(length, context_lens.device)[None, :] < context_lens[:, None]
    for mode, scores in scores_by_mode.items():
        mode_keep = keep_mask(scores, unit_sizes[mode], context_lens, rows, length, pins)
        keep = torch.where(rows.rows_in(mode)[:, None], mode_keep, keep)
    return keep


def compact(keep: torch.Tensor, kv_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keep [B, L] bool, kv_slots [B, L] -> (positions [B, L_sel], slots [B, L_sel], lengths [B]): the kept
    positions of each row in ascending order, padded with position 0 / slot 0 (the null block) past its length.
    One pass over [B, L] (nonzero, row-major hence ascending per row); the rest works on the kept entries."""
    b = keep.shape[0]
    rows, cols = keep.nonzero(as_tuple=True)
    lengths = torch.bincount(rows, minlength=b)
    width = max(int(lengths.max()), 1) if b else 1
    rank = positions_upto(rows.shape[0], keep.device) - (torch.cumsum(lengths, 0) - lengths)[rows]
    positions = torch.zeros((b, width), dtype=torch.long, device=keep.device)
    slots = torch.zeros((b, width), dtype=kv_slots.dtype, device=keep.device)
    positions[rows, rank] = cols
    slots[rows, rank] = kv_slots[rows, cols]
    return positions, slots, lengths


def select_slots(scores_by_mode: dict[str, torch.Tensor], unit_sizes: dict[str, int], context_lens: torch.Tensor,
                 rows: SparseRows, kv_slots: torch.Tensor, pins: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots [B, L_sel] (ascending positions, slot 0 past each length) and lengths [B] each decode row
    attends to; `scores_by_mode` and `pins` as in `decode_keep_mask`."""
    kernel = kernels.op("select_slots", kv_slots.device, torch.float32)  # it takes the scores as float32
    if kernel is not None and len(scores_by_mode) == 1:  # one scorer: its rows and dense rows (no budget: whole)
        (mode, scores), = scores_by_mode.items()
        mine = rows.rows_in(mode)
        no_pins = torch.empty((kv_slots.shape[0], 0), dtype=torch.long, device=kv_slots.device)
        slots, lengths = kernel(
            scores.float().contiguous(), unit_sizes[mode], context_lens.contiguous(),
            torch.where(mine, rows.top_k, NONE), torch.where(mine, rows.threshold, NONE),
            rows.sink_tokens.contiguous(), rows.local_tokens.contiguous(), kv_slots.contiguous(),
            no_pins if pins is None else pins.contiguous())
        return slots, lengths
    keep = decode_keep_mask(scores_by_mode, unit_sizes, context_lens, rows, kv_slots.shape[1], pins)
    _, slots, lengths = compact(keep, kv_slots)
    return slots, lengths
