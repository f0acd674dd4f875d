"""Server-sent events on the way through: upstream bytes cut into whole events, each `data:` JSON chunk's
`model` rewritten to the id the client sent, the `[DONE]` terminator noticed (a stream that ends without it was
cut), and OpenAI-shaped error events for a stream the gateway has to end."""

from __future__ import annotations

import json
import re
from typing import Any

from glmserve.gateway import fastjson

_SEPARATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_DONE = b"data: [DONE]"


def error_body(message: str, code: str, error_type: str = "server_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def error_event(message: str, code: str) -> bytes:
    return b"data: " + json.dumps(error_body(message, code)).encode() + b"\n\n"


def rewrite_model(payload: bytes, model: str) -> bytes:
    """A JSON object with its `model` field set to `model` (other JSON, or none, unchanged)."""
    try:
        data = fastjson.loads(payload)
    except ValueError:
        return payload
    if not isinstance(data, dict) or "model" not in data:
        return payload
    data["model"] = model
    return json.dumps(data, separators=(",", ":")).encode()


class EventRelay:
    """Feeds upstream bytes, returns what to send on: whole events only, their `model` set to `echo_model` when
    given."""

    def __init__(self, echo_model: str | None) -> None:
        self.echo_model = echo_model
        self.saw_done = False
        self.events = 0
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        ends = [i + len(sep) for sep in _SEPARATORS if (i := data.rfind(sep)) >= 0]
        if not ends:
            self._pending = data
            return b""
        end = max(ends)
        whole, self._pending = data[:end], data[end:]
        if _DONE in whole:
            self.saw_done = True
        if self.echo_model is None:
            self.events += len(_EVENT_END.findall(whole))
            return whole
        out = []
        for event in _EVENT_END.split(whole)[:-1]:
            self.events += 1
            if event.startswith(b"data: {"):
                event = b"data: " + rewrite_model(event[6:], self.echo_model)
            out.append(event + b"\n\n")
        return b"".join(out)
