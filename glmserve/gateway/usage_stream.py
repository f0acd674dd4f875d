"""Reading `usage` out of OpenAI-compatible responses: a whole JSON body, or a server-sent event stream whose
usage chunk (`"choices": []`, sent when `stream_options.include_usage` is set) the client may not have asked for.
The Responses API's shape is read too: `usage` {input_tokens, output_tokens, input_tokens_details.cached_tokens},
streamed inside the `response` object of its `response.completed` (or `.incomplete`) event."""

from __future__ import annotations

from dataclasses import dataclass

from glmserve.gateway import fastjson


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def parse_usage(usage: object) -> Usage | None:
    """OpenAI's usage object (prompt_tokens_details.cached_tokens optional; or the Responses API's input_tokens,
    output_tokens and input_tokens_details) as Usage; None if absent or malformed."""
    if not isinstance(usage, dict):
        return None
    if "input_tokens" in usage:
        prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
        details = usage.get("input_tokens_details") or {}
    else:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Usage(prompt, cached if isinstance(cached, int) else 0, completion)


def usage_of(body: bytes) -> tuple[Usage | None, str | None]:
    """Usage and id of a non-streamed JSON response."""
    try:
        doc = fastjson.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None, None
    if not isinstance(doc, dict):
        return None, None
    rid = doc.get("id")
    return parse_usage(doc.get("usage")), rid if isinstance(rid, str) else None


class SSEUsageFilter:
    """Splits a stream's bytes into whole events, notes the last usage and the response id, and drops the usage
    chunk when `strip_usage_chunk` (the client did not ask for it). Events pass through byte for byte."""

    def __init__(self, strip_usage_chunk: bool) -> None:
        self.strip = strip_usage_chunk
        self.response_id: str | None = None
        self._pending = b""

    def feed(self, data: bytes, final: bool = False) -> tuple[bytes, Usage | None]:
        """The whole events in what arrived so far (what the client should get) and the usage seen in them."""
        buf = self._pending + data
        cut = buf.rfind(b"\n\n")
        if final:
            complete, self._pending = buf, b""
        elif cut < 0:
            self._pending = buf
            return b"", None
        else:
            complete, self._pending = buf[: cut + 2], buf[cut + 2 :]
        out: list[bytes] = []
        usage = None
        for event in complete.split(b"\n\n"):
            if not event:
                continue
            keep = True
            if b'"usage"' in event or self.response_id is None:
                doc = _data_json(event)
                if isinstance(doc, dict) and isinstance(doc.get("response"), dict):  # a Responses API event
                    doc = doc["response"]
                if isinstance(doc, dict):
                    if self.response_id is None and isinstance(doc.get("id"), str):
                        self.response_id = doc["id"]
                    seen = parse_usage(doc.get("usage"))
                    if seen is not None:
                        usage = seen
                        keep = not (self.strip and doc.get("choices") == [])
            if keep:
                out.append(event + b"\n\n")
        return b"".join(out), usage


def _data_json(event: bytes) -> object:
    lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines or lines == [b"[DONE]"]:
        return None
    try:
        return fastjson.loads(b"\n".join(lines))
    except (ValueError, UnicodeDecodeError):
        return None
