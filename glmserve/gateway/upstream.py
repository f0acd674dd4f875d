"""The gateway's upstream HTTP/1.1 client: keep-alive connections per backend on asyncio.Protocol, responses parsed
by httptools' C parser (llhttp), each request written with one `transport.write`.

    pool = UpstreamPool(connect_timeout_s=5, keep_alive_s=4)
    exchange = pool.exchange("http://127.0.0.1:8000")
    await exchange.send("POST", "/v1/chat/completions", headers, body, 30)   # returns at the response head
    body = await exchange.read(30)      # or: while (chunk := await exchange.next_chunk(idle_s)): ...
    exchange.release()                  # read to its end: the connection goes back to the pool; close() drops it

Why not aiohttp: its per-request machinery (ClientRequest, payload writers, the connector's bookkeeping, a
StreamReader per body) was most of a bare proxy's CPU (bench/RESULTS.md "Gateway"). This does only what the
proxy needs: no redirects, cookies, proxies, TLS or compression (the gateway asks for identity bodies).

Timeouts are timer handles on the one future a response waits on (no task per wait); `abort(exc)` (a client that
left) fails that wait at once and closes the connection, so the backend sees the disconnect and frees its KV.
A connection goes back to the pool only when its response was read to the end and both sides keep it alive; idle
ones older than `keep_alive_s` (set below the backends' own keep-alive) or closed by the backend are dropped.
Bytes that arrived before the connection was lost are handed out ahead of the error.

Read for the shape (not copied): uvicorn's protocols/http/httptools_impl.py (the parser callbacks, flow control)
and aiohttp's client_proto.py / connector.py (a response that must be read to its end before reuse)."""

from __future__ import annotations

import asyncio
import collections
import time
from urllib.parse import urlsplit

import httptools

CHUNK_HIGH_WATER = 1 << 20  # stop reading the socket while this much body waits for the relay


class UpstreamError(Exception):
    """The backend could not be reached, or the connection broke (or sent bad HTTP) before the answer ended."""


class UpstreamConnectError(UpstreamError):
    """No connection could be opened (refused, unreachable, or the connect timeout passed)."""


class _Connection(asyncio.Protocol):
    """One TCP connection to a backend; one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.busy = False  # a request is out on it (else bytes that arrive are a protocol error)
        self.idle_since = 0.0
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.error: BaseException | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.head_only = False  # HEAD: a body is announced but never sent
        self.delimited = False  # the body's end is known (content-length, chunked, or none): else it ends at close
        self.keep_alive = False  # both sides keep the connection (HTTP/1.1 without `connection: close`)

    # -- asyncio.Protocol ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete or self.error is not None:
            self.close()  # bytes nobody asked for: the connection cannot be trusted with the next request
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"the backend sent malformed HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.head_done and not self.complete and not self.delimited and self.error is None:
            self.complete = True  # a body read until the connection closes (no length, not chunked)
            self._wake()
        elif not self.complete and self.error is None:
            self.error = UpstreamError("the backend closed the connection before the answer ended"
                                       + (f" ({exc})" if exc else ""))
            self._wake()

    # -- httptools callbacks ---------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer in the same read: not this request's, and the connection is spoiled
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.complete:
            return
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.delimited = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.complete:
            return
        self.status = self.parser.get_status_code()
        self.head_done = True
        if self.status < 200 and self.status != 101:  # 1xx: an interim answer, the real one follows
            self.head_done, self.headers, self.delimited = False, [], False
            return
        if self.head_only or self.status in (204, 304):
            self.delimited = True
        if self.head_only:
            self.complete = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > CHUNK_HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.head_done and not self.complete:
            self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the next message may begin
            self.delimited = True
            self.complete = True
            self._wake()

    # -- waiting ---------------------------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self.transport is not None:
            self.transport.close()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    async def wait(self, timeout_s: float) -> None:
        """Until something new arrived (head, body, end or error); TimeoutError after `timeout_s`."""
        waiter = self._waiter = self.loop.create_future()
        handle = self.loop.call_later(max(0.0, timeout_s), _expire, waiter)
        try:
            await waiter
        finally:
            handle.cancel()
            self._waiter = None

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return (self.complete and self.keep_alive and not self.lost and self.error is None and not self.head_only)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Exchange:
    """One request to one backend: `send()` it, then read the answer: `status` and `headers` (names lower-cased)
    once sent, the body as it arrives. `abort(exc)` may come at any time (a client that left)."""

    def __init__(self, pool: UpstreamPool, key: str) -> None:
        self._pool = pool
        self._key = key
        self._conn: _Connection | None = None
        self._aborted: BaseException | None = None
        self._done = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []

    async def send(self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes,
                   timeout_s: float) -> None:
        """Sends the request; returns once the response head arrived (TimeoutError after `timeout_s`; the connection
        is then closed). `headers` must not hold Host, Content-Length, Connection or Transfer-Encoding."""
        deadline = time.monotonic() + timeout_s
        host = self._pool._target(self._key)[2]
        conn = await self._pool._acquire(self._key)
        self._conn = conn
        if self._aborted is not None:
            self.close()
            raise self._aborted
        conn.head_only = method == "HEAD"
        conn.busy = True
        lines = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), b"host: ", host,
                 b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        lines += (b"\r\n", body)
        assert conn.transport is not None
        conn.transport.write(b"".join(lines))
        try:
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(deadline - time.monotonic())
        except BaseException:
            self.close()
            raise
        self.status, self.headers = conn.status, conn.headers

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def next_chunk(self, timeout_s: float) -> bytes:
        """The body bytes that arrived since the last call (waiting up to `timeout_s` for some); b"" at its end.
        UpstreamError once the connection broke, after what had arrived before was given out."""
        conn = self._conn
        assert conn is not None, "Exchange.send() first"
        while True:
            if conn.chunks:
                return conn.take()
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return b""
            await conn.wait(timeout_s)

    async def read(self, timeout_s: float) -> bytes:
        """The whole body, within `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        parts = []
        while chunk := await self.next_chunk(deadline - time.monotonic()):
            parts.append(chunk)
        return b"".join(parts)

    def abort(self, exc: BaseException) -> None:
        """Fails the wait in progress (and the next ones) with `exc` and closes the connection."""
        self._aborted = exc
        if self._conn is not None and not self._done:
            self._done = True
            self._conn._fail(exc)

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if the body was read to its end, else it is closed."""
        if self._done or self._conn is None:
            return
        self._done = True
        if self._conn.reusable():
            self._pool._put(self._key, self._conn)
        else:
            self._conn.close()

    def close(self) -> None:
        """Done with it, whatever was read: the connection is closed (the backend sees the client leave)."""
        if not self._done and self._conn is not None:
            self._done = True
            self._conn.close()


class UpstreamPool:
    """Keep-alive connections per backend base URL (`http://host:port`), the most recently used first."""

    def __init__(self, connect_timeout_s: float, keep_alive_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.keep_alive_s = keep_alive_s
        self._idle: dict[str, list[_Connection]] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}  # base URL -> host, port, Host header value

    def _target(self, base_url: str) -> tuple[str, int, bytes]:
        target = self._targets.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamConnectError(f"only http:// backends are supported, not {base_url!r}")
            port = parts.port or 80
            target = self._targets[base_url] = (parts.hostname, port, parts.netloc.encode("idna"))
        return target

    def _put(self, key: str, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        conn.busy = False
        conn._reset()
        self._idle.setdefault(key, []).append(conn)

    async def _acquire(self, key: str) -> _Connection:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < self.keep_alive_s:
                return conn
            conn.close()
        host, port, _ = self._target(key)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop), host, port)
        except TimeoutError as exc:
            raise UpstreamConnectError(f"connecting to {key} took longer than {self.connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {key}: {exc}") from exc
        return conn

    def exchange(self, base_url: str) -> Exchange:
        """A new request to the backend at `base_url` (`http://host:port`, no path)."""
        return Exchange(self, base_url)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
