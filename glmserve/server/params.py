"""From an API request to the engine's SamplingParams, with max_tokens clamped to the context.

A `max_tokens` (or `max_completion_tokens`) larger than what the context leaves after the
prompt is clamped to that room rather than rejected; no limit means "fill the context".
"""

from __future__ import annotations

from typing import Any

from glmserve.engine.sampling import SamplingParams
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


def clamp_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int | None:
    """`requested` limited to the room left in the context (a prompt with no room is left to
    the engine, which rejects it with the limit in the message)."""
    room = max_model_len - prompt_len
    if requested is None or room <= 0:
        return requested
    return min(requested, room)


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest, prompt_len: int, max_model_len: int
) -> SamplingParams:
    """Engine sampling parameters for `request`; fields the client left out keep the engine's defaults."""
    kwargs: dict[str, Any] = {
        "n": request.n,
        "stop": request.stop_list(),
        "ignore_eos": request.ignore_eos,
        "max_tokens": clamp_max_tokens(request.token_limit(), prompt_len, max_model_len),
        "logprobs": request.num_logprobs(),
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
