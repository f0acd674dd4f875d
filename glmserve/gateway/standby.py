"""`glmserve serve --standby URL`: a warmed standby behind one box. A completion request that this server cannot
take (its model still loading or warming up, or its queue full: a 503 before any byte of the answer) goes to a
standby instead, through the gateway's proxy (proxy.py), once the standby's `/v1/health` answers 200. The standbys
are probed every --probe-interval seconds and count as unhealthy after --unhealthy-after failed probes, as in
`glmserve gateway`; their answers are billed like local ones (this middleware sits inside the admission
middleware). Their health, breaker state and the routing counters are on the server's /metrics
(`glmserve_gateway_*`, role="standby").

    app = StandbyFallback(inner_app, settings, local_ready=lambda: engine_is_ready, registry=my_registry)
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glmserve.gateway.admission import BILLED_PATHS, canonical_path
from glmserve.gateway.asgi_body import read_body, replay_body
from glmserve.gateway.backends import BackendPool
from glmserve.gateway.models_map import ModelMap
from glmserve.gateway.proxy import Proxy
from glmserve.gateway.proxy_metrics import ProxyMetrics
from glmserve.gateway.proxy_options import ProxyOptions
from glmserve.gateway.settings import GatewaySettings

SERVICE_UNAVAILABLE = 503
STANDBY_TIMEOUT_S = 120.0  # a standby's answer is bounded by --request-timeout, else by this


class StandbyFallback:
    def __init__(self, app: ASGIApp, settings: GatewaySettings, local_ready: Callable[[], bool],
                 registry: CollectorRegistry | None = None) -> None:
        self.app = app
        self.local_ready = local_ready
        options = ProxyOptions(max_retries=len(settings.standby_urls) - 1)
        client = httpx.AsyncClient(timeout=httpx.Timeout(connect=options.connect_timeout_s, read=None,
                                                         write=options.connect_timeout_s,
                                                         pool=options.connect_timeout_s), trust_env=False)
        self.pool = BackendPool(client, settings.probe_interval_s, settings.unhealthy_after, options.eject_after,
                                options.breaker_cooldown_s)
        for url in settings.standby_urls:
            self.pool.add(url, standby=True)
        self.proxy = Proxy(self.pool, (), ModelMap.empty(), options, settings.request_timeout_s or STANDBY_TIMEOUT_S,
                           ProxyMetrics(self.pool, registry))

    def standby_ready(self) -> bool:
        return bool(self.pool.candidates(()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._lifespan_send(send))
            return
        if scope["type"] != "http" or scope["method"] != "POST" or canonical_path(scope["path"]) not in BILLED_PATHS:
            await self.app(scope, receive, send)
            return
        if not self.local_ready() and self.standby_ready():
            await self.proxy(scope, receive, send)
            return
        body, gone = await read_body(receive)
        if gone:
            return
        diverted = False

        async def local_send(message: Message) -> None:
            nonlocal diverted
            if message["type"] == "http.response.start" and message["status"] == SERVICE_UNAVAILABLE \
                    and self.standby_ready():
                diverted = True  # nothing of it reached the client: the standby answers instead
            if not diverted:
                await send(message)

        await self.app(scope, replay_body(body, receive), local_send)
        if diverted:
            await self.proxy(scope, replay_body(body, receive), send)

    def _lifespan_send(self, send: Send) -> Send:
        """Starts probing the standbys once the app has started, stops it when the app has shut down."""
        async def on_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                await self.pool.start()
            elif message["type"] == "lifespan.shutdown.complete":
                await self.pool.stop()
                await self.pool.client.aclose()
                await self.proxy.close()
            await send(message)

        return on_send
