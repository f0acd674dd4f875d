"""Sessions over HTTP: which session a request belongs to, and GET / DELETE /v1/sessions/{id}.

A chat or text completion joins a session with the request field `session_id` (`extra_body` in the
`openai` client) or the header `X-Session-Id`; the field wins when both are given. Ids are 1-128
characters of letters, digits and `._:@-`. The engine keeps the session's KV between turns
(`AsyncEngine.session_info` etc.): the next turn's `usage.prompt_tokens_details.cached_tokens` counts what
was loaded back. `GET /v1/sessions/{id}` shows a session's size and turns, `DELETE` frees its chunks;
an unknown or expired session is a 404 (`session_not_found`), an unreachable store (Redis down) a 503
(`session_store_unavailable`) while requests in sessions still answer (recomputed).
"""

from __future__ import annotations

import re

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from glmserve.engine.async_engine import AsyncEngine
from glmserve.errors import SessionStoreUnavailableError
from glmserve.server.errors import APIError, BadRequestError, ServiceUnavailableError
from glmserve.server.protocol import SESSION_ID_PATTERN

SESSION_HEADER = "X-Session-Id"

router = APIRouter()


class SessionNotFoundError(APIError):
    """No such session (never made, expired, deleted or dropped by the size cap), or sessions are off (404)."""

    status_code = 404
    default_code = "session_not_found"


def _check_id(session_id: str) -> str:
    if not re.fullmatch(SESSION_ID_PATTERN, session_id):
        raise BadRequestError("session_id must be 1-128 characters of letters, digits and ._:@-",
                              param="session_id")
    return session_id


def request_session_id(field_value: str | None, raw: Request) -> str | None:
    """The request's session: the `session_id` field, else the X-Session-Id header, else None."""
    value = field_value if field_value is not None else raw.headers.get(SESSION_HEADER)
    return None if value is None else _check_id(value)


def _engine(request: Request) -> AsyncEngine:
    """The engine, once the model is ready (503 before) and when it keeps sessions (404 otherwise)."""
    serving = request.app.state.serving
    serving.loaded()
    if not serving.engine.sessions_enabled:
        raise SessionNotFoundError("sessions are off on this server (--session-store off)", code="sessions_off")
    return serving.engine


def _unavailable(exc: SessionStoreUnavailableError) -> ServiceUnavailableError:
    return ServiceUnavailableError(str(exc), code="session_store_unavailable")


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> JSONResponse:
    try:
        info = await _engine(request).session_info(_check_id(session_id))
    except SessionStoreUnavailableError as exc:
        raise _unavailable(exc) from exc
    if info is None:
        raise SessionNotFoundError(f"session {session_id!r} does not exist", param="session_id")
    return JSONResponse(info)


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request) -> JSONResponse:
    try:
        deleted = await _engine(request).delete_session(_check_id(session_id))
    except SessionStoreUnavailableError as exc:
        raise _unavailable(exc) from exc
    if not deleted:
        raise SessionNotFoundError(f"session {session_id!r} does not exist", param="session_id")
    return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})
