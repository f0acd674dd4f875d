"""From an API request to the engine's SamplingParams, with max_tokens clamped to the context and the server cap.

A `max_tokens` (or `max_completion_tokens`) larger than what the context leaves after the
prompt is clamped to that room rather than rejected; no limit means "fill the context". A server cap
(`--max-tokens-cap`) limits every request further. `TokenBudget` says what was asked, what the engine may
generate and which of the three (client, context, server_cap) set it; responses report it in headers
(`x-glmserve-max-tokens`, `-source`, `-requested`) and the metrics count what a cap took.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmserve.engine.sampling import SamplingParams
from glmserve.engine.structured import GuidedSpec
from glmserve.server.errors import BadRequestError
from glmserve.server.protocol import ChatCompletionRequest, CompletionRequest

_OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop_token_ids",
)


LIMIT_SOURCES = ("client", "context", "server_cap")


@dataclass(frozen=True)
class TokenBudget:
    """The completion tokens of one engine request: asked by the client (None: fill the context), allowed to the
    engine (None only when the prompt leaves no room: the engine rejects it), and what set the allowance."""

    requested: int | None
    effective: int | None
    source: str  # one of LIMIT_SOURCES
    lost: int  # tokens the server cap took from what the client would have had without it

    def headers(self) -> dict[str, str]:
        out = {"x-glmserve-max-tokens-source": self.source}
        if self.effective is not None:
            out["x-glmserve-max-tokens"] = str(self.effective)
        if self.requested is not None:
            out["x-glmserve-max-tokens-requested"] = str(self.requested)
        return out


def token_budget(requested: int | None, prompt_len: int, max_model_len: int, cap: int | None = None) -> TokenBudget:
    """`requested` limited to the room left in the context and to the server cap (a prompt with no room is left to
    the engine, which rejects it with the limit in the message)."""
    room = max_model_len - prompt_len
    if room <= 0:
        return TokenBudget(requested, requested, "client" if requested is not None else "context", 0)
    uncapped = room if requested is None else min(requested, room)
    if cap is not None and cap < uncapped:
        return TokenBudget(requested, cap, "server_cap", uncapped - cap)
    source = "client" if requested is not None and requested <= room else "context"
    return TokenBudget(requested, uncapped, source, 0)


def tightest(budgets: list[TokenBudget]) -> TokenBudget:
    """The budget that allows the fewest tokens (what a response with several prompts reports)."""
    return min(budgets, key=lambda b: b.effective if b.effective is not None else -1)


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest, budget: TokenBudget, guided: GuidedSpec | None = None
) -> SamplingParams:
    """Engine sampling parameters for `request` (`guided`: its output constraint, compiled already); fields the
    client left out keep the engine's defaults."""
    kwargs: dict[str, Any] = {
        "guided": guided,
        "logit_bias": {int(token): bias for token, bias in (request.logit_bias or {}).items()},
        "n": request.n,
        "stop": request.stop_list(),
        "ignore_eos": request.ignore_eos,
        "max_tokens": budget.effective,
        "logprobs": request.num_logprobs(),
        "prompt_logprobs": request.num_prompt_logprobs(),
    }
    for name in _OPTIONAL_FIELDS:
        value = getattr(request, name)
        if value is not None:
            kwargs[name] = value
    if request.top_k is not None:
        kwargs["top_k"] = -1 if request.top_k == 0 else request.top_k  # vLLM: 0 and -1 both disable
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise BadRequestError(str(exc)) from exc
