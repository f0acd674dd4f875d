"""Per-request sampling options, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from glmserve.engine.structured import GuidedSpec
from glmserve.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise InvalidRequestError (a ValueError).

    temperature 0 is greedy. top_k <= 0 disables top-k. max_tokens None fills the context.
    logprobs None returns no logprobs; an int N returns the chosen token's logprob plus the
    top-N alternatives (N = 0: the chosen token only). Logprobs are of the model's raw
    distribution (before temperature, penalties and truncation). prompt_logprobs N (as vLLM's)
    also scores the prompt: each prompt token's logprob given the tokens before it, with the top-N
    alternatives (the first token has none); such a request computes its whole prompt, never taking
    prefix-cache blocks for it. max_tokens 0 only computes the prompt (no token is sampled).
    logit_bias adds its value (in [-100, 100], OpenAI's range) to its token's logit before sampling. guided
    constrains the output to a grammar (glmserve/engine/structured.py); the sample stops when the grammar ends.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    guided: GuidedSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (0.0 <= self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative"),
            (all(t >= 0 for t in self.logit_bias), "logit_bias token ids must be non-negative"),
            (all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_truncation(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
