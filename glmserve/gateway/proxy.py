"""Forwarding one request: pick a backend, send it with the canonical model id, relay the answer with the id the
client sent. Timeouts: connect, first byte (scaled by the prompt's length, capped by --request-timeout; a whole
answer when not streamed) and the idle gap between stream chunks. On a timeout or a client disconnect the
upstream connection is closed, so that the backend aborts the request and frees its KV (glmserve does so on
disconnect). Connect errors, 5xx and connections lost before the first byte reached the client are retried on
another backend (at most --max-retries, within the retry budget); a stream cut after that ends with an SSE error
event, never with `[DONE]`.

A pure ASGI app (no Starlette Request/Response per request); upstream requests go through the gateway's own
keep-alive HTTP/1.1 client (upstream.py), whose cost per request is a fraction of aiohttp's and httpx's
(bench/RESULTS.md "Gateway"); the backend probes keep their httpx client (backends.py). One task per request
watches for the client leaving and aborts the upstream exchange in progress."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

from glmserve.gateway import fastjson
from glmserve.gateway.admission import PARSED_BODY
from glmserve.gateway.asgi_body import read_body
from glmserve.gateway.backends import Backend, BackendPool
from glmserve.gateway.models_map import ModelMap
from glmserve.gateway.proxy_metrics import ProxyMetrics
from glmserve.gateway.proxy_options import ProxyOptions
from glmserve.gateway.retry_budget import RetryBudget
from glmserve.gateway.router import Router, prompt_text
from glmserve.gateway.sse import EventRelay, error_body, error_event, rewrite_model
from glmserve.gateway.upstream import Exchange, UpstreamConnectError, UpstreamError, UpstreamPool

# not forwarded either way (RFC 9110 section 7.6.1 hop-by-hop fields, plus what the gateway sets itself)
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"accept-encoding",
                        b"content-encoding", b"x-request-id",  # set by the gateway (the client's, or a new one)
                        b"authorization", b"api-key", b"x-api-key"})  # the client's credentials never go upstream
RESPONSE_SKIP = HOP_BY_HOP | {b"date", b"server"}  # the gateway's server sets its own
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
CHARS_PER_TOKEN = 4  # prompt tokens are estimated from characters (the gateway has no tokenizer)
JSON_TYPE = b"application/json"


@dataclass
class _Answer:
    """A whole response, sent at once."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""

    async def send(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [*self.headers, (b"content-length", str(len(self.body)).encode())]})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


class _Retryable(Exception):
    """An attempt failed before anything reached the client: another backend may take the request."""

    def __init__(self, reason: str, answer: _Answer) -> None:
        self.reason = reason
        self.answer = answer


class _ClientGone(Exception):
    pass


class _Watch:
    """The request's disconnect watcher: once the client leaves, the exchange in progress (and any later) is
    aborted with _ClientGone."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self.exchange: Exchange | None = None
        self._task = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self.exchange is not None:
            self.exchange.abort(_ClientGone())

    def follow(self, exchange: Exchange) -> None:
        self.exchange = exchange
        if self.gone:
            exchange.abort(_ClientGone())

    def stop(self) -> None:
        self._task.cancel()


@dataclass
class _Request:
    method: str
    path: str  # with the query string
    body: bytes
    headers: list[tuple[bytes, bytes]]  # to forward (hop-by-hop and credentials removed, x-request-id set)
    request_id: str
    stream: bool
    echo_model: str | None  # the id to echo when it differs from the canonical one sent upstream
    timeout_s: float  # first byte (streams) or the whole answer


def _error(status: int, message: str, code: str, request_id: str, error_type: str = "server_error",
           retry_after: int | None = None) -> _Answer:
    headers = [(b"content-type", JSON_TYPE), (b"x-request-id", request_id.encode("latin-1"))]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    return _Answer(status, headers, json.dumps(error_body(message, code, error_type)).encode())


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
        # idle upstream connections are closed after keep_alive_s (app.py says why)
        self.upstream = UpstreamPool(options.connect_timeout_s, keep_alive_s)
        self.router = Router(options.load_factor, options.prefix_chars)
        self.budget = RetryBudget(options.retry_budget, floor=10)

    async def start(self) -> None:
        pass  # connections are opened on demand, in the server's event loop

    async def close(self) -> None:
        self.upstream.close()

    def first_byte_timeout(self, prompt_chars: int) -> float:
        tokens = prompt_chars / CHARS_PER_TOKEN
        return min(self.request_timeout_s,
                   self.options.first_token_timeout_s + self.options.first_token_s_per_1k * tokens / 1000)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw, client_gone = await read_body(receive)
        if client_gone:
            return
        payload: Any = scope.get(PARSED_BODY)  # GatewayMiddleware parsed it already
        if payload is None and raw and scope["method"] == "POST":
            try:
                payload = fastjson.loads(raw)
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
        request_id = session = None
        headers = []
        for name, value in scope["headers"]:
            if name not in HOP_BY_HOP:
                headers.append((name, value))
                if name == b"x-session-id":
                    session = value.decode("latin-1")
            elif name == b"x-request-id":
                request_id = value.decode("latin-1")
        request_id = request_id or os.urandom(16).hex()
        headers += ((b"x-request-id", request_id.encode("latin-1")), (b"accept-encoding", b"identity"))
        stream = payload.get("stream") is True
        session = session or payload.get("session_id")
        prompt = prompt_text(payload) if payload else ""
        rule, key = self.router.affinity_key(session if isinstance(session, str) else None, prompt)
        # the path as the client sent it (percent-escapes kept)
        raw_path, query = scope.get("raw_path"), scope.get("query_string", b"").decode("latin-1")
        path = (raw_path.decode("latin-1") if raw_path else scope["path"]) + (f"?{query}" if query else "")
        timeout_s = self.first_byte_timeout(len(prompt)) if stream else self.request_timeout_s
        call = _Request(scope["method"], path, raw, headers, request_id, stream, echo, timeout_s)
        watch = _Watch(receive)
        try:
            status = await self._dispatch(watch, send, call, group, rule, key)
        finally:
            watch.stop()
        self.metrics.responses.labels(str(status)).inc()

    async def _dispatch(self, watch: _Watch, send: Send, call: _Request, group: tuple[Backend, ...], rule: str,
                        key: int | None) -> int:
        """Sends the answer; returns its status."""
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
                return await (self._stream if call.stream else self._unary)(watch, send, backend, call)
            except _Retryable as exc:
                failure = exc
            except _ClientGone:  # sent to nobody, but admission sees the request answered (its tokens refunded)
                failure = _Retryable("client_gone", _Answer(CLIENT_CLOSED_REQUEST, []))
                break
        answer = failure.answer if failure is not None else _error(
            503, "No backend is available for this model right now.", "no_backend_available", call.request_id,
            retry_after=1)
        await answer.send(send)
        return answer.status

    def _failed(self, backend: Backend, outcome: str, reason: str, request_id: str) -> _Retryable:
        self.metrics.upstream.labels(backend.url, outcome).inc()
        backend.breaker.on_failure()
        return _Retryable(reason, _error(502, f"The backend failed ({reason}).", "upstream_error", request_id))

    async def _send(self, watch: _Watch, backend: Backend, call: _Request, started: float) -> tuple[Exchange, bytes]:
        """Sends the request and waits for the response head and, not streamed, the whole body (else b"")."""
        exchange = self.upstream.exchange(backend.url)
        watch.follow(exchange)
        headers = call.headers
        if backend.api_key is not None:
            headers = [*headers, (b"authorization", f"Bearer {backend.api_key}".encode("latin-1"))]
        try:
            await exchange.send(call.method, call.path, headers, call.body, call.timeout_s)
            body = b"" if call.stream else await exchange.read(call.timeout_s - (time.perf_counter() - started))
        except UpstreamConnectError as exc:
            raise self._failed(backend, "connect_error", "connect_error", call.request_id) from exc
        except TimeoutError:
            exchange.close()
            self.metrics.timeouts.labels("first_byte" if call.stream else "request").inc()
            self.metrics.upstream.labels(backend.url, "timeout").inc()
            backend.breaker.on_failure()
            raise
        except UpstreamError as exc:
            exchange.close()
            raise self._failed(backend, "transport_error", "transport_error", call.request_id) from exc
        except BaseException:  # the client left (_ClientGone), or the request was cancelled
            exchange.close()
            raise
        self.metrics.upstream.labels(backend.url, str(exchange.status)).inc()
        if exchange.status >= 500:
            try:
                body = await exchange.read(call.timeout_s) if call.stream else body
            except (UpstreamError, TimeoutError):
                body = b""
            finally:
                exchange.close()
            backend.breaker.on_failure()
            raise _Retryable(f"status_{exchange.status}", self._whole(exchange, body, call, started, backend))
        return exchange, body

    def _whole(self, exchange: Exchange, body: bytes, call: _Request, started: float, backend: Backend) -> _Answer:
        self.metrics.duration.labels(backend.url).observe(time.perf_counter() - started)
        if call.echo_model is not None and (exchange.header(b"content-type") or b"").startswith(JSON_TYPE):
            body = rewrite_model(body, call.echo_model)
        return _Answer(exchange.status, _relayed_headers(exchange, call), body)

    async def _unary(self, watch: _Watch, send: Send, backend: Backend, call: _Request) -> int:
        started = time.perf_counter()
        backend.in_flight += 1
        backend.breaker.acquire()
        try:
            try:
                exchange, body = await self._send(watch, backend, call, started)
            except TimeoutError:
                answer = _error(504, f"The backend did not answer within {call.timeout_s:g} s.", "upstream_timeout",
                                call.request_id)
            except _ClientGone:
                backend.breaker.on_release()
                raise
            else:
                exchange.release()
                self.metrics.first_byte.labels(backend.url).observe(time.perf_counter() - started)
                backend.breaker.on_success()
                answer = self._whole(exchange, body, call, started, backend)
        finally:
            backend.in_flight -= 1
        await answer.send(send)
        return answer.status

    async def _stream(self, watch: _Watch, send: Send, backend: Backend, call: _Request) -> int:
        started = time.perf_counter()
        backend.in_flight += 1
        backend.breaker.acquire()
        exchange: Exchange | None = None
        try:
            try:
                exchange, _ = await self._send(watch, backend, call, started)
                if exchange.status != 200:  # a 4xx: no stream to relay (but the backend answered)
                    body = await exchange.read(call.timeout_s)
                    exchange.release()
                    backend.breaker.on_success()
                    answer = self._whole(exchange, body, call, started, backend)
                    await answer.send(send)
                    return answer.status
                first = await exchange.next_chunk(max(0.0, call.timeout_s - (time.perf_counter() - started)))
                if not first:
                    raise UpstreamError("the stream ended before its first byte")
            except TimeoutError:
                if exchange is not None:
                    exchange.close()
                    self.metrics.timeouts.labels("first_byte").inc()
                    backend.breaker.on_failure()
                answer = _error(504, f"The backend sent no token within {call.timeout_s:g} s.", "upstream_timeout",
                                call.request_id)
                await answer.send(send)
                return answer.status
            except _ClientGone:
                if exchange is not None:
                    exchange.close()
                backend.breaker.on_release()
                raise
            except UpstreamError as exc:
                assert exchange is not None  # _send turned its own into _Retryable
                exchange.close()
                raise self._failed(backend, "transport_error", "stream_lost_before_first_byte",
                                   call.request_id) from exc
            self.metrics.first_byte.labels(backend.url).observe(time.perf_counter() - started)
            await send({"type": "http.response.start", "status": 200, "headers": _relayed_headers(exchange, call)})
            verdict = await self._relay(watch, send, exchange, first, call)
            if verdict is True:
                exchange.release()  # read to its end: the connection goes back to the pool
            else:
                exchange.close()  # unfinished: the connection is closed, so the backend aborts the request
            breaker = backend.breaker
            if verdict is True:
                breaker.on_success()
            elif verdict is False:
                breaker.on_failure()
            else:
                breaker.on_release()
            self.metrics.duration.labels(backend.url).observe(time.perf_counter() - started)
            return 200
        finally:
            backend.in_flight -= 1

    async def _relay(self, watch: _Watch, send: Send, exchange: Exchange, first: bytes,
                     call: _Request) -> bool | None:
        """Relays the stream; True: it ended with [DONE], False: it ended with an error event, None: the client
        left."""
        relay = EventRelay(call.echo_model)
        idle_s = self.options.idle_timeout_s
        chunk = first
        try:
            while chunk:
                out = relay.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if watch.gone:
                    return None
                chunk = await exchange.next_chunk(idle_s)
        except _ClientGone:
            return None
        except TimeoutError:
            self.metrics.timeouts.labels("idle").inc()
            self.metrics.stream_errors.labels("idle_timeout").inc()
            await _end(send, error_event(f"The backend sent nothing for {idle_s:g} s; the stream was closed.",
                                         "upstream_idle_timeout"))
            return False
        except UpstreamError:
            self.metrics.stream_errors.labels("cut").inc()
            await _end(send, error_event("The connection to the backend was lost mid-stream.", "upstream_stream_cut"))
            return False
        if relay.saw_done:
            await _end(send, b"")
            return True
        self.metrics.stream_errors.labels("ended_without_done").inc()
        await _end(send, error_event("The backend ended the stream before it was complete.", "upstream_stream_cut"))
        return False


async def _end(send: Send, body: bytes) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _relayed_headers(exchange: Exchange, call: _Request) -> list[tuple[bytes, bytes]]:
    headers = [(k, v) for k, v in exchange.headers if k not in RESPONSE_SKIP]
    headers.append((b"x-request-id", call.request_id.encode("latin-1")))
    return headers
