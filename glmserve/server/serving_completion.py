"""POST /v1/completions: one engine request per prompt, choices numbered prompt-major.

Choice `index` is `prompt_index * n + sample_index`, as in OpenAI's API. With `echo`, each
choice's text starts with its prompt, and with `logprobs` its logprobs start with the prompt's
tokens (the engine's prompt logprobs; the first token's value is null), as OpenAI's legacy API,
vLLM and lm-evaluation-harness use them; `max_tokens` 0 with echo returns the scored prompt only.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from glmserve.engine.outputs import CompletionOutput, RequestOutput
from glmserve.server.errors import BadRequestError
from glmserve.server.generation import Generation, abort_all, cancel_on_disconnect, merge_outputs, start_all
from glmserve.server.guided import compiled_guided
from glmserve.server.limits import check_prompt_tokens, check_request
from glmserve.server.logprobs import completion_logprobs, echo_logprobs
from glmserve.server.params import sampling_params, tightest, token_budget
from glmserve.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from glmserve.server.responses import DONE, SSEResponse, error_event, event, json_response
from glmserve.server.sessions_routes import request_session_id
from glmserve.server.state import ServedModel, ServingContext
from glmserve.server.usage import usage_of


async def create_completion(body: CompletionRequest, raw: Request, ctx: ServingContext) -> Response:
    model = ctx.loaded()
    model_id = model.aliases.resolve(body.model)
    check_request(ctx.config.limits, body)
    if body.max_tokens == 0 and not body.echo:
        raise BadRequestError("max_tokens 0 is only allowed with echo: it returns the prompt, scored with logprobs",
                              param="max_tokens")
    prompts = [model.encode(p) if isinstance(p, str) else p for p in body.prompts()]
    for ids in prompts:
        check_prompt_tokens(ctx.config.limits, len(ids), "prompt")
    session_id = request_session_id(body.session_id, raw)
    if session_id is not None and len(prompts) > 1:
        raise BadRequestError("a request with a session_id takes one prompt", param="prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    budgets = [token_budget(body.token_limit(), len(ids), model.max_model_len, ctx.config.max_tokens_cap)
               for ids in prompts]
    guided = await compiled_guided(body, model)
    generations = [
        Generation(
            ctx.engine,
            ctx.metrics,
            ids,
            sampling_params(body, budget, guided),
            f"{request_id}-{i}",
            sparse=body.sparse_overrides(),
            session_id=session_id,
            budget=budget,
        )
        for i, (ids, budget) in enumerate(zip(prompts, budgets))
    ]
    headers = tightest(budgets).headers()
    await cancel_on_disconnect(raw, start_all(generations))
    echoes = [_echo_text(body, model, p) for p in body.prompts()]  # after the engine checked the token ids
    if body.stream:
        builder = _ChoiceBuilder(body, model, echoes)
        events = _stream(body, generations, builder, request_id, model_id, ctx)
        return SSEResponse(events, on_close=lambda: abort_all(generations), headers=headers)
    try:
        finals = await cancel_on_disconnect(raw, _finals(generations))
    finally:
        abort_all(generations)
    builder = _ChoiceBuilder(body, model, echoes)
    choices = [choice for p, final in enumerate(finals) for c in final.outputs
               if (choice := builder.delta(p, final, c))]
    response = CompletionResponse(id=request_id, model=model_id, choices=choices, usage=usage_of(finals))
    if ctx.interactions is not None:
        ctx.interactions.completion(request_id, model_id, body.prompts(), finals, body.metadata)
    return json_response(response, headers=headers)


def _echo_text(body: CompletionRequest, model: ServedModel, prompt: str | list[int]) -> str:
    if not body.echo:
        return ""
    return prompt if isinstance(prompt, str) else model.decode(prompt)


async def _finals(generations: list[Generation]) -> list[RequestOutput]:
    finals = []
    for generation in generations:  # they run concurrently in the engine; order does not matter
        finals.append(await generation.final())
    return finals


class _ChoiceBuilder:
    """Turns cumulative engine outputs into (delta) choices; tracks what each choice has sent."""

    def __init__(self, body: CompletionRequest, model: ServedModel, echoes: list[str]) -> None:
        self._n = body.n
        self._want_logprobs = body.logprobs is not None
        self._echo = bool(body.echo)
        self._formatter = model.formatter.with_token_ids() if body.return_tokens_as_token_ids else model.formatter
        self._echoes = echoes
        self._sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars, tokens) sent
        self._finished: set[int] = set()

    def delta(self, prompt_index: int, output: RequestOutput, c: CompletionOutput) -> CompletionChoice | None:
        """What choice `c` (of `output`) adds since the last call; None when it adds nothing."""
        index = prompt_index * self._n + c.index
        if index in self._finished:
            return None
        first = index not in self._sent
        chars, tokens = self._sent.get(index, (0, 0))
        echo = self._echoes[prompt_index] if first else ""
        text = echo + c.text[chars:]
        logprobs = None
        if self._want_logprobs and self._echo and first:
            logprobs = self._prompt_logprobs(output)
        if self._want_logprobs and len(c.token_ids) > tokens:
            offset = len(self._echoes[prompt_index]) + chars
            generated = completion_logprobs(self._formatter, c.token_ids[tokens:], c.logprobs[tokens:], offset)
            logprobs = generated if logprobs is None else _joined(logprobs, generated)
        self._sent[index] = (len(c.text), len(c.token_ids))
        if c.finish_reason is not None:
            self._finished.add(index)
        elif not text and logprobs is None:
            return None
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason)

    def _prompt_logprobs(self, output: RequestOutput) -> CompletionLogprobs:
        if output.prompt_logprobs is None:  # the engine scores the prompt when echo asks for logprobs
            raise RuntimeError(f"request {output.request_id} has no prompt logprobs")
        return echo_logprobs(self._formatter, output.prompt_token_ids, output.prompt_logprobs)


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


async def _stream(
    body: CompletionRequest,
    generations: list[Generation],
    builder: _ChoiceBuilder,
    request_id: str,
    model_id: str,
    ctx: ServingContext,
) -> AsyncIterator[str]:
    created = int(time.time())
    try:
        async for prompt_index, output in merge_outputs(generations):
            choices = [choice for c in output.outputs if (choice := builder.delta(prompt_index, output, c))]
            if choices:
                yield event(CompletionResponse(id=request_id, created=created, model=model_id, choices=choices))
        if body.include_usage():
            usage = usage_of([g.last for g in generations if g.last is not None])
            yield event(CompletionResponse(id=request_id, created=created, model=model_id, choices=[], usage=usage))
        if ctx.interactions is not None:
            ctx.interactions.completion(request_id, model_id, body.prompts(), [g.last for g in generations
                                                                               if g.last is not None], body.metadata)
    except Exception as exc:
        yield error_event(exc)
    yield DONE
