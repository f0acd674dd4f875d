"""The gateway's upstream HTTP/1.1 client (glmserve/gateway/upstream.py) against real TCP servers (asyncio's, in
the test's loop, writing raw HTTP so that each case controls the bytes and their timing): keep-alive reuse, a
backend that closes an idle connection, a response split across reads, chunked and large bodies, a body cut
mid-way (what arrived comes out before the error), a body that ends at close, timeouts and an abort that close
the connection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from glmserve.gateway.upstream import UpstreamConnectError, UpstreamError, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:")), 0)
    return head + await reader.readexactly(length)


class Server:
    """A TCP server on 127.0.0.1 whose connections `handler` serves; counts the connections it accepted and the
    ones whose client closed them."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed_by_client = 0
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> Server:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                self.closed_by_client += 1
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


def keep_alive(answer: Callable[[bytes], bytes]) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            writer.write(answer(request))
            await writer.drain()

    return handler


async def get(pool: UpstreamPool, url: str, body: bytes = b"", timeout_s: float = 5.0) -> tuple[int, bytes]:
    exchange = pool.exchange(url)
    await exchange.send("POST", "/v1/x", [(b"content-type", b"application/json")], body, timeout_s)
    data = await exchange.read(timeout_s)
    exchange.release()
    return exchange.status, data


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def test_keep_alive_connections_are_reused_and_requests_arrive_whole() -> None:
    seen: list[bytes] = []

    async def main() -> None:
        async with Server(keep_alive(lambda r: seen.append(r) or ok(b"echo:" + r.rsplit(b"\r\n\r\n", 1)[1]))) as s:
            pool = UpstreamPool(5, 4)
            for n in range(5):
                assert await get(pool, s.url, b'{"n": %d}' % n) == (200, b'echo:{"n": %d}' % n)
            assert s.connections == 1

    run(main())
    first = seen[0].split(b"\r\n")
    assert first[0] == b"POST /v1/x HTTP/1.1"
    assert b"content-length: 8" in first and b"content-type: application/json" in first
    assert any(line.startswith(b"host: 127.0.0.1:") for line in first)


def test_a_connection_the_backend_closed_while_idle_is_not_reused() -> None:
    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(b"once"))  # keep-alive as far as the headers say, then closed while idle
        await writer.drain()

    async def main() -> None:
        async with Server(answer_once) as s:
            pool = UpstreamPool(5, 4)
            assert await get(pool, s.url) == (200, b"once")
            await asyncio.sleep(0.1)  # the FIN arrives while the connection is idle in the pool
            assert await get(pool, s.url) == (200, b"once")
            assert s.connections == 2

    run(main())


def test_an_answer_nobody_asked_for_is_never_read_as_the_next_one() -> None:
    async def twice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(ok(b"asked") + ok(b"extra"))  # one request, two answers in one write
            await writer.drain()

    async def main() -> None:
        async with Server(twice) as s:
            pool = UpstreamPool(5, 4)
            assert await get(pool, s.url) == (200, b"asked")
            await asyncio.sleep(0.05)
            assert await get(pool, s.url) == (200, b"asked")  # on a new connection: the spoiled one was closed
            assert s.connections == 2

    run(main())


def test_connections_idle_longer_than_keep_alive_are_dropped() -> None:
    async def main() -> None:
        async with Server(keep_alive(lambda _: ok(b"x"))) as s:
            pool = UpstreamPool(5, keep_alive_s=0.05)
            await get(pool, s.url)
            await asyncio.sleep(0.1)
            await get(pool, s.url)
            assert s.connections == 2

    run(main())


def test_a_response_split_across_reads_and_chunked_bodies() -> None:
    async def split(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        response = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                    b"7\r\ndata: 1\r\n9\r\n\n\ndata: 2\r\n2\r\n\n\n\r\n0\r\n\r\n")
        for i in range(0, len(response), 5):  # five bytes per write, each its own read on the other side
            writer.write(response[i:i + 5])
            await writer.drain()
            await asyncio.sleep(0.002)
        await read_request(reader)  # the connection was kept: a second request arrives on it
        writer.write(ok(b"second"))
        await writer.drain()

    async def main() -> None:
        async with Server(split) as s:
            pool = UpstreamPool(5, 4)
            exchange = pool.exchange(s.url)
            await exchange.send("POST", "/v1/x", [], b"{}", 5)
            assert exchange.status == 200 and exchange.header(b"content-type") == b"text/event-stream"
            chunks = []
            while chunk := await exchange.next_chunk(5):
                chunks.append(chunk)
            exchange.release()
            assert b"".join(chunks) == b"data: 1\n\ndata: 2\n\n" and len(chunks) > 1
            assert await get(pool, s.url) == (200, b"second")
            assert s.connections == 1

    run(main())


def test_a_large_body_comes_through_whole() -> None:
    big = bytes(range(256)) * (24 << 10)  # 6 MiB, past the read pause's high-water mark

    async def main() -> None:
        async with Server(keep_alive(lambda r: ok(r.rsplit(b"\r\n\r\n", 1)[1]))) as s:
            pool = UpstreamPool(5, 4)
            assert await get(pool, s.url, big, timeout_s=20) == (200, big)
            assert await get(pool, s.url, b"small") == (200, b"small")
            assert s.connections == 1

    run(main())


def test_what_arrived_before_a_cut_comes_out_before_the_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async def main() -> None:
        async with Server(cut) as s:
            exchange = UpstreamPool(5, 4).exchange(s.url)
            await exchange.send("POST", "/v1/x", [], b"", 5)
            await asyncio.sleep(0.2)  # both events and the reset arrived before anything was read
            assert await exchange.next_chunk(5) == b"data: 1\n\ndata: 2\n\n"
            with pytest.raises(UpstreamError):
                await exchange.next_chunk(5)
            exchange.close()

    run(main())


def test_a_body_without_length_ends_at_close_and_its_connection_is_not_reused() -> None:
    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async def main() -> None:
        async with Server(close_delimited) as s:
            pool = UpstreamPool(5, 4)
            assert await get(pool, s.url) == (200, b"until the end")
            assert await get(pool, s.url) == (200, b"until the end")
            assert s.connections == 2

    run(main())


def test_a_head_timeout_and_an_abort_close_the_connection() -> None:
    async def silent(reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # never answers; returns once the client closed the connection
        raise ConnectionError("closed by the client")

    class Gone(Exception):
        pass

    async def main() -> None:
        async with Server(silent) as s:
            pool = UpstreamPool(5, 4)
            exchange = pool.exchange(s.url)
            with pytest.raises(TimeoutError):
                await exchange.send("POST", "/v1/x", [], b"", 0.1)
            exchange = pool.exchange(s.url)
            asyncio.get_running_loop().call_later(0.1, exchange.abort, Gone())
            with pytest.raises(Gone):
                await exchange.send("POST", "/v1/x", [], b"", 10)
            await asyncio.sleep(0.1)
            assert (s.connections, s.closed_by_client) == (2, 2)

    run(main())


def test_connect_errors_are_typed() -> None:
    async def main() -> None:
        async with Server(keep_alive(lambda _: ok(b""))) as s:
            url = s.url
        with pytest.raises(UpstreamConnectError):
            await UpstreamPool(5, 4).exchange(url).send("GET", "/", [], b"", 5)  # nobody listens there any more
        with pytest.raises(UpstreamConnectError, match="only http://"):
            await UpstreamPool(5, 4).exchange("https://example.invalid").send("GET", "/", [], b"", 5)

    run(main())
