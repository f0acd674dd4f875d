"""`--request-timeout` inside `glmserve serve`: an ASGI middleware that bounds how long a completion request waits
for its answer (non-streamed: the whole answer; streamed: the first chunk, which the server sends once the prompt
is processed, and then each gap between two chunks). When the time is up the client gets a 504 in OpenAI's error
format, or, once a stream has begun, an SSE error event and the end of the stream (never `[DONE]`); the app behind
sees its client disconnect, which aborts the engine request and frees its KV (the server's own disconnect path).
(`glmserve gateway` bounds its upstream requests itself: proxy.py.)

    app = RequestDeadline(inner_app, timeout_s, registry=my_registry)
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glmserve.gateway.admission import BILLED_PATHS, canonical_path
from glmserve.gateway.openai_errors import error_body, send_json
from glmserve.gateway.sse import error_event

DISCONNECT: Message = {"type": "http.disconnect"}


class RequestDeadline:
    def __init__(self, app: ASGIApp, timeout_s: float, registry: CollectorRegistry | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"--request-timeout must be > 0, got {timeout_s}")
        self.app = app
        self.timeout_s = timeout_s
        self.timeouts = Counter("glmserve_request_timeouts", "Requests stopped by --request-timeout, by kind "
                                "(request: no answer yet; idle: a stream that stalled)", ["kind"],
                                registry=registry if registry is not None else CollectorRegistry())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or canonical_path(scope["path"]) not in BILLED_PATHS:
            await self.app(scope, receive, send)
            return
        await _Watched(self, receive, send).run(scope)


class _Watched:
    """One request under a deadline that each message the app sends moves on by timeout_s."""

    def __init__(self, owner: RequestDeadline, receive: Receive, send: Send) -> None:
        self.owner = owner
        self.client_receive, self.client_send = receive, send
        self.expired = asyncio.Event()
        self.lock = asyncio.Lock()  # the app's sends and the timeout's answer never interleave
        self.started = self.finished = self.sse = False
        self.deadline = asyncio.get_running_loop().time() + owner.timeout_s

    async def run(self, scope: Scope) -> None:
        watchdog = asyncio.create_task(self._watch())
        try:
            await self.owner.app(scope, self._receive, self._send)
        finally:
            watchdog.cancel()

    async def _receive(self) -> Message:
        """The client's messages, or a disconnect once the deadline passed (the app then aborts its work)."""
        if self.expired.is_set():
            return DISCONNECT
        message = asyncio.ensure_future(self.client_receive())
        expired = asyncio.ensure_future(self.expired.wait())
        try:
            await asyncio.wait({message, expired}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this receive itself was cancelled
            message.cancel()
            raise
        finally:
            expired.cancel()
        if message.done():
            return message.result()
        message.cancel()
        return DISCONNECT

    async def _send(self, message: Message) -> None:
        async with self.lock:
            if self.expired.is_set():
                return  # the client has its 504 or its error event already
            if message["type"] == "http.response.start":
                self.started = True
                self.sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                               for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self.finished = True
            self.deadline = asyncio.get_running_loop().time() + self.owner.timeout_s
            await self.client_send(message)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while (wait := self.deadline - loop.time()) > 0:
            await asyncio.sleep(wait)
        async with self.lock:
            if self.finished:
                return
            self.expired.set()
            timeout = f"{self.owner.timeout_s:g} s (--request-timeout)"
            if not self.started:
                self.owner.timeouts.labels("request").inc()
                await send_json(self.client_send, 504, error_body(
                    f"The request got no answer within {timeout}; it was stopped.", "server_error",
                    "request_timeout"))
                return
            self.owner.timeouts.labels("idle").inc()
            body = error_event(f"The stream sent nothing for {timeout}; it was stopped.", "request_timeout") \
                if self.sse else b""
            await self.client_send({"type": "http.response.body", "body": body, "more_body": False})
