"""A fast fake OpenAI-compatible backend for the gateway's tests and benchmark: a real uvicorn server whose
behaviour a test sets through `POST /control` (slow first byte, a stream that stalls or is cut after some
chunks, 5xx answers, a failing health check). It counts requests and the ones whose client went away, and keeps
the Authorization header of every request it got.

    python tests/fake_backend.py --name a --port 0      # prints uvicorn's "Uvicorn running on ..." line
    python tests/fake_backend.py --provider KEY_ENV     # as a provider's endpoint: every path but /control needs
                                                        # `Bearer $KEY_ENV` (else OpenAI's 401); no /v1/health
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DEFAULTS: dict[str, Any] = {
    "delay_s": 0.0,  # before the answer (non-streamed) or the first chunk (streamed)
    "chunks": 3,  # content chunks of a stream
    "chunk_gap_s": 0.0,
    "stall_after": None,  # a stream stops sending (forever) after this many chunks
    "cut_after": None,  # a stream's connection is dropped after this many chunks
    "status": 200,  # answers to completions with this status (5xx: an OpenAI error body)
    "health_status": 200,
}


class State:
    def __init__(self, name: str) -> None:
        self.name = name
        self.control = dict(DEFAULTS)
        self.requests = 0
        self.disconnects = 0
        self.in_flight = 0
        self.models: list[str] = []
        self.session_ids: list[str | None] = []
        self.request_ids: list[str | None] = []
        self.authorizations: list[str | None] = []  # of every request but /control, in arrival order


class _Cut(Exception):
    """Raised inside a stream: uvicorn drops the connection without ending the chunked body."""


def fake_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": 0}}


def completion(state: State, number: int, model: str, text: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-{state.name}-{number}", "object": "chat.completion", "created": 0,
            "model": model, "system_fingerprint": state.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": fake_usage(5, 2)}


def chunk(state: State, number: int, model: str, delta: dict[str, Any] | None, finish: str | None = None,
          usage: dict[str, Any] | None = None) -> bytes:
    """One SSE event of request `number`; delta None: the usage chunk (`choices: []`)."""
    body = {"id": f"chatcmpl-{state.name}-{number}", "object": "chat.completion.chunk", "created": 0,
            "model": model, "system_fingerprint": state.name,
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _sleep_unless_gone(request: Request, seconds: float, state: State) -> bool:
    """Sleeps; False (and counted) when the client disconnects first."""
    if seconds <= 0:
        return True

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    done, _ = await asyncio.wait((watcher,), timeout=seconds)
    watcher.cancel()
    if done:
        state.disconnects += 1
        return False
    return True


def create_app(state: State, api_key: str | None = None) -> Starlette:
    """api_key: act as a provider's endpoint (the key required everywhere but /control, no /v1/health)."""

    async def chat(request: Request) -> Response:
        body = await request.json()
        state.requests += 1
        number = state.requests
        model = body.get("model", "")
        state.models.append(model)
        state.session_ids.append(request.headers.get("x-session-id") or body.get("session_id"))
        state.request_ids.append(request.headers.get("x-request-id"))
        control = state.control
        if control["status"] >= 400:
            error = {"error": {"message": f"{state.name} fails on purpose", "type": "server_error", "param": None,
                               "code": None}}
            return JSONResponse(error, status_code=control["status"])
        if not body.get("stream"):
            state.in_flight += 1
            try:
                if not await _sleep_unless_gone(request, control["delay_s"], state):
                    return Response(status_code=499)
                return JSONResponse(completion(state, number, model, f"hello from {state.name}"))
            finally:
                state.in_flight -= 1
        # per request: `hold_after` N: after N chunks, wait (up to a minute) for the client to go away
        hold_after = body.get("hold_after")
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(stream(number, model, dict(control), hold_after, with_usage),
                                 media_type="text/event-stream")

    async def stream(number: int, model: str, control: dict[str, Any], hold_after: int | None, with_usage: bool):
        state.in_flight += 1
        try:
            await asyncio.sleep(control["delay_s"])
            yield chunk(state, number, model, {"role": "assistant", "content": ""})
            for i in range(control["chunks"]):
                if control["stall_after"] is not None and i >= control["stall_after"]:
                    await asyncio.sleep(3600)
                if control["cut_after"] is not None and i >= control["cut_after"]:
                    raise _Cut()
                if hold_after is not None and i == hold_after:
                    await asyncio.sleep(60)  # cancelled when the client (the gateway) disconnects
                await asyncio.sleep(control["chunk_gap_s"])
                yield chunk(state, number, model, {"content": f"{state.name}{i} "})
            yield chunk(state, number, model, {}, "stop")
            if with_usage:
                yield chunk(state, number, model, None, usage=fake_usage(5, control["chunks"]))
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            state.disconnects += 1
            raise
        finally:
            state.in_flight -= 1

    async def health(_: Request) -> Response:
        return JSONResponse({"status": state.name}, status_code=state.control["health_status"])

    async def metrics(_: Request) -> Response:
        return Response(f"glmserve_num_requests_running {state.in_flight}\nglmserve_num_requests_waiting 0\n")

    async def control(request: Request) -> Response:
        if request.method == "POST":
            update = await request.json()
            if update.pop("reset", False):
                state.control = dict(DEFAULTS)
                state.requests = state.disconnects = 0
                state.models.clear()
                state.session_ids.clear()
                state.request_ids.clear()
                state.authorizations.clear()
            state.control.update(update)
        return JSONResponse({"name": state.name, "control": state.control, "requests": state.requests,
                             "disconnects": state.disconnects, "in_flight": state.in_flight, "models": state.models,
                             "session_ids": state.session_ids, "request_ids": state.request_ids,
                             "authorizations": state.authorizations})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": state.name}]})

    def keyed(handler):
        async def check(request: Request) -> Response:
            given = request.headers.get("authorization")
            state.authorizations.append(given)
            if api_key is not None and given != f"Bearer {api_key}":
                error = {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                   "param": None, "code": "invalid_api_key"}}
                return JSONResponse(error, status_code=401)
            return await handler(request)
        return check

    routes = [Route("/v1/chat/completions", keyed(chat), methods=["POST"]), Route("/metrics", keyed(metrics)),
              Route("/v1/models", keyed(models)), Route("/control", control, methods=["GET", "POST"])]
    if api_key is None:
        routes.append(Route("/v1/health", keyed(health)))
    return Starlette(routes=routes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--provider", default=None, metavar="KEY_ENV",
                        help="require `Authorization: Bearer $KEY_ENV` and serve no /v1/health")
    args = parser.parse_args()
    api_key = os.environ[args.provider] if args.provider else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # uvicorn re-raises the signal once it has stopped
    uvicorn.run(create_app(State(args.name), api_key), host=args.host, port=args.port, access_log=False,
                log_level="info")


if __name__ == "__main__":
    main()
