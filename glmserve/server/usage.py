"""The `usage` object, always with `prompt_tokens_details.cached_tokens` and
`completion_tokens_details.reasoning_tokens` (0 without a reasoning parser)."""

from __future__ import annotations

from collections.abc import Iterable

from glmserve.engine.outputs import RequestOutput
from glmserve.server.protocol import CompletionTokensDetails, PromptTokensDetails, Usage
from glmserve.server.reasoning import ReasoningParser, reasoning_tokens


def usage_of(outputs: Iterable[RequestOutput], reasoning: ReasoningParser | None = None) -> Usage:
    """Usage summed over the (final) outputs of one API request's engine requests; `reasoning`: the parser that
    finds each choice's reasoning part (None: no reasoning parser, or thinking switched off)."""
    prompt = completion = cached = thinking = 0
    for output in outputs:
        prompt += len(output.prompt_token_ids)
        cached += output.num_cached_tokens
        completion += sum(len(c.token_ids) for c in output.outputs)
        thinking += sum(reasoning_tokens(reasoning, c.text, c.text_ends) for c in output.outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=thinking),
    )
