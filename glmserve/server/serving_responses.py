"""POST /v1/responses (OpenAI's Responses API) over the chat machinery, and GET / DELETE /v1/responses/{id}.

A request becomes a chat request (instructions as a system turn, items as turns, function tools as tools, `text.format`
as response_format) and runs through `start_chat`, so constraints, tool parsers and reasoning parsers are the
chat ones. The output is a list of items: a `reasoning` item (with a reasoning parser), a `message` with
`output_text`, and one `function_call` item per tool call.

State: a stored response (`store`, the default) is kept in the session store (disk or Redis, the engine's
`set_session_summary`) under its own id: the conversation's messages without the instructions (as OpenAI, the
next turn's instructions replace them) and the response object. Each conversation has a session of its own
(`conv_...`, sent back in the X-Session-Id header): every turn with `previous_response_id` runs in the session of
the response it continues, so the engine loads that turn's KV back and `usage.input_tokens_details.cached_tokens`
counts it. With the session store off, nothing is stored and `previous_response_id` is refused.

Streaming sends OpenAI's events as server-sent events with an `event:` line each (response.created,
response.in_progress, response.output_item.added, response.content_part.added, response.output_text.delta /
.done, response.reasoning_text.delta / .done, response.function_call_arguments.delta / .done,
response.content_part.done, response.output_item.done, then response.completed or response.incomplete).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from glmserve.engine.outputs import CompletionOutput
from glmserve.server.errors import APIError, BadRequestError
from glmserve.server.generation import cancel_on_disconnect
from glmserve.server.logprobs import TokenFormatter, span_logprobs
from glmserve.server.protocol import ChatCompletionRequest, ChatMessage
from glmserve.server.reasoning import ReasoningParser, ReasoningStream
from glmserve.server.responses import SSEResponse, json_response, stream_error
from glmserve.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    item_id,
)
from glmserve.server.serving_chat import ChatRun, start_chat
from glmserve.server.sessions_routes import SESSION_HEADER
from glmserve.server.state import ServingContext
from glmserve.server.tool_stream import ToolCalls
from glmserve.server.usage import usage_of

RECORD_KIND = "glmserve.response"  # marks a session-store summary as a stored response

router = APIRouter()


class ResponseNotFoundError(APIError):
    status_code = 404
    default_code = "response_not_found"


def _ctx(request: Request) -> ServingContext:
    return request.app.state.serving


# ---------------------------------------------------------------------- request -> chat request


def input_messages(items: str | list[Any]) -> list[ChatMessage]:
    """The input as chat turns: consecutive function calls become one assistant turn with tool_calls."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1].role == "assistant":  # the calls of the turn that precedes them
                turn = out[-1].model_dump()
                out[-1] = ChatMessage.model_validate({**turn, "tool_calls": [*(turn["tool_calls"] or ()), call]})
            else:
                out.append(ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
        # reasoning items: earlier thinking stays out of the prompt, as the thinking models' templates drop it
    return out


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "description": fmt.description,
                                                   "schema": fmt.schema_, "strict": fmt.strict}}


def chat_request(body: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that runs `body` over `messages` (the whole conversation); its validation errors are
    400s."""
    choice = body.tool_choice
    fields: dict[str, Any] = {
        "model": body.model, "messages": [m.model_dump(exclude_none=True) for m in messages],
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "seed": body.seed, "top_k": body.top_k, "stream": body.stream, "user": body.user,
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": _response_format(body),
        "chat_template_kwargs": body.chat_template_kwargs,
        "logprobs": body.logprobs() is not None, "top_logprobs": body.logprobs(),
        "guided_json": body.guided_json, "guided_regex": body.guided_regex, "guided_choice": body.guided_choice,
        "guided_grammar": body.guided_grammar,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in body.tools] if body.tools else None,
        "tool_choice": ({"type": "function", "function": {"name": choice.name}}
                        if isinstance(choice, FunctionToolChoice) else choice),
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "input"
        raise BadRequestError(f"{where}: {error['msg']}", param="input" if where.startswith("messages") else None
                              ) from exc


# ---------------------------------------------------------------------- output items and events


class OutputBuilder:
    """Reads the cumulative output text into output items and the stream events that build them.

    Items open one after the other (reasoning, message, function calls); opening one closes the previous. The
    whole answer (non-streamed) is one `feed(text, final=True)`, so both paths make the same items. With a token
    formatter (`message.output_text.logprobs` included), each text delta carries the logprobs of the tokens that
    wrote it, read from the engine's output (`feed`'s `tokens`).
    """

    def __init__(self, reasoning: ReasoningParser | None, calls: ToolCalls | None,
                 formatter: TokenFormatter | None = None) -> None:
        self._split = ReasoningStream(reasoning)
        self._calls = calls
        self._formatter = formatter
        self._tokens: CompletionOutput | None = None
        self._sent_content = 0
        self._pending = ""  # blank content not shown yet: it opens a message only if text follows
        self._open: OutputItem | None = None
        self._by_call: dict[int, OutputFunctionCall] = {}
        self.items: list[OutputItem] = []

    def feed(self, text: str, final: bool, tokens: CompletionOutput | None = None) -> list[dict[str, Any]]:
        """The events that the output so far (`text`; `tokens`: the engine's output it is the text of) adds."""
        self._tokens = tokens
        events: list[dict[str, Any]] = []
        reasoning = self._split.update(text, final)
        if reasoning:
            item = self._current(OutputReasoning, events)
            item.content[0].text += reasoning
            events.append(self._part_event("response.reasoning_text.delta", item, delta=reasoning))
        content = self._split.content
        if self._calls is not None:
            delta, call_deltas = self._calls.deltas(content, final)
        else:
            delta, call_deltas = content[self._sent_content:], []
            self._sent_content = len(content)
        if delta:
            self._add_text(self._pending + delta, events)
        for d in call_deltas:
            if d.id is not None:
                self._pending = ""
                self._open_item(OutputFunctionCall(call_id=d.id, name=d.function.name or ""), events)
                self._by_call[d.index] = self._open  # type: ignore[assignment]
            elif d.function.arguments:
                call = self._by_call[d.index]
                call.arguments += d.function.arguments
                events.append({"type": "response.function_call_arguments.delta", "item_id": call.id,
                               "output_index": self.items.index(call), "delta": d.function.arguments})
        return events

    def close(self, complete: bool) -> list[dict[str, Any]]:
        """Ends the open item (`complete` False: the output was cut by max_output_tokens); an answer with no item
        at all gets an empty message."""
        events: list[dict[str, Any]] = []
        if self._pending or not self.items:
            self._add_text(self._pending, events, force=True)
        self._close_open(events, "completed" if complete else "incomplete")
        return events

    # -- helpers
    def _add_text(self, text: str, events: list[dict[str, Any]], force: bool = False) -> None:
        if not isinstance(self._open, OutputMessage) and not text.strip() and not force:
            self._pending = text
            return
        self._pending = ""
        item = self._current(OutputMessage, events)
        part = item.content[0]
        logprobs = self._logprobs(len(part.text), len(part.text) + len(text))
        part.text += text
        part.logprobs += logprobs
        if text:
            events.append(self._part_event("response.output_text.delta", item, delta=text, logprobs=logprobs))

    def _logprobs(self, start: int, end: int) -> list[dict[str, Any]]:
        """The logprobs of the tokens that wrote the message's text[start:end]."""
        if self._formatter is None or self._tokens is None:
            return []
        offset = self._split.content_start  # the message's text is the content's beginning
        return [t.model_dump(mode="json") for t in
                span_logprobs(self._formatter, self._tokens, offset + start, offset + end)]

    def _current(self, kind: type, events: list[dict[str, Any]]) -> Any:
        if not isinstance(self._open, kind):
            self._open_item(kind(), events)
        return self._open

    def _open_item(self, item: OutputItem, events: list[dict[str, Any]]) -> None:
        self._close_open(events, "completed")
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": item.model_dump(mode="json")})
        part = (OutputText(text="") if isinstance(item, OutputMessage)
                else ReasoningText(text="") if isinstance(item, OutputReasoning) else None)
        if part is not None:
            item.content.append(part)  # type: ignore[union-attr, arg-type]
            events.append(self._part_event("response.content_part.added", item, part=part.model_dump(mode="json")))

    def _close_open(self, events: list[dict[str, Any]], status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item.status = status  # type: ignore[assignment]
        if isinstance(item, OutputFunctionCall):
            events.append({"type": "response.function_call_arguments.done", "item_id": item.id,
                           "output_index": self.items.index(item), "name": item.name, "arguments": item.arguments})
        else:
            text = item.content[0].text
            kind = "output_text" if isinstance(item, OutputMessage) else "reasoning_text"
            extra = {"logprobs": item.content[0].logprobs} if isinstance(item, OutputMessage) else {}
            events.append(self._part_event(f"response.{kind}.done", item, text=text, **extra))
            events.append(self._part_event("response.content_part.done", item,
                                           part=item.content[0].model_dump(mode="json")))
        events.append({"type": "response.output_item.done", "output_index": self.items.index(item),
                       "item": item.model_dump(mode="json")})

    def _part_event(self, kind: str, item: OutputItem, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "item_id": item.id, "output_index": self.items.index(item), "content_index": 0,
                **fields}


def assistant_turn(items: list[OutputItem]) -> ChatMessage:
    """The output as the assistant turn the next response's prompt holds (reasoning left out)."""
    text = "".join(p.text for i in items if isinstance(i, OutputMessage) for p in i.content)
    calls = [{"id": i.call_id, "function": {"name": i.name, "arguments": i.arguments}}
             for i in items if isinstance(i, OutputFunctionCall)]
    return ChatMessage.model_validate({"role": "assistant", "content": text or None, "tool_calls": calls or None})


# ---------------------------------------------------------------------- routes


async def _stored(ctx: ServingContext, response_id: str, param: str | None = None) -> dict[str, Any]:
    record = await ctx.engine.session_summary(response_id) if ctx.engine.sessions_enabled else None
    if not isinstance(record, dict) or record.get("object") != RECORD_KIND:
        message = f"Response with id {response_id!r} not found."
        if not ctx.engine.sessions_enabled:
            message += " Responses are not stored on this server (--session-store off)."
        if param is not None:
            raise BadRequestError(message.replace("Response", "Previous response", 1), param=param,
                                  code="previous_response_not_found")
        raise ResponseNotFoundError(message, param="response_id")
    return record


class _Turn:
    """One response being made: its chat run, builder, and what finishing it stores."""

    def __init__(self, body: ResponsesRequest, run: ChatRun, chat: ChatCompletionRequest, history: list[ChatMessage],
                 session_id: str | None, store: bool) -> None:
        tools = chat.active_tools()
        calls = ToolCalls(run.model.tool_parser, tools, chat.parallel_calls()) if tools else None
        self.body, self.run, self.history, self.session_id, self.store = body, run, history, session_id, store
        self.builder = OutputBuilder(run.reasoning, calls,
                                     run.model.formatter if body.logprobs() is not None else None)
        choice = body.tool_choice
        self.response = ResponseObject(
            id=run.generation.request_id, model=run.model_id, instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, metadata=body.metadata or {},
            parallel_tool_calls=body.parallel_tool_calls, previous_response_id=body.previous_response_id,
            store=store, temperature=body.temperature, top_p=body.top_p, user=body.user,
            top_logprobs=body.top_logprobs,
            text={"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                             if body.text is not None and body.text.format is not None else {"type": "text"})},
            tool_choice=choice.model_dump() if isinstance(choice, FunctionToolChoice) else (choice or "auto"),
            tools=[t.model_dump(exclude_none=True) for t in body.tools or ()])

    async def finish(self, ctx: ServingContext) -> list[dict[str, Any]]:
        """Closes the output, fills status and usage, stores the response; the closing events."""
        final = self.run.generation.last
        assert final is not None
        complete = final.outputs[0].finish_reason != "length"
        events = self.builder.close(complete)
        usage = usage_of([final], self.run.reasoning)
        r = self.response
        r.output, r.completed_at = self.builder.items, time.time()
        r.status = "completed" if complete else "incomplete"
        r.incomplete_details = None if complete else IncompleteDetails(reason="max_output_tokens")
        r.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=usage.completion_tokens_details.reasoning_tokens))
        if self.store:
            messages = [*self.history, assistant_turn(r.output)]
            await ctx.engine.set_session_summary(r.id, {
                "object": RECORD_KIND, "session": self.session_id,
                "messages": [m.model_dump(exclude_none=True) for m in messages], "response": r.model_dump(mode="json")})
        return events

    def headers(self) -> dict[str, str]:
        extra = {SESSION_HEADER: self.session_id} if self.session_id is not None else {}
        return {**self.run.budget.headers(), **extra}


def _sse(events: list[dict[str, Any]], counter: list[int]) -> str:
    out = []
    for e in events:
        e["sequence_number"] = counter[0]
        counter[0] += 1
        out.append(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n")
    return "".join(out)


async def _stream(turn: _Turn, ctx: ServingContext) -> AsyncIterator[str]:
    counter = [0]
    snapshot = turn.response.model_dump(mode="json")
    yield _sse([{"type": "response.created", "response": snapshot},
                {"type": "response.in_progress", "response": snapshot}], counter)
    try:
        async for output in turn.run.generation.outputs():
            c = output.outputs[0]
            yield _sse(turn.builder.feed(c.text, final=c.finish_reason is not None, tokens=c), counter)
        events = await turn.finish(ctx)
        done = "response.completed" if turn.response.status == "completed" else "response.incomplete"
        yield _sse([*events, {"type": done, "response": turn.response.model_dump(mode="json")}], counter)
    except Exception as exc:
        error = stream_error(exc)["error"]
        yield _sse([{"type": "error", "code": error.get("code") or error["type"], "message": error["message"],
                     "param": error.get("param")}], counter)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw: Request) -> Response:
    ctx = _ctx(raw)
    ctx.loaded()
    previous = await _stored(ctx, body.previous_response_id, "previous_response_id") if (
        body.previous_response_id is not None) else None
    history = [ChatMessage.model_validate(m) for m in previous["messages"]] if previous else []
    history += input_messages(body.input)
    store = body.store and ctx.engine.sessions_enabled
    session_id = body.session_id or (previous["session"] if previous else None)
    if session_id is None and store:
        session_id = f"conv_{uuid.uuid4().hex}"
    instructions = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    chat = chat_request(body, instructions + history)
    run = await start_chat(chat, raw, ctx, item_id("resp"), session_id)
    turn = _Turn(body, run, chat, history, session_id, store)
    if body.stream:
        return SSEResponse(_stream(turn, ctx), on_close=run.generation.abort, headers=turn.headers())
    try:
        final = await cancel_on_disconnect(raw, run.generation.final())
    finally:
        run.generation.abort()
    turn.builder.feed(final.outputs[0].text, final=True, tokens=final.outputs[0])
    await turn.finish(ctx)
    return json_response(turn.response, headers=turn.headers())


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse((await _stored(_ctx(request), response_id))["response"])


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    ctx = _ctx(request)
    await _stored(ctx, response_id)
    await ctx.engine.delete_session(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

