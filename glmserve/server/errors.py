"""OpenAI-style errors: typed exceptions and the handlers that turn them into JSON.

Every failure leaves the server as `{"error": {"message", "type", "param", "code"}}` with the
matching HTTP status; unexpected exceptions are logged here and reach the client only as a
generic 500 message, never as a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from glmserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error fields."""

    status_code = 400
    error_type = "invalid_request_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code


class BadRequestError(APIError):
    """Invalid request values (400)."""


class ModelNotFoundError(APIError):
    """The requested model id is neither the served model nor one of its aliases (404)."""

    status_code = 404
    default_code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class ServiceUnavailableError(APIError):
    """Overloaded, not ready yet or shutting down (503, sent with Retry-After)."""

    status_code = 503
    error_type = "server_error"


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def api_error_response(exc: APIError, retry_after_s: int) -> JSONResponse:
    """JSON response for `exc`; 503s carry Retry-After."""
    headers = {"Retry-After": str(retry_after_s)} if exc.status_code == 503 else None
    body = error_body(exc.message, exc.error_type, param=exc.param, code=exc.code)
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def _location(error: dict[str, Any]) -> list[str]:
    return [str(part) for part in error.get("loc", ()) if part != "body"]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable message, and the offending parameter, from pydantic's error list.

    A value that matches no member of a union (say, message content that is neither a string
    nor text parts) yields one error per member; the parameter is then their common location
    and the message is the most specific (deepest) error's.
    """
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    if errors[0].get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    locations = [_location(e) for e in errors]
    common: list[str] = []
    for parts in zip(*locations):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    param = ".".join(common) or None
    deepest = max(range(len(errors)), key=lambda k: len(locations[k]))
    message = str(errors[deepest].get("msg", "invalid value")).removeprefix("Value error, ")
    if param:
        message = f"Invalid value for '{param}': {message}"
    return message, param


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Route every exception type to an OpenAI-format JSON response."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return api_error_response(exc, retry_after_s)

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return api_error_response(BadRequestError(message, param=param), retry_after_s)

    async def on_invalid_request(_: Request, exc: Exception) -> JSONResponse:
        # the engine's typed refusal of a value (a guided_choice, say) that a handler did not translate itself
        return api_error_response(BadRequestError(str(exc)), retry_after_s)

    async def on_too_deep(_: Request, exc: Exception) -> JSONResponse:
        # json.loads of a body nested thousands of levels deep (pydantic's own depth limit catches the rest)
        return api_error_response(BadRequestError("The request body is nested too deeply."), retry_after_s)

    async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(str(exc.detail), error_type, code=None)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error while serving a request", exc_info=exc)
        body = error_body("The server had an internal error while processing the request.", "server_error")
        return JSONResponse(body, status_code=500)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(InvalidRequestError, on_invalid_request)
    app.add_exception_handler(RecursionError, on_too_deep)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
