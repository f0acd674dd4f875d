"""`glmserve gateway`: the ASGI app in front of the backends. `/health` is liveness, `/v1/health` readiness (at
least one backend healthy), `/metrics` the `glmserve_gateway_*` metrics, `/v1/models` the external ids of the
model-ID table (these through Starlette); every other path goes straight to the proxy (proxy.py, pure ASGI).
GatewayMiddleware (admission.py: keys, limits, billing, /v1/usage) wraps it all."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from glmserve.errors import InvalidRequestError
from glmserve.gateway.admission import GatewayMiddleware
from glmserve.gateway.backends import BackendPool, backend_keys
from glmserve.gateway.models_map import ModelMap
from glmserve.gateway.proxy import Proxy
from glmserve.gateway.proxy_metrics import ProxyMetrics
from glmserve.gateway.proxy_options import ProxyOptions
from glmserve.gateway.settings import GatewaySettings
from glmserve.gateway.workers import LEAN_SERVER, run_gateway_workers
from glmserve.gc_heap import freeze_startup_heap

# idle client connections are kept longer than clients keep them (httpx and the openai client: 5 s, aiohttp 15 s,
# nginx upstreams 60 s): at uvicorn's 5 s default a client can reuse a connection as the gateway closes it and get a
# ReadError (uvicorn's and httpx's equal 5 s defaults race, see agentscope-runtime PR 468; most likely the one
# ReadError of a 90 s fault run, bench/RESULTS.md "Load and fault")
CLIENT_KEEP_ALIVE_S = 75
# and idle upstream connections are dropped before the backends drop them (uvicorn, so glmserve serve: 5 s), so that
# no request goes out on a connection the backend is closing (a transport error, a retry, a breaker strike)
UPSTREAM_KEEP_ALIVE_S = 4.0


def build_proxy(settings: GatewaySettings, options: ProxyOptions) -> Proxy:
    models = ModelMap.load(options.models_file) if options.models_file else ModelMap.empty()
    if not settings.backend_urls and not models.pools:
        raise InvalidRequestError("glmserve gateway needs at least one --backend URL (or [pools] in --models)")
    unpooled = [r.external for r in models.routes.values() if r.pool is None]
    if unpooled and not settings.backend_urls:
        raise InvalidRequestError(f"--models: {unpooled} name no pool, and there is no --backend for them")
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(connect=options.connect_timeout_s, read=None, write=options.connect_timeout_s,
                              pool=options.connect_timeout_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                            keepalive_expiry=UPSTREAM_KEEP_ALIVE_S), trust_env=False)
    pool = BackendPool(client, settings.probe_interval_s, settings.unhealthy_after, options.eject_after,
                       options.breaker_cooldown_s, keys=backend_keys(options.backend_keys))
    default_group = pool.group(settings.backend_urls)
    for url in settings.standby_urls:
        pool.add(url, standby=True)
    return Proxy(pool, default_group, models, options, settings.request_timeout_s, ProxyMetrics(pool),
                 keep_alive_s=UPSTREAM_KEEP_ALIVE_S)


def create_gateway_app(settings: GatewaySettings, options: ProxyOptions) -> ASGIApp:
    proxy = build_proxy(settings, options)
    pool = proxy.pool
    pool.check_keys()  # after the pools' backends joined (Proxy adds them)

    async def liveness(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readiness(_: Request) -> Response:
        ready = pool.ready()
        return JSONResponse({"status": "ready" if ready else "no_healthy_backend", "backends": pool.describe()},
                            status_code=200 if ready else 503, headers=None if ready else {"retry-after": "1"})

    async def metrics(_: Request) -> Response:
        content, media_type = proxy.metrics.render()
        return Response(content, media_type=media_type)

    async def models(_: Request) -> Response:
        return JSONResponse(proxy.models.model_list())

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await proxy.start()
        await pool.start()
        freeze_startup_heap()
        try:
            yield
        finally:
            await pool.stop()
            await asyncio.shield(pool.client.aclose())
            await asyncio.shield(proxy.close())

    local = Starlette(routes=[Route("/health", liveness), Route("/v1/health", readiness), Route("/metrics", metrics),
                              Route("/v1/models", models)], lifespan=lifespan)
    local_paths = {"/health", "/v1/health", "/metrics"} | ({"/v1/models"} if proxy.models.routes else set())

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        """Every other path goes straight to the proxy (pure ASGI); these few and the lifespan through Starlette."""
        if scope["type"] == "http" and scope["path"] not in local_paths:
            await proxy(scope, receive, send)
        else:
            await local(scope, receive, send)

    # keys, limits, billing and /v1/usage around the proxy; its metrics join the proxy's on /metrics
    middleware = GatewayMiddleware(app, settings, registry=proxy.metrics.registry)
    proxy.metrics.live.extend(middleware.metrics.live)
    return middleware


def _exit_cleanly(signum: int, _: FrameType | None) -> None:
    raise SystemExit(0)


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe and per upstream request


def run_gateway(settings: GatewaySettings, options: ProxyOptions, host: str, port: int, workers: int = 1) -> int:
    """Serves until SIGTERM/SIGINT; uvicorn re-raises the signal after its graceful shutdown, which exits 0. With
    workers > 1, uvicorn's supervisor runs that many gateway processes on one socket (workers.py)."""
    if workers != 1:
        return run_gateway_workers(settings, options, host, port, workers, keep_alive_s=CLIENT_KEEP_ALIVE_S)
    signal.signal(signal.SIGTERM, _exit_cleanly)
    configure_logging()
    app = create_gateway_app(settings, options)
    uvicorn.run(app, host=host, port=port, access_log=False, log_level="info", timeout_graceful_shutdown=30,
                timeout_keep_alive=CLIENT_KEEP_ALIVE_S, **LEAN_SERVER)
    return 0
