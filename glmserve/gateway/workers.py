"""`glmserve gateway --workers N`: N gateway processes accepting on one listening socket, so that one gateway
uses more than one core (one process saturates near 500 requests/s: bench/RESULTS.md "Gateway").

uvicorn's supervisor binds the socket, spawns the workers (each imports `worker_app` by name and builds its own
gateway from the settings passed in the environment) and starts a new worker when one dies. What the workers
share, and how:
- limits: Redis, required with keys (each process's own limits would admit N times a key's burst); the
  per-process fallback while Redis is down divides every limit by the gateways x workers;
- the ledger: the same SQLite file (WAL, a busy timeout) or PostgreSQL;
- metrics: prometheus_client's multiprocess mode (a temporary directory of per-process files, summed at scrape
  time); the backends' health and breaker gauges are those of the worker that answers the scrape.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, replace

import uvicorn
from starlette.types import ASGIApp

from glmserve.errors import InvalidRequestError
from glmserve.gateway.proxy_options import ProxyOptions
from glmserve.gateway.settings import GatewaySettings

CONFIG_ENV = "GLMSERVE_GATEWAY_WORKER_CONFIG"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# the supervisor replaces a worker that does not answer its ping within this; uvicorn's 5 s default also kills a
# worker still importing on a loaded machine, again and again
# uvicorn options of both launch paths: no X-Forwarded-* rewriting of each request's scope (uvicorn's
# ProxyHeadersMiddleware, on by default): the gateway reads no client address
LEAN_SERVER = {"proxy_headers": False}
WORKER_HEALTHCHECK_S = 30


def check_workers(settings: GatewaySettings, workers: int) -> None:
    if workers < 1:
        raise InvalidRequestError(f"--workers must be >= 1, got {workers}")
    if workers > 1 and settings.keys_file and not settings.redis_url:
        raise InvalidRequestError(f"--workers {workers} with --keys needs --redis: the workers share a key's limits "
                                  "and budget through Redis (each process alone would admit its own burst)")


def run_gateway_workers(settings: GatewaySettings, options: ProxyOptions, host: str, port: int, workers: int,
                        *, keep_alive_s: int) -> int:
    """Serves with `workers` processes until SIGTERM/SIGINT (uvicorn's supervisor stops the workers gracefully)."""
    check_workers(settings, workers)
    settings = replace(settings, replicas=settings.replicas * workers)
    metrics_dir = tempfile.mkdtemp(prefix="glmserve-gateway-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    os.environ[CONFIG_ENV] = json.dumps({"settings": asdict(settings), "options": asdict(options)})
    try:
        uvicorn.run(f"{__name__}:worker_app", factory=True, workers=workers, host=host, port=port,
                    access_log=False, log_level="info", timeout_graceful_shutdown=30, timeout_keep_alive=keep_alive_s,
                    timeout_worker_healthcheck=WORKER_HEALTHCHECK_S, **LEAN_SERVER)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def worker_app() -> ASGIApp:
    """One worker's gateway, from the settings `run_gateway_workers` put in the environment."""
    from glmserve.gateway.app import configure_logging, create_gateway_app

    configure_logging()
    config = json.loads(os.environ[CONFIG_ENV])
    options = config["options"]
    options["backend_keys"] = tuple(options["backend_keys"])
    return create_gateway_app(GatewaySettings(**config["settings"]), ProxyOptions(**options))


def multiprocess_metrics() -> bool:
    """True in a worker of `--workers N`: counters and histograms live in per-process files."""
    return bool(os.environ.get(MULTIPROC_ENV))
