"""Log lines that carry their request's id, as text or JSON, and the `x-request-id` header.

`RequestIdMiddleware` gives each HTTP request an id (the client's `x-request-id` when it is 1-128 printable
ASCII characters, else a new one), returns it in the `x-request-id` response header and keeps it in a context
variable for the request's task (glmserve/log_context.py, which the engine carries onto its own thread with
each request); `logging_config` (a `logging.config.dictConfig` dict, also given to uvicorn so that its access
and error lines look the same) adds it to every line: `[-]` outside any request (startup, a whole batch).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glmserve import log_context
from glmserve.log_context import NO_REQUEST

REQUEST_ID_HEADER = "x-request-id"
_VALID_ID = re.compile(rb"[\x21-\x7e]{1,128}")


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id` from the context of the request being served (on any thread)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = log_context.current()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, thread, request_id, message (and
    exc_info)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "thread": record.threadName,
            "request_id": getattr(record, "request_id", NO_REQUEST),
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


TEXT_FORMAT = "%(levelname)s %(name)s [%(request_id)s]: %(message)s"


def logging_config(level: str, log_format: str) -> dict[str, Any]:
    """dictConfig for the root logger and uvicorn's loggers: one stderr handler, the request id on each line."""
    formatter: dict[str, Any] = ({"()": f"{__name__}.JsonFormatter"} if log_format == "json"
                                 else {"format": TEXT_FORMAT})
    handler = {"class": "logging.StreamHandler", "formatter": "glmserve", "filters": ["request_id"],
               "stream": "ext://sys.stderr"}
    uvicorn = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": f"{__name__}.RequestIdFilter"}},
        "formatters": {"glmserve": formatter},
        "handlers": {"default": handler},
        "root": {"handlers": ["default"], "level": level.upper()},
        "loggers": {name: uvicorn for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }


class RequestIdMiddleware:
    """Pure ASGI middleware: the request's id in a context variable and in the `x-request-id` response header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode())
        rid = given.decode() if given is not None and _VALID_ID.fullmatch(given) else uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER.encode()]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER.encode(), rid.encode())]}
            await send(message)

        with log_context.about(rid):
            await self.app(scope, receive, send_with_id)
