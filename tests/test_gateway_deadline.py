"""`glmserve serve --request-timeout` (glmserve/gateway/deadline.py) driven over ASGI directly: a request with no
answer in time gets a 504 in OpenAI's format and the app behind sees its client disconnect (which is how the server
aborts the engine request); a stream that stalls ends with an SSE error event, never [DONE]; a stream that keeps
sending is never cut, however long it runs; other paths pass untouched; a timeout that is not positive is refused."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from prometheus_client import CollectorRegistry

from glmserve.gateway.deadline import RequestDeadline

SSE = [(b"content-type", b"text/event-stream")]


class App:
    """An ASGI app that answers after `delay_s` (None: only when its client leaves), or streams `chunks` chunks
    `gap_s` apart and then stalls when `stall` is set."""

    def __init__(self, delay_s: float | None = None, chunks: int = 0, gap_s: float = 0.0, stall: bool = False):
        self.delay_s, self.chunks, self.gap_s, self.stall = delay_s, chunks, gap_s, stall
        self.saw_disconnect = False

    async def __call__(self, scope, receive, send) -> None:
        self.receive = receive
        await receive()  # the body
        if self.chunks:
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
            for i in range(self.chunks):
                await send({"type": "http.response.body", "body": b"data: {\"i\": %d}\n\n" % i, "more_body": True})
                await asyncio.sleep(self.gap_s)
            if self.stall:
                await self._until_disconnect()
                return
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        if self.delay_s is None:
            await self._until_disconnect()
            await send({"type": "http.response.start", "status": 499, "headers": []})  # as the server does
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await asyncio.sleep(self.delay_s)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    async def _until_disconnect(self) -> None:
        while (await asyncio.wait_for(self.receive(), 10))["type"] != "http.disconnect":
            pass
        self.saw_disconnect = True


def _call(app: App, timeout_s: float, path: str = "/v1/chat/completions", method: str = "POST"):
    """Runs one request; returns what the client got and the middleware's timeout counts."""
    registry = CollectorRegistry()
    deadline = RequestDeadline(app, timeout_s, registry=registry)
    sent: list[dict] = []

    async def run() -> None:
        client_gone = asyncio.Event()
        first = True

        async def receive():
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": b"{}", "more_body": False}
            await client_gone.wait()  # this client never leaves on its own
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "headers": []}
        await asyncio.wait_for(deadline(scope, receive, send), 10)

    asyncio.run(run())
    counts = {s.labels["kind"]: s.value for m in registry.collect() for s in m.samples if s.name.endswith("_total")}
    return sent, counts


def _body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_no_answer_in_time_is_a_504_and_the_app_sees_its_client_leave() -> None:
    app = App(delay_s=None)
    sent, counts = _call(app, 0.2)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 504
    error = json.loads(_body(sent))["error"]
    assert error["code"] == "request_timeout" and error["type"] == "server_error"
    assert "--request-timeout" in error["message"] and "0.2 s" in error["message"]
    assert app.saw_disconnect  # the server aborts the engine request on this
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]  # the app's 499 never went out
    assert counts == {"request": 1}


def test_a_stalled_stream_ends_with_an_error_event_never_done() -> None:
    app = App(chunks=2, stall=True)
    sent, counts = _call(app, 0.2)
    assert sent[0]["status"] == 200 and not sent[-1]["more_body"]
    events = [e for e in _body(sent).decode().split("\n\n") if e]
    assert events[:2] == ['data: {"i": 0}', 'data: {"i": 1}'] and len(events) == 3
    assert json.loads(events[2][len("data: "):])["error"]["code"] == "request_timeout"
    assert "[DONE]" not in _body(sent).decode() and app.saw_disconnect and counts == {"idle": 1}


def test_a_stream_that_keeps_sending_is_never_cut_and_fast_answers_pass() -> None:
    sent, counts = _call(App(chunks=20, gap_s=0.05), 0.5)  # 1 s in all, twice the timeout, never 0.5 s idle
    assert _body(sent).decode().endswith("data: [DONE]\n\n") and _body(sent).count(b'"i"') == 20 and counts == {}
    sent, counts = _call(App(delay_s=0.0), 0.5)
    assert sent[0]["status"] == 200 and _body(sent) == b"{}" and counts == {}


def test_other_paths_are_not_bounded() -> None:
    sent, counts = _call(App(delay_s=0.4), 0.1, path="/v1/models", method="GET")
    assert sent[0]["status"] == 200 and counts == {}


def test_serve_refuses_a_request_timeout_that_is_not_positive() -> None:
    done = subprocess.run([sys.executable, "-m", "glmserve.cli", "serve", "--request-timeout", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--request-timeout must be > 0" in done.stderr + done.stdout
