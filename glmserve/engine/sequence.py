"""A sequence: one sample of one request, with its tokens, progress and KV record (glmserve/kv/seq_kv.py)."""

from __future__ import annotations

import itertools
import time
from enum import Enum, auto
from typing import Any

import torch

from glmserve.engine.detokenizer import IncrementalDetokenizer
from glmserve.engine.outputs import TokenLogprob
from glmserve.engine.prompt_logprobs import PromptScores
from glmserve.engine.sampling import SamplingParams
from glmserve.kv.seq_kv import SeqKV
from glmserve.log_context import NO_REQUEST
from glmserve.sparse_settings import SparseAttentionParams

_seq_counter = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Tokens (prompt + generated), sampling state, and the KV record of where their KV is (`kv`)."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        priority: int = 0,
        cache_salt: str | None = None,
        sparse: SparseAttentionParams | None = None,
        log_id: str = NO_REQUEST,
    ):
        self.seq_id = next(_seq_counter)
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.request_id = request_id
        self.log_id = log_id  # the id its log lines name (the HTTP request's, glmserve/log_context.py)
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.sparse = sparse or SparseAttentionParams()  # decode attention: dense or a sparse mode
        self.sparse_pins: torch.Tensor | None = None  # [P] question-pinned units of every layer (sparse/pinning.py)
        self.status = SequenceStatus.WAITING
        self.kv = SeqKV(self.seq_id, self.token_ids, self.num_prompt_tokens, cache_salt)
        self.detokenizer = detokenizer
        self.text_ends: list[int] = []  # per output token: the length of the detokenized text once it was added
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # the request's prompt logprobs: sample 0 computes them, the other samples then share its cached prompt
        self.prompt_scores: PromptScores | None = None
        if params.prompt_logprobs is not None and index == 0:
            self.prompt_scores = PromptScores(self.num_prompt_tokens, params.prompt_logprobs)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.generator: torch.Generator | None = None
        self.matcher: Any = None  # its grammar's llguidance matcher (params.guided), advanced by each token
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is written (the KV record's count: the allocator sets it at admission)."""
        return self.kv.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.kv.num_computed_tokens = value

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def reads_prefix_cache(self) -> bool:
        """False for a sequence that scores its prompt: a cached block would skip computing its positions."""
        return self.prompt_scores is None

    @property
    def recomputed_tail(self) -> int:
        """Last tokens a prefix-cache hit still recomputes: the last one (its logits), or the queries that pin
        units for sparse decode (glmserve/sparse/pinning.py), so that pins never depend on the cache."""
        return max(1, min(self.num_tokens, self.sparse.observe_tokens)) if self.sparse.pins_question else 1

    def chunk_tokens(self, start: int, budget: int) -> int:
        """Tokens of the next chunk from `start` within `budget`: all that fit, but a chunked prefill leaves its
        last chunk at least `recomputed_tail` tokens (the queries that choose pins are in the last chunk)."""
        remaining = self.num_tokens - start
        if remaining <= budget:
            return remaining
        return min(budget, remaining - self.recomputed_tail) if remaining > self.recomputed_tail else budget

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then arrival."""
        return (self.priority, self.seq_id)

    def detokenize(self, token_id: int) -> str | None:
        """Adds the (appended) token's text; returns the stop string it completed (the text is cut there, which
        may shorten what earlier tokens of that stop string had added)."""
        stop = self.detokenizer.append(token_id)
        end = len(self.detokenizer.text)
        ends = self.text_ends
        i = len(ends)
        while stop is not None and i and ends[i - 1] > end:
            i -= 1
            ends[i] = end
        ends.append(end)
        return stop

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
