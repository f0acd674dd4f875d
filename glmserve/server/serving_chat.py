"""POST /v1/chat/completions: one engine request (n samples) per API request.

With tools the model may call (glmserve/server/tool_stream.py), each choice's output is read as content and
tool calls; a choice that called a tool finishes with `tool_calls`. With a reasoning parser
(glmserve/server/reasoning.py) the output's thinking part comes first, as `reasoning_content`. `start_chat` is
shared with POST /v1/responses (glmserve/server/serving_responses.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from glmserve.server.anchoring import anchor_messages
from glmserve.server.compress_routes import compress_context
from glmserve.server.errors import BadRequestError
from glmserve.server.generation import Generation, cancel_on_disconnect, start_all
from glmserve.server.guided import compiled_guided
from glmserve.server.limits import check_prompt_tokens, check_request
from glmserve.server.logprobs import chat_logprobs
from glmserve.server.params import TokenBudget, sampling_params, token_budget
from glmserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionChunkWithTrace,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionWithTrace,
    ChoiceDelta,
    FinishReason,
)
from glmserve.server.reasoning import ReasoningParser, ReasoningStream, thinking_disabled
from glmserve.server.responses import DONE, SSEResponse, error_event, event, json_response
from glmserve.server.sessions_routes import request_session_id
from glmserve.server.state import ServedModel, ServingContext
from glmserve.server.tool_stream import ToolCalls
from glmserve.server.usage import usage_of


@dataclass
class ChatRun:
    """A started chat request: the model, the id the client asked for, the engine request and its budget."""

    model: ServedModel
    model_id: str
    generation: Generation
    budget: TokenBudget
    reasoning: ReasoningParser | None  # None: no reasoning parser, or the request switched thinking off
    trace: dict[str, Any] | None = None  # the trace map of the documents context_compression compressed


async def start_chat(body: ChatCompletionRequest, raw: Request, ctx: ServingContext, request_id: str,
                     session_id: str | None) -> ChatRun:
    """Renders the conversation, compiles its constraint and starts the engine request (errors are HTTP errors)."""
    model = ctx.loaded()
    model_id = model.aliases.resolve(body.model)
    check_request(ctx.config.limits, body)
    messages = body.messages
    if body.session_summary:
        if session_id is None:
            raise BadRequestError("session_summary needs a session_id (or an X-Session-Id header)",
                                  param="session_summary")
        messages = await anchor_messages(messages, session_id, model, ctx)
    trace = None
    if body.context_compression is not None:
        messages, trace = await compress_context(body.context_compression, messages, model.tokenizer)
    prompt_ids = model.chat_prompt(messages, body.active_tools(), body.chat_template_kwargs)
    check_prompt_tokens(ctx.config.limits, len(prompt_ids), "messages")
    budget = token_budget(body.token_limit(), len(prompt_ids), model.max_model_len, ctx.config.max_tokens_cap)
    params = sampling_params(body, budget, await compiled_guided(body, model))
    generation = Generation(ctx.engine, ctx.metrics, prompt_ids, params, request_id,
                            sparse=body.sparse_overrides(), session_id=session_id, budget=budget)
    await cancel_on_disconnect(raw, start_all([generation]))
    reasoning = None if thinking_disabled(body.chat_template_kwargs) else model.reasoning_parser
    return ChatRun(model, model_id, generation, budget, reasoning, trace)


async def create_chat_completion(body: ChatCompletionRequest, raw: Request, ctx: ServingContext) -> Response:
    run = await start_chat(body, raw, ctx, f"chatcmpl-{uuid.uuid4().hex}", request_session_id(body.session_id, raw))
    model, model_id, generation, budget = run.model, run.model_id, run.generation, run.budget
    tools = body.active_tools()
    if body.stream:
        return SSEResponse(_stream(body, run, ctx), on_close=generation.abort,
                           headers=budget.headers())
    try:
        final = await cancel_on_disconnect(raw, generation.final())
    finally:
        generation.abort()
    want_logprobs = body.num_logprobs() is not None
    choices = []
    for c in final.outputs:
        split = ReasoningStream(run.reasoning)
        split.update(c.text, final=True)
        content, calls = _tool_calls(body, model).message(split.content) if tools else (split.content, [])
        choices.append(ChatChoice(
            index=c.index,
            message=AssistantMessage(content=content, reasoning_content=split.reasoning, tool_calls=calls or None),
            logprobs=chat_logprobs(model.formatter, c.token_ids, c.logprobs) if want_logprobs else None,
            finish_reason=_finish_reason(c.finish_reason, bool(calls)),
        ))
    response = ChatCompletionResponse(
        id=generation.request_id, model=model_id, choices=choices, usage=usage_of([final], run.reasoning)
    )
    if run.trace is not None:
        response = ChatCompletionWithTrace(**dict(response), context_compression=run.trace)
    if ctx.interactions is not None:
        ctx.interactions.chat(generation.request_id, model_id, body.messages, final, body.metadata)
    return json_response(response, headers=budget.headers())


def _tool_calls(body: ChatCompletionRequest, model: ServedModel) -> ToolCalls:
    return ToolCalls(model.tool_parser, body.active_tools(), body.parallel_calls())


def _finish_reason(engine_reason: str | None, called: bool) -> FinishReason | None:
    """`tool_calls` for a choice that stopped after calling tools (not one cut by max_tokens)."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason  # type: ignore[return-value]


async def _stream(body: ChatCompletionRequest, run: ChatRun, ctx: ServingContext) -> AsyncIterator[str]:
    """Chunks as OpenAI sends them: a role delta, content (and reasoning_content) deltas, a finish delta per
    choice, then (context_compression) a chunk with no choices carrying the trace map as
    `context_compression`, then (stream_options.include_usage) a usage chunk with no choices, then [DONE]."""
    generation, model, model_id = run.generation, run.model, run.model_id
    created = int(time.time())
    want_logprobs = body.num_logprobs() is not None

    def chunk(choices: list[ChatChunkChoice]) -> str:
        return event(ChatCompletionChunk(id=generation.request_id, created=created, model=model_id, choices=choices))

    sent_text = [0] * body.n
    sent_tokens = [0] * body.n
    splits = [ReasoningStream(run.reasoning) for _ in range(body.n)]
    finished = [False] * body.n
    calls = [_tool_calls(body, model) for _ in range(body.n)] if body.active_tools() else None
    try:
        for i in range(body.n):
            yield chunk([ChatChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""))])
        async for output in generation.outputs():
            for c in output.outputs:
                i = c.index
                final = c.finish_reason is not None
                reasoning = splits[i].update(c.text, final)
                content = splits[i].content
                text = content[sent_text[i] :]
                token_ids = c.token_ids[sent_tokens[i] :]
                logprobs = None
                if want_logprobs and token_ids:
                    logprobs = chat_logprobs(model.formatter, token_ids, c.logprobs[sent_tokens[i] :])
                sent_text[i], sent_tokens[i] = len(content), len(c.token_ids)
                tool_deltas = None
                if calls is not None:
                    text, tool_deltas = calls[i].deltas(content, final=final)
                if reasoning:
                    yield chunk([ChatChunkChoice(index=i, delta=ChoiceDelta(reasoning_content=reasoning))])
                if text or logprobs is not None:
                    yield chunk([ChatChunkChoice(index=i, delta=ChoiceDelta(content=text), logprobs=logprobs)])
                for delta in tool_deltas or ():
                    yield chunk([ChatChunkChoice(index=i, delta=ChoiceDelta(tool_calls=[delta]))])
                if c.finish_reason is not None and not finished[i]:
                    finished[i] = True
                    reason = _finish_reason(c.finish_reason, calls is not None and calls[i].called)
                    yield chunk([ChatChunkChoice(index=i, delta=ChoiceDelta(), finish_reason=reason)])
        if run.trace is not None:
            yield event(ChatCompletionChunkWithTrace(id=generation.request_id, created=created, model=model_id,
                                                     choices=[], context_compression=run.trace))
        if body.include_usage():
            assert generation.last is not None
            yield event(
                ChatCompletionChunk(
                    id=generation.request_id,
                    created=created,
                    model=model_id,
                    choices=[],
                    usage=usage_of([generation.last], run.reasoning),
                )
            )
        if ctx.interactions is not None and generation.last is not None:
            ctx.interactions.chat(generation.request_id, model_id, body.messages, generation.last, body.metadata)
    except Exception as exc:
        yield error_event(exc)
    yield DONE
