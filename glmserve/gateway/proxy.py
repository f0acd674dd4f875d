"""Forwarding one request: pick a backend, send it with the canonical model id, relay the answer with the id the
client sent. Timeouts: connect, first byte (scaled by the prompt's length, capped by --request-timeout; a whole
answer when not streamed) and the idle gap between stream chunks. On a timeout or a client disconnect the
upstream connection is closed, so that the backend aborts the request and frees its KV (glmserve does so on
disconnect). Connect errors, 5xx and connections lost before the first byte reached the client are retried on
another backend (at most --max-retries, within the retry budget); a stream cut after that ends with an SSE error
event, never with `[DONE]`.

Upstream requests go through one pooled aiohttp session (keep-alive, C HTTP parser): its cost per request is a
fraction of httpx's (bench/RESULTS.md "Gateway"); the backend probes keep their httpx client (backends.py)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from glmserve.gateway.admission import PARSED_BODY
from glmserve.gateway.backends import Backend, BackendPool
from glmserve.gateway.models_map import ModelMap
from glmserve.gateway.proxy_metrics import ProxyMetrics
from glmserve.gateway.proxy_options import ProxyOptions
from glmserve.gateway.retry_budget import RetryBudget
from glmserve.gateway.router import Router, prompt_text
from glmserve.gateway.sse import EventRelay, error_body, error_event, rewrite_model

T = TypeVar("T")
# not forwarded either way (RFC 9110 section 7.6.1 hop-by-hop fields, plus what the gateway sets itself)
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding",
                        "content-encoding",
                        "authorization", "api-key", "x-api-key"})  # the client's credentials never go upstream
RESPONSE_SKIP = HOP_BY_HOP | {"date", "server"}  # the gateway's server sets its own
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
CHARS_PER_TOKEN = 4  # prompt tokens are estimated from characters (the gateway has no tokenizer)


class _Retryable(Exception):
    """An attempt failed before anything reached the client: another backend may take the request."""

    def __init__(self, reason: str, response: Response) -> None:
        self.reason = reason
        self.response = response


class _ClientGone(Exception):
    pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class _Request:
    method: str
    path: str  # with the query string
    body: bytes
    headers: dict[str, str]
    stream: bool
    echo_model: str | None  # the id to echo when it differs from the canonical one sent upstream
    timeout_s: float  # first byte (streams) or the whole answer


def _error(status: int, message: str, code: str, request_id: str, error_type: str = "server_error",
           retry_after: int | None = None) -> JSONResponse:
    headers = {"x-request-id": request_id}
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    return JSONResponse(error_body(message, code, error_type), status_code=status, headers=headers)


class Proxy:
    def __init__(self, pool: BackendPool, default_group: tuple[Backend, ...], models: ModelMap,
                 options: ProxyOptions, request_timeout_s: float, metrics: ProxyMetrics,
                 keep_alive_s: float = 4.0) -> None:
        self.pool = pool
        self.default_group = default_group
        self.groups = {name: pool.group(urls) for name, urls in models.pools.items()}
        self.models = models
        self.options = options
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.keep_alive_s = keep_alive_s  # idle upstream connections are closed after this (app.py says why)
        self.session: aiohttp.ClientSession | None = None  # opened by start(), in the server's event loop
        self.router = Router(options.load_factor, options.prefix_chars)
        self.budget = RetryBudget(options.retry_budget, floor=10)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, keepalive_timeout=self.keep_alive_s)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.options.connect_timeout_s),
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def first_byte_timeout(self, prompt_chars: int) -> float:
        tokens = prompt_chars / CHARS_PER_TOKEN
        return min(self.request_timeout_s,
                   self.options.first_token_timeout_s + self.options.first_token_s_per_1k * tokens / 1000)

    async def handle(self, request: Request) -> Response:
        raw = await request.body()
        payload: Any = request.scope.get(PARSED_BODY)  # GatewayMiddleware parsed it already
        if payload is None and raw and request.method == "POST":
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = None  # forwarded as it is: the backend answers it with its own 400
        payload = payload if isinstance(payload, dict) else {}
        client_model = payload.get("model")
        route = self.models.resolve(client_model) if isinstance(client_model, str) else None
        group = self.groups[route.pool] if route is not None and route.pool else self.default_group
        echo = None
        if route is not None and route.canonical != client_model:
            payload["model"], echo = route.canonical, client_model
            raw = json.dumps(payload).encode()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {k: v for k, v in request.headers.items() if k not in HOP_BY_HOP}
        headers["x-request-id"] = request_id
        headers["accept-encoding"] = "identity"  # bodies are rewritten (model echo): none compressed
        stream = payload.get("stream") is True
        session = request.headers.get("x-session-id") or payload.get("session_id")
        prompt = prompt_text(payload) if payload else ""
        rule, key = self.router.affinity_key(session if isinstance(session, str) else None, prompt)
        scope = request.scope  # the path as the client sent it (percent-escapes kept; no URL object per request)
        raw_path, query = scope.get("raw_path"), scope.get("query_string", b"").decode("latin-1")
        path = (raw_path.decode("latin-1") if raw_path else scope["path"]) + (f"?{query}" if query else "")
        timeout_s = self.first_byte_timeout(len(prompt)) if stream else self.request_timeout_s
        call = _Request(request.method, path, raw, headers, stream, echo, timeout_s)
        response = await self._dispatch(request, call, group, rule, key, request_id)
        self.metrics.responses.labels(str(response.status_code)).inc()
        return response

    async def _dispatch(self, request: Request, call: _Request, group: tuple[Backend, ...], rule: str,
                        key: int | None, request_id: str) -> Response:
        self.budget.on_request()
        tried: list[Backend] = []
        failure: _Retryable | None = None
        while True:
            candidates = [b for b in self.pool.candidates(group) if b not in tried]
            backend = self.router.choose(group, candidates, key)
            if backend is None:
                break
            if failure is not None:
                if len(tried) > self.options.max_retries or not self.budget.try_retry():
                    self.metrics.retries_refused.inc()
                    break
                self.metrics.retries.labels(failure.reason).inc()
            tried.append(backend)
            self.metrics.routed.labels(rule, "standby" if backend.standby else "active").inc()
            try:
                return await (self._stream if call.stream else self._unary)(request, backend, call)
            except _Retryable as exc:
                failure = exc
            except _ClientGone:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
        if failure is not None:
            return failure.response
        return _error(503, "No backend is available for this model right now.", "no_backend_available",
                      request_id, retry_after=1)

    async def _guarded(self, request: Request, timeout_s: float, work: Callable[[], Awaitable[T]]) -> T:
        """`work()` under a deadline (TimeoutError), cancelled also when the client disconnects (_ClientGone);
        cancelling an aiohttp request closes its connection."""
        task = asyncio.ensure_future(work())
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait((task, watcher), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))  # the connection is closed before the caller goes on
                if not task.cancelled():
                    task.exception()  # retrieved: an error after the deadline does not matter any more
        if task in done:
            return task.result()
        if watcher in done:
            raise _ClientGone()
        raise TimeoutError()

    def _failed(self, backend: Backend, outcome: str, reason: str, request_id: str) -> _Retryable:
        self.metrics.upstream.labels(backend.url, outcome).inc()
        backend.breaker.on_failure()
        return _Retryable(reason, _error(502, f"The backend failed ({reason}).", "upstream_error", request_id))

    async def _send(self, request: Request, backend: Backend, call: _Request,
                    started: float) -> tuple[aiohttp.ClientResponse, bytes]:
        """Sends the request and waits for the response head and, not streamed, the whole body (else b"")."""
        rid = call.headers["x-request-id"]
        assert self.session is not None, "Proxy.start() was not awaited"
        session = self.session

        async def exchange() -> tuple[aiohttp.ClientResponse, bytes]:
            response = await session.request(call.method, backend.url + call.path, data=call.body,
                                             headers=backend.upstream_headers(call.headers), allow_redirects=False)
            return response, b"" if call.stream else await response.read()

        try:
            response, body = await self._guarded(request, call.timeout_s, exchange)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:  # before the deadline's
            raise self._failed(backend, "connect_error", "connect_error", rid) from exc  # TimeoutError: a subclass
        except TimeoutError:
            self.metrics.timeouts.labels("first_byte" if call.stream else "request").inc()
            self.metrics.upstream.labels(backend.url, "timeout").inc()
            backend.breaker.on_failure()
            raise
        except aiohttp.ClientError as exc:
            raise self._failed(backend, "transport_error", "transport_error", rid) from exc
        self.metrics.upstream.labels(backend.url, str(response.status)).inc()
        if response.status >= 500:
            try:
                body = await response.read() if call.stream else body
            except aiohttp.ClientError:
                body = b""
            finally:
                response.close()
            backend.breaker.on_failure()
            raise _Retryable(f"status_{response.status}", self._relay_whole(response, body, call, started, backend))
        return response, body

    def _relay_whole(self, response: aiohttp.ClientResponse, body: bytes, call: _Request, started: float,
                     backend: Backend) -> Response:
        self.metrics.duration.labels(backend.url).observe(time.perf_counter() - started)
        if call.echo_model is not None and response.headers.get("content-type", "").startswith("application/json"):
            body = rewrite_model(body, call.echo_model)
        return Response(body, status_code=response.status, headers=_relayed_headers(response, call))

    async def _unary(self, request: Request, backend: Backend, call: _Request) -> Response:
        started = time.perf_counter()
        backend.in_flight += 1
        backend.breaker.acquire()
        try:
            try:
                response, body = await self._send(request, backend, call, started)
            except TimeoutError:
                return _error(504, f"The backend did not answer within {call.timeout_s:g} s.", "upstream_timeout",
                              call.headers["x-request-id"])
            except _ClientGone:
                backend.breaker.on_release()
                raise
            self.metrics.first_byte.labels(backend.url).observe(time.perf_counter() - started)
            backend.breaker.on_success()
            return self._relay_whole(response, body, call, started, backend)
        finally:
            backend.in_flight -= 1

    async def _stream(self, request: Request, backend: Backend, call: _Request) -> Response:
        started = time.perf_counter()
        rid = call.headers["x-request-id"]
        backend.in_flight += 1
        backend.breaker.acquire()
        handed_over = False
        response: aiohttp.ClientResponse | None = None
        try:
            try:
                response, _ = await self._send(request, backend, call, started)
                if response.status != 200:  # a 4xx: no stream to relay (but the backend answered)
                    body = await response.read()
                    response.release()
                    backend.breaker.on_success()
                    return self._relay_whole(response, body, call, started, backend)
                chunks = _body_chunks(response.content)
                first = await self._guarded(request, max(0.0, call.timeout_s - (time.perf_counter() - started)),
                                            lambda: anext(chunks))
            except TimeoutError:
                if response is not None:
                    self.metrics.timeouts.labels("first_byte").inc()
                    backend.breaker.on_failure()
                return _error(504, f"The backend sent no token within {call.timeout_s:g} s.", "upstream_timeout",
                              rid)
            except _ClientGone:
                backend.breaker.on_release()
                raise
            except (StopAsyncIteration, aiohttp.ClientError) as exc:
                raise self._failed(backend, "transport_error", "stream_lost_before_first_byte", rid) from exc
            self.metrics.first_byte.labels(backend.url).observe(time.perf_counter() - started)
            lease = _StreamLease(backend, response, started, self.metrics)
            handed_over = True
            return _RelayedStream(self._relay_stream(lease, chunks, first, call), lease,
                                  headers=_relayed_headers(response, call))
        except aiohttp.ClientError as exc:  # reading the 4xx body
            raise self._failed(backend, "transport_error", "transport_error", rid) from exc
        finally:
            if not handed_over:
                if response is not None:
                    response.close()
                backend.in_flight -= 1

    async def _relay_stream(self, lease: _StreamLease, chunks: AsyncIterator[bytes], first: bytes,
                            call: _Request) -> AsyncIterator[bytes]:
        relay = EventRelay(call.echo_model)
        verdict: bool | None = None  # None: the client left
        try:
            out = relay.feed(first)
            if out:
                yield out
            while True:
                with anyio.move_on_after(self.options.idle_timeout_s) as idle:
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                if idle.cancelled_caught:
                    self.metrics.timeouts.labels("idle").inc()
                    self.metrics.stream_errors.labels("idle_timeout").inc()
                    verdict = False
                    yield error_event(f"The backend sent nothing for {self.options.idle_timeout_s:g} s; the "
                                      "stream was closed.", "upstream_idle_timeout")
                    return
                out = relay.feed(chunk)
                if out:
                    yield out
            if relay.saw_done:
                verdict = True
            else:
                self.metrics.stream_errors.labels("ended_without_done").inc()
                verdict = False
                yield error_event("The backend ended the stream before it was complete.", "upstream_stream_cut")
        except aiohttp.ClientError:
            self.metrics.stream_errors.labels("cut").inc()
            verdict = False
            yield error_event("The connection to the backend was lost mid-stream.", "upstream_stream_cut")
        finally:
            await lease.close(verdict)


class _StreamLease:
    """A relayed stream's hold on its backend: released once, by the relay's end or by the response's own end
    (a client gone before the relay started never runs the relay's `finally`)."""

    def __init__(self, backend: Backend, response: aiohttp.ClientResponse, started: float,
                 metrics: ProxyMetrics) -> None:
        self.backend = backend
        self.response = response
        self.started = started
        self.metrics = metrics
        self.closed = False

    async def close(self, verdict: bool | None) -> None:
        if self.closed:
            return
        self.closed = True
        if verdict is True:
            self.response.release()  # read to its end: the connection goes back to the pool
        else:
            self.response.close()  # unfinished: the connection is closed, so the backend aborts the request
        self.backend.in_flight -= 1
        breaker = self.backend.breaker
        if verdict is True:
            breaker.on_success()
        elif verdict is False:
            breaker.on_failure()
        else:
            breaker.on_release()
        self.metrics.duration.labels(self.backend.url).observe(time.perf_counter() - self.started)


async def _body_chunks(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body as it arrives. When the connection is lost, what had arrived before is given out ahead of the
    error: aiohttp's `readany()` raises at once and would drop it (aiohttp/streams.py, StreamReader.readany)."""
    while True:
        try:
            chunk = await content.readany()
        except aiohttp.ClientPayloadError:
            left = content._read_nowait(-1)  # the buffer, without readany's exception check
            if left:
                yield left
            raise
        if not chunk:
            return
        yield chunk


def _relayed_headers(response: aiohttp.ClientResponse, call: _Request) -> dict[str, str]:
    headers = {k.lower(): v for k, v in response.headers.items() if k.lower() not in RESPONSE_SKIP}
    headers["x-request-id"] = call.headers["x-request-id"]
    return headers


class _RelayedStream(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], lease: _StreamLease, headers: dict[str, str]) -> None:
        super().__init__(content, headers=headers)
        self.lease = lease

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.lease.close(None)
