"""What one request may cost: body size, messages, prompt tokens, `n`, logprobs, stop strings.

`RequestLimits` (glmserve/server/config.py, with the other options) holds the server's limits (each set by a
`glmserve serve` flag, named in every refusal so that a client knows what to ask its operator for).
`BodySizeLimit` is an ASGI middleware that refuses a body over `--max-body-bytes` with OpenAI's error format and
413 before any JSON is parsed (it reads a chunked body only up to the limit); `check_request` and
`check_prompt_tokens` refuse the rest with a 400 once the body is parsed.
"""

from __future__ import annotations

from collections.abc import Iterator

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glmserve.gateway.openai_errors import error_body, send_json
from glmserve.server.config import RequestLimits, flag
from glmserve.server.errors import APIError
from glmserve.server.protocol import ChatCompletionRequest, CompletionRequest


class RequestTooLargeError(APIError):
    """A request over one of the server's limits (400); the message names the limit and its flag."""

    default_code = "request_limit_exceeded"


def _refuse(what: str, value: int, name: str, limit: int, param: str) -> RequestTooLargeError:
    return RequestTooLargeError(
        f"{what} is {value}, over this server's limit of {limit} (glmserve serve {flag(name)}).", param=param)


def _over(limits: RequestLimits, request: ChatCompletionRequest | CompletionRequest) -> Iterator[RequestTooLargeError]:
    if isinstance(request, ChatCompletionRequest) and len(request.messages) > limits.max_messages:
        yield _refuse("The number of messages", len(request.messages), "max_messages", limits.max_messages,
                      "messages")
    if request.n > limits.max_n:
        yield _refuse("n", request.n, "max_n", limits.max_n, "n")
    if isinstance(request, CompletionRequest) and len(request.prompts()) * request.n > limits.max_n:
        yield _refuse("The number of choices (prompts x n)", len(request.prompts()) * request.n, "max_n",
                      limits.max_n, "prompt")
    logprobs = request.num_logprobs()
    if logprobs is not None and logprobs > limits.max_logprobs:
        param = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
        yield _refuse(param, logprobs, "max_logprobs", limits.max_logprobs, param)
    stops = request.stop_list()
    if len(stops) > limits.max_stop_strings:
        yield _refuse("The number of stop strings", len(stops), "max_stop_strings", limits.max_stop_strings, "stop")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_length:
        yield _refuse("The longest stop string's length", longest, "max_stop_length", limits.max_stop_length, "stop")


def check_request(limits: RequestLimits, request: ChatCompletionRequest | CompletionRequest) -> None:
    """Raises RequestTooLargeError for the first limit `request` is over."""
    for error in _over(limits, request):
        raise error


def check_prompt_tokens(limits: RequestLimits, num_tokens: int, param: str) -> None:
    """Raises RequestTooLargeError when a prompt has more tokens than `--max-prompt-tokens`."""
    if limits.max_prompt_tokens is not None and num_tokens > limits.max_prompt_tokens:
        raise _refuse("The prompt's length in tokens", num_tokens, "max_prompt_tokens", limits.max_prompt_tokens,
                      param)


class BodySizeLimit:
    """Pure ASGI middleware: a request body over `max_bytes` gets 413 in OpenAI's error format.

    A declared Content-Length over the limit is refused before reading; otherwise the body is read (at most
    `max_bytes` + one chunk) and replayed to the app, so a chunked upload cannot get around the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Send) -> None:
        message = (f"The request body is over this server's limit of {self.max_bytes} bytes "
                   f"(glmserve serve {flag('max_body_bytes')}).")
        await send_json(send, 413, error_body(message, "invalid_request_error", "request_too_large"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees that at once
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        pending: list[Message] = [message]

        async def replay() -> Message:
            # the whole body (or the disconnect) first; later reads wait for the disconnect as without us
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)
