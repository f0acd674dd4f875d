"""What the engine hands back per request and per step, and its statistics (of the step, of the KV below the pool)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from glmserve.kv.offload import OffloadStats
    from glmserve.kv.session_io import SessionStats
    from glmserve.kv.tiers import TierStats


@dataclass
class TokenLogprob:
    """Logprob of one generated token, with the top alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One sample of a request. `text` and `token_ids` are cumulative and append-only. `text_ends[i]` is where
    token i's text ends in the full text (`text[:text_ends[i]]` is what tokens 0..i wrote; while running, the
    visible `text` may hold back a tail that could become a stop string); a token that completes no character
    (part of a multi-byte one, a skipped special token) ends where the one before it does."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None  # None while running, else "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    text_ends: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float = 0.0  # time.monotonic() when the request was added
    first_scheduled_time: float | None = None  # when it left the waiting queue the first time
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    requests_received: int = 0  # every add_request since the start (the warm-up included), valid or not


@dataclass(frozen=True)
class StorageStats:
    """A snapshot of the KV kept below the device pool (`LLMEngine.storage_stats`, for the server's /metrics): what
    the KV tiers (glmserve/kv/tiers.py), the session store (glmserve/kv/session_io.py) and KV offload of
    sequences longer than the pool (glmserve/kv/offload.py) moved, and the bytes they hold. Counters are copied
    as they are at that moment; a Redis session store answers its size over the network."""

    tiers: TierStats | None  # None: no host or disk tier
    host_tier_bytes: int
    disk_tier_bytes: int
    sessions: SessionStats | None  # None: sessions are off
    session_store_bytes: int
    offload: OffloadStats | None = None  # None: the pool holds max_model_len (no KV offload)
