"""A small OpenAI-compatible backend (pure ASGI) for the gateway tests, and a launcher that serves it behind
GatewayMiddleware under uvicorn: `python tests/fake_openai.py [gateway options]` (port 0; logs the port; the
gateway's metrics at /metrics).

Usage it reports is a function of the request, so a test can check the ledger against it: prompt_tokens is the
prompt's length in characters // 4 + 1, cached_tokens half of that, completion_tokens = max_tokens (default 5)
times n. A stream sends one chunk per completion token; with `"cut_after": K` in the body it sends K chunks and then
waits until the client goes away (as a real server that aborts on disconnect)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmserve.gateway.asgi_body import read_body  # noqa: E402
from glmserve.gateway.usage_stream import Usage  # noqa: E402


def expected_usage(body: dict) -> Usage:
    text = "".join(str(m.get("content", "")) for m in body.get("messages", [])) or str(body.get("prompt", ""))
    prompt = len(text) // 4 + 1
    completion = int(body.get("max_tokens") or body.get("max_completion_tokens") or 5) * int(body.get("n") or 1)
    return Usage(prompt, prompt // 2, completion)


def _usage_json(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


async def fake_backend(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["path"] in ("/health", "/v1/health"):
        await _send_json(send, 200, {"status": "ready"})
        return
    body = json.loads((await read_body(receive))[0])
    usage = expected_usage(body)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    model = body.get("model", "fake")
    if not body.get("stream"):
        await _send_json(send, 200, {"id": rid, "object": "chat.completion", "model": model, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "x" * usage.completion_tokens},
             "finish_reason": "length"}], "usage": _usage_json(usage)})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    cut = body.get("cut_after")
    for i in range(usage.completion_tokens):
        if cut is not None and i == cut:
            while (await receive())["type"] != "http.disconnect":
                pass
            return
        chunk = {"id": rid, "object": "chat.completion.chunk", "model": model, "usage": None,
                 "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                    "more_body": True})
        await asyncio.sleep(0)
    tail = ""
    if (body.get("stream_options") or {}).get("include_usage"):
        tail = "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "model": model, "choices": [],
                                      "usage": _usage_json(usage)}) + "\n\n"
    await send({"type": "http.response.body", "body": (tail + "data: [DONE]\n\n").encode(), "more_body": False})


async def _send_json(send, status: int, doc: dict) -> None:
    payload = json.dumps(doc).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"),
                                                                            (b"content-length", b"%d" % len(payload))]})
    await send({"type": "http.response.body", "body": payload})


def main() -> None:
    import uvicorn
    from prometheus_client import generate_latest

    from glmserve.gateway.admission import GatewayMiddleware
    from glmserve.gateway.settings import GatewaySettings, add_gateway_options

    parser = argparse.ArgumentParser()
    add_gateway_options(parser)
    args = parser.parse_args()
    logging.basicConfig(level="INFO")
    gateway = GatewayMiddleware(fake_backend, GatewaySettings.from_args(args))

    async def app(scope, receive, send) -> None:  # /metrics from the gateway's registry, the rest through it
        if scope["type"] == "http" and scope["path"] == "/metrics":
            payload = generate_latest(gateway.registry)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": payload})
            return
        await gateway(scope, receive, send)

    uvicorn.run(app, host="127.0.0.1", port=0, log_level="info")


if __name__ == "__main__":
    main()
