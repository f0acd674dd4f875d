"""The output constraint of an API request: response_format, vLLM's guided_* extras, or a forced tool call."""

from __future__ import annotations

import asyncio
import json

from glmserve.engine.structured import GrammarCompileError, GuidedSpec
from glmserve.server.errors import BadRequestError
from glmserve.server.protocol import ChatCompletionRequest, CompletionRequest
from glmserve.server.state import ServedModel
from glmserve.server.tool_parsers import ToolParser


def guided_spec(request: ChatCompletionRequest | CompletionRequest, parser: ToolParser | None) -> GuidedSpec | None:
    """What the request's output must match (None: free text). The protocol has checked that at most one
    constraint is given; a chat request that forces a tool call (`required`, a named function) gets the grammar
    of its parser's call format, so that the call always parses."""
    if request.guided_json is not None:
        schema = request.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise BadRequestError(f"guided_json is not JSON: {exc}", param="guided_json") from exc
        return GuidedSpec.json_schema(schema)
    if request.guided_regex is not None:
        return GuidedSpec("regex", request.guided_regex)
    if request.guided_choice is not None:
        return GuidedSpec.choice(request.guided_choice)
    if request.guided_grammar is not None:
        return GuidedSpec("grammar", request.guided_grammar)
    if not isinstance(request, ChatCompletionRequest):
        return None
    if request.forces_tool_call() and parser is not None:
        return GuidedSpec("grammar", parser.grammar(request.active_tools(), request.parallel_calls()))
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GuidedSpec("json_object")
    assert fmt.json_schema is not None
    # OpenAI's strict mode and ours are the same: the grammar enforces the whole schema either way
    return GuidedSpec.json_schema(fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {})


def guided_param(request: ChatCompletionRequest | CompletionRequest) -> str:
    """The request field a compile error points at."""
    fields = request.guided_fields()
    if fields:
        return fields[0]
    if isinstance(request, ChatCompletionRequest) and request.forces_tool_call():
        return "tools"
    return "response_format"


async def compiled_guided(request: ChatCompletionRequest | CompletionRequest, model: ServedModel) -> GuidedSpec | None:
    """The request's constraint, its grammar compiled in a worker thread (so the engine thread finds it cached);
    a grammar that cannot be compiled is a 400 that says why."""
    spec = guided_spec(request, model.tool_parser)
    if spec is None:
        return None
    try:
        await asyncio.to_thread(model.compile_grammar, spec)
    except GrammarCompileError as exc:
        raise BadRequestError(str(exc), param=guided_param(request), code="invalid_grammar") from exc
    return spec
