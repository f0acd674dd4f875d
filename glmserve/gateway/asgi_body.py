"""Reading a request body from an ASGI `receive` (the one loop the admission middleware and the proxy share), and
handing it on again."""

from __future__ import annotations

from starlette.types import Message, Receive


async def read_body(receive: Receive) -> tuple[bytes, bool]:
    """The request's body and whether the client left before its end (then the bytes that came before)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), False


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A receive that yields `body` once, then passes the client's later messages (disconnect) through."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
