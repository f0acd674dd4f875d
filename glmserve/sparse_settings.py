"""Sparse decode attention settings: one request's choice, the server-wide defaults, and their merge.

Plain validated values, no torch: they sit at the floor of config.py, which refuses bad server flags
with them when an EngineConfig is built; sparse/ implements the rule below.

A request attends either to its whole context ("dense") or to a selection of past tokens picked by a
scorer ("block": Quest-style per-block key bounds; "learned": a small distilled per-layer scorer;
"native": the model's own DSA lightning indexer, GLM-5.x / DeepSeek-V3.2). Selection rule (implemented
in `glmserve.sparse.selection`, per decode query):

- always kept: the first `sink_tokens` positions and the last `local_tokens` positions of the context;
- top-k mode (`threshold` None): `top_k` is the token budget of the whole selection. A context of at
  most `top_k` tokens is attended densely; otherwise the best-scoring units (blocks or tokens) that are
  not already kept fill the rest of the budget: floor((top_k - kept) / unit_size) units, so the
  selection never exceeds `top_k` tokens; among equal scores the earlier unit wins;
- threshold mode (`threshold` set): the candidate units' scores are min-max normalized to [0, 1] per
  query (all equal -> all 1) and every unit with normalized score >= `threshold` is kept; when `top_k`
  is given too, at most the budget of units above is kept (the best-scoring ones).

- question pins ("block" / "learned", `observe_tokens` > 0; glmserve/sparse/pinning.py, after SnapKV): when
  prefill ends a prompt, the dense attention of its last `observe_tokens` queries (a prefix-cache hit
  recomputes them: `Sequence.recomputed_tail`) picks blocks of 16 positions: per layer, each position's
  highest attention from any observed query and head, summed by block (each block also scoring its
  neighbours'), as a share of the layer's total; these shares summed over layers rank the blocks, and the
  best fill at most half of the budget left after sinks and local window (threshold-only rows: half of
  2,048 tokens less sinks and local window); for token-level scorers, all tokens of those blocks. Pins
  are per sequence and hold in every layer; every decode step keeps them: sinks + local window + pins +
  the best other units,
  the pinned candidates counting first against the budget (threshold mode: normalization still spans
  every candidate, pinned ones included).

"native" without `top_k` and `threshold` runs the model's own indexer exactly as trained (its
`index_topk`, no extra sinks or local window); with either set, the generic rule above runs on the
indexer's token scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from glmserve.errors import InvalidRequestError

MODES = ("dense", "block", "learned", "native")
SEEDS_THRESHOLD = 0.35  # the seeds' dsa_threshold (named in the CLI help and docs; no mode's default)
PINNED_MODES = ("block", "learned")  # modes whose decode selection keeps question pins (observe_tokens)

# per mode, what an unset field becomes (request value first, then the server's flag, then this)
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "dense": {"top_k": None, "threshold": None, "sink_tokens": 0, "local_tokens": 0, "observe_tokens": 0},
    "block": {"top_k": 2048, "threshold": None, "sink_tokens": 16, "local_tokens": 256, "observe_tokens": 32},
    "learned": {"top_k": 2048, "threshold": None, "sink_tokens": 16, "local_tokens": 256, "observe_tokens": 32},
    "native": {"top_k": None, "threshold": None, "sink_tokens": 0, "local_tokens": 0, "observe_tokens": 0},
}
TUNABLE_FIELDS = ("top_k", "threshold", "sink_tokens", "local_tokens", "observe_tokens")


@dataclass(frozen=True)
class SparseAttentionParams:
    """How one request's decode queries choose their keys; invalid values raise InvalidRequestError."""

    mode: str = "dense"
    top_k: int | None = None  # token budget of the whole selection (sinks and local window included)
    threshold: float | None = None  # in (0, 1]: keep units whose min-max normalized score >= threshold
    sink_tokens: int = 0  # first positions always kept (attention sinks)
    local_tokens: int = 0  # most recent positions always kept
    observe_tokens: int = 0  # block / learned: last prompt queries that choose the pinned units (0 = no pins)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidRequestError(f"sparse attention mode must be one of {MODES}, got {self.mode!r}")
        for name in ("sink_tokens", "local_tokens", "observe_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequestError(f"sparse attention {name} must be an integer >= 0, got {value!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise InvalidRequestError(f"sparse attention top_k must be an integer >= 1, got {self.top_k!r}")
        if self.threshold is not None and (isinstance(self.threshold, bool)
                                           or not isinstance(self.threshold, (int, float))
                                           or not math.isfinite(self.threshold)
                                           or not 0 < self.threshold <= 1):
            raise InvalidRequestError(f"sparse attention threshold must be in (0, 1], got {self.threshold!r}")
        if self.mode in ("block", "learned") and self.top_k is None and self.threshold is None:
            raise InvalidRequestError(f"sparse attention mode {self.mode!r} needs top_k or threshold")
        if self.top_k is not None and self.top_k < self.sink_tokens + self.local_tokens:
            raise InvalidRequestError(
                f"sparse attention top_k ({self.top_k}) must be at least sink_tokens + local_tokens "
                f"({self.sink_tokens} + {self.local_tokens})"
            )

    @property
    def pins_question(self) -> bool:
        """True where the prompt's last `observe_tokens` queries pin units for decode (glmserve/sparse/pinning.py)."""
        return self.mode in PINNED_MODES and self.observe_tokens > 0

    @property
    def is_model_default(self) -> bool:
        """True where the model's own indexer runs exactly as trained (native, nothing overridden)."""
        return self.mode == "native" and self.top_k is None and self.threshold is None


def resolve_sparse_params(mode: str, request: dict[str, Any] | None = None,
                          server: dict[str, Any] | None = None) -> SparseAttentionParams:
    """Merges one mode's settings: each field from `request`, else `server` (flags set on the engine),
    else the mode's default (MODE_DEFAULTS). None values in either dict count as unset."""
    if mode not in MODES:
        raise InvalidRequestError(f"sparse attention mode must be one of {MODES}, got {mode!r}")
    unknown = set(request or {}) - set(TUNABLE_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown sparse attention field(s): {sorted(unknown)}; known: {TUNABLE_FIELDS}")
    values = dict(MODE_DEFAULTS[mode])
    for source in (server or {}, request or {}):
        values.update({k: v for k, v in source.items() if k in TUNABLE_FIELDS and v is not None})
    return SparseAttentionParams(mode=mode, **values)
