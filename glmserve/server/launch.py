"""Run the server under uvicorn until SIGTERM/SIGINT; graceful shutdown exits 0.

On SIGTERM uvicorn stops accepting connections, lets in-flight requests finish for up to
`shutdown_timeout_s` (then cancels them, which aborts their engine requests), runs the app's
lifespan shutdown (engine thread stopped) and returns. uvicorn then re-raises the signal it
caught; the handler installed here turns that into a clean exit with status 0.

The engine starts loading the model before the server's modules (FastAPI, uvicorn, the routes) are imported and
the app is built: the two overlap (the load's tensor ops release the GIL), and the loaded model waits for the
app's hook before its warm-up (`AsyncEngine.start(on_loaded_later=True)`).
"""

from __future__ import annotations

import asyncio
import logging
import logging.config
import signal
from types import FrameType
from typing import TYPE_CHECKING

from glmserve.config import EngineConfig
from glmserve.engine.async_engine import AsyncEngine
from glmserve.server.config import ServerConfig
from glmserve.server.logs import logging_config

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
STOP_LOADING_TIMEOUT_S = 600.0


def _exit_cleanly(signum: int, _: FrameType | None) -> None:
    raise SystemExit(0)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until stopped. Returns 0 after a graceful shutdown, 1 if the engine failed."""
    signal.signal(signal.SIGTERM, _exit_cleanly)  # also covers a SIGTERM before uvicorn is up
    log_config = logging_config(server_config.log_level, server_config.log_format)
    logging.config.dictConfig(log_config)
    if server_config.host not in LOOPBACK_HOSTS and server_config.gateway.keys_file is None:
        logger.warning("listening on %s without API keys (--keys FILE): anyone who can reach this address can "
                       "use the model", server_config.host)
    server: uvicorn.Server | None = None

    def on_engine_failure(message: str) -> None:
        logger.error("%s; stopping the server", message)
        if server is not None:
            server.should_exit = True

    engine = AsyncEngine(engine_config, on_failure=on_engine_failure, freeze_heap_when_ready=True)
    engine.start(on_loaded_later=True)
    try:
        import uvicorn  # imported here, while the model loads

        from glmserve.server.app import create_app

        app = create_app(engine_config, server_config, engine=engine)
    except BaseException:  # a bad option (alias, keys file): the load in its thread must end before the process
        asyncio.run(engine.shutdown(timeout_s=STOP_LOADING_TIMEOUT_S))  # exits (torch aborts it otherwise)
        raise
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        log_config=log_config,
        timeout_graceful_shutdown=server_config.shutdown_timeout_s,
    )
    server = uvicorn.Server(config)
    if engine.failure is not None:  # it failed before `server` existed: stop at once instead of serving 503s
        server.should_exit = True
    server.run()
    return 1 if engine.failure is not None or not server.started else 0
