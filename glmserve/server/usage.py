"""The `usage` object, always with `prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

from collections.abc import Iterable

from glmserve.engine.outputs import RequestOutput
from glmserve.server.protocol import PromptTokensDetails, Usage


def usage_of(outputs: Iterable[RequestOutput]) -> Usage:
    """Usage summed over the (final) outputs of one API request's engine requests."""
    prompt = completion = cached = 0
    for output in outputs:
        prompt += len(output.prompt_token_ids)
        cached += output.num_cached_tokens
        completion += sum(len(c.token_ids) for c in output.outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
