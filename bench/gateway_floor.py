"""The floors under the gateway's CPU per request (bench_gateway.py `overhead --floor`): minimal uvicorn servers
with a pure ASGI app, no admission, no routing, no metrics.

    fixed    answers every request with a fixed chat-completion body (uvicorn + ASGI alone)
    aiohttp  forwards every request to --backend through one pooled aiohttp session (a bare proxy)
    own      the same through the gateway's own upstream client (glmserve/gateway/upstream.py)

    python bench/gateway_floor.py fixed --port 8001
    python bench/gateway_floor.py aiohttp --port 8002 --backend http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import uvicorn

from glmserve.gateway.asgi_body import read_body

FIXED = json.dumps({"id": "chatcmpl-fixed", "object": "chat.completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello from fixed"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 0}}}).encode()
JSON_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(FIXED)).encode())]


def fixed_app():
    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        (await read_body(receive))[0]
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": FIXED})

    return app


def aiohttp_app(backend: str):
    import aiohttp

    session: list[aiohttp.ClientSession] = []

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if not session:
            session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False))
        body = (await read_body(receive))[0]
        async with session[0].request(scope["method"], backend + scope["path"], data=body,
                                      headers={"content-type": "application/json"}) as response:
            data = await response.read()
        await send({"type": "http.response.start", "status": response.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


def own_app(backend: str):
    from glmserve.gateway.upstream import UpstreamPool

    pool = UpstreamPool(connect_timeout_s=5.0, keep_alive_s=4.0)

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = (await read_body(receive))[0]
        response = pool.exchange(backend)
        await response.send(scope["method"], scope["path"], [(b"content-type", b"application/json")], body, 30.0)
        data = await response.read(30.0)
        response.release()
        await send({"type": "http.response.start", "status": response.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("fixed", "aiohttp", "own"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", default=None)
    args = parser.parse_args()
    if args.mode != "fixed" and not args.backend:
        parser.error(f"{args.mode} needs --backend")
    app = fixed_app() if args.mode == "fixed" else (aiohttp_app if args.mode == "aiohttp" else own_app)(args.backend)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host="127.0.0.1", port=args.port, access_log=False, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
