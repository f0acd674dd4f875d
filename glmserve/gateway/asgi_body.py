"""Reading a request body from an ASGI `receive`: the one loop the admission middleware and the proxy share."""

from __future__ import annotations

from starlette.types import Receive


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
