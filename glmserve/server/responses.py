"""Response helpers: pydantic JSON bodies, and server-sent events as OpenAI streams them
(`data: {json}` frames ending with `data: [DONE]`)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from glmserve.server.errors import APIError, error_body

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_response(payload: BaseModel, headers: dict[str, str] | None = None) -> Response:
    """200 with the model serialized by pydantic (non-finite floats become null)."""
    return Response(payload.model_dump_json(), media_type="application/json", headers=headers)


def event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def stream_error(exc: Exception) -> dict:
    """The error body for a stream whose 200 header is already sent (no traceback)."""
    if isinstance(exc, APIError):
        return error_body(exc.message, exc.error_type, param=exc.param, code=exc.code)
    logger.error("unhandled error while streaming a response", exc_info=exc)
    return error_body("The server had an internal error while processing the request.", "server_error")


def error_event(exc: Exception) -> str:
    """An error frame of a chat or completion stream."""
    return f"data: {json.dumps(stream_error(exc))}\n\n"


class SSEResponse(StreamingResponse):
    """A streaming response that calls `on_close` however it ends: finished, failed, or cut
    short by a client disconnect (even one that comes before the first event)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream", headers={**_HEADERS, **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
