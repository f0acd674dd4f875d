"""Run the server under uvicorn until SIGTERM/SIGINT; graceful shutdown exits 0.

On SIGTERM uvicorn stops accepting connections, lets in-flight requests finish for up to
`shutdown_timeout_s` (then cancels them, which aborts their engine requests), runs the app's
lifespan shutdown (engine thread stopped) and returns. uvicorn then re-raises the signal it
caught; the handler installed here turns that into a clean exit with status 0.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from glmserve.config import EngineConfig
from glmserve.server.app import create_app
from glmserve.server.config import ServerConfig

logger = logging.getLogger(__name__)


def _exit_cleanly(signum: int, _: FrameType | None) -> None:
    raise SystemExit(0)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serve until stopped. Returns 0 after a graceful shutdown, 1 if the engine failed."""
    signal.signal(signal.SIGTERM, _exit_cleanly)  # also covers a SIGTERM before uvicorn is up
    logging.basicConfig(level=server_config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    server: uvicorn.Server | None = None

    def on_engine_failure(message: str) -> None:
        logger.error("%s; stopping the server", message)
        if server is not None:
            server.should_exit = True

    app = create_app(engine_config, server_config, on_engine_failure=on_engine_failure)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        timeout_graceful_shutdown=server_config.shutdown_timeout_s,
    )
    server = uvicorn.Server(config)
    server.run()
    engine = app.state.serving.engine
    return 1 if engine.failure is not None or not server.started else 0
