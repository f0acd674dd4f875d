"""Semantic context compression over HTTP (glmserve/compress/): POST /v1/compress, and the chat option
`context_compression`.

POST /v1/compress body: `documents` [{`id`, `text`}], optional `query`, at most one of `target_ratio`,
`target_tokens`, `preset` (short / medium / long). Answer: `text`, `original_tokens`, `compressed_tokens`
(in the served model's tokenizer), `ratio`, `spans` [{`doc`, `start`, `end`, `section`, `paragraph`, `page`,
`kind`, `anchors`}] and `documents` [{`id`, `mode`, `reason`, `original_tokens`}].
A chat request's `context_compression` (same fields; `query` defaults to the last user message) puts the
compressed text in a system message after the leading system messages, before prefill; the answer carries
the same object, less `text`, as `context_compression`; a streamed answer sends it in one extra chunk with no
choices (`{"object": "chat.completion.chunk", "choices": [], "context_compression": {...}}`) after every
choice's finish chunk and before the usage chunk and [DONE]. Compression runs in a worker thread.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from glmserve.errors import InvalidRequestError
from glmserve.server.errors import BadRequestError
from glmserve.server.protocol import ChatMessage, ContextCompressionRequest

if TYPE_CHECKING:  # glmserve.compress is imported on first use: it is not needed to start serving
    from glmserve.compress import CompressionResult

router = APIRouter()

CONTEXT_HEADER = "Documents (compressed: each passage is quoted verbatim from its source, in order):\n\n"


async def run_compression(body: ContextCompressionRequest, tokenizer: Any, query: str | None,
                          param: str | None = None) -> CompressionResult:
    from glmserve.compress import Document, compress
    from glmserve.compress.tokens import HFTokenCounter

    docs = [Document(d.id, d.text) for d in body.documents]
    try:
        return await asyncio.to_thread(compress, docs, query, body.target_ratio, body.target_tokens, body.preset,
                                       HFTokenCounter(tokenizer))
    except InvalidRequestError as exc:
        raise BadRequestError(str(exc), param=param) from exc


@router.post("/v1/compress")
async def create_compression(body: ContextCompressionRequest, request: Request) -> JSONResponse:
    result = await run_compression(body, request.app.state.serving.loaded().tokenizer, body.query)
    return JSONResponse(result.to_dict())


async def compress_context(body: ContextCompressionRequest, messages: list[ChatMessage],
                           tokenizer: Any) -> tuple[list[ChatMessage], dict[str, Any]]:
    """The messages with the compressed documents as a system message, and the trace for the answer."""
    query = body.query
    if query is None:
        query = next((m.text() for m in reversed(messages) if m.role == "user"), None)
    result = await run_compression(body, tokenizer, query, "context_compression")
    at = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    context = ChatMessage(role="system", content=CONTEXT_HEADER + result.text)
    trace = result.to_dict()
    del trace["text"]
    return [*messages[:at], context, *messages[at:]], trace
