"""The FastAPI application: OpenAI-compatible routes over an AsyncEngine.

The server starts listening at once; the model loads and warms up in the engine thread.
`/health` (liveness) answers 200 from the start, `/v1/health` (readiness) answers 503 until
the warm-up generation has run, and generation routes answer 503 + Retry-After until then.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from glmserve.config import EngineConfig
from glmserve.engine.async_engine import AsyncEngine, EngineState
from glmserve.gateway.admission import GatewayMiddleware, GatewayParts
from glmserve.gateway.deadline import RequestDeadline
from glmserve.gateway.standby import StandbyFallback
from glmserve.server.aliases import check_aliases
from glmserve.server.compress_routes import router as compress_router
from glmserve.server.config import ServerConfig
from glmserve.server.errors import install_error_handlers
from glmserve.server.generation import ClientDisconnectedError
from glmserve.server.interaction_log import InteractionLog
from glmserve.server.interactions import Interactions
from glmserve.server.interactions import router as feedback_router
from glmserve.server.limits import BodySizeLimit
from glmserve.server.logs import RequestIdMiddleware
from glmserve.server.metrics import HTTPMetricsMiddleware, ServerMetrics
from glmserve.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from glmserve.server.responses import json_response
from glmserve.server.serving_chat import create_chat_completion
from glmserve.server.serving_completion import create_completion
from glmserve.server.serving_responses import router as responses_router
from glmserve.server.sessions_routes import router as sessions_router
from glmserve.server.state import ServingContext

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; never reaches anyone

router = APIRouter()


def _ctx(request: Request) -> ServingContext:
    return request.app.state.serving


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await create_chat_completion(body, request, _ctx(request))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await create_completion(body, request, _ctx(request))


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    model = _ctx(request).loaded()
    cards = [
        ModelCard(id=model_id, root=model.aliases.canonical(model_id), max_model_len=model.max_model_len)
        for model_id in model.aliases.ids()
    ]
    return json_response(ModelList(data=cards))


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Response:
    model = _ctx(request).loaded()
    card = ModelCard(id=model_id, root=model.aliases.canonical(model_id), max_model_len=model.max_model_len)
    return json_response(card)


@router.get("/health")
async def liveness(request: Request) -> JSONResponse:
    engine = _ctx(request).engine
    alive = engine.state is not EngineState.FAILED
    return JSONResponse({"status": "ok" if alive else "failed"}, status_code=200 if alive else 503)


@router.get("/v1/health")
async def readiness(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    engine = ctx.engine
    stats = engine.stats()
    body: dict[str, Any] = {
        "status": engine.state.value,
        "model": None,
        "engine": {
            "state": engine.state.value,
            "requests_in_flight": engine.num_requests,
            **(dataclasses.asdict(stats) if stats is not None else {}),
        },
    }
    if engine.state is not EngineState.READY:
        body["error"] = engine.failure
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(ctx.config.retry_after_s)})
    body["model"] = ctx.loaded().aliases.served_model
    return JSONResponse(body)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    # collecting may wait on the network (a Redis session store's size): not on the event loop
    content, content_type = await asyncio.to_thread(_ctx(request).metrics.render)
    return Response(content, media_type=content_type)


def create_app(
    engine_config: EngineConfig,
    server_config: ServerConfig | None = None,
    on_engine_failure: Callable[[str], None] | None = None,
    freeze_heap_when_ready: bool = False,
    engine: AsyncEngine | None = None,
) -> FastAPI:
    """A FastAPI app whose lifespan starts the engine (load + warm-up) and shuts it down.

    `on_engine_failure(message)` runs (in the engine thread) if the model fails to load or a
    step fails; the launcher uses it to stop the process instead of serving 503s forever.
    `freeze_heap_when_ready`: the launcher's process owns its heap (AsyncEngine says what that does).
    `engine`: one the launcher made (with its own failure hook and heap setting: the two arguments above are not
    used) and started with `on_loaded_later`, so that the model loads while this app is imported and built.
    """
    server_config = server_config or ServerConfig()
    if engine_config.served_model_name is not None:  # otherwise checked once the model is loaded
        check_aliases(engine_config.served_model_name, server_config.aliases)
    if engine is None:
        engine = AsyncEngine(engine_config, on_failure=on_engine_failure, freeze_heap_when_ready=freeze_heap_when_ready)
    metrics_ = ServerMetrics(engine)
    serving = ServingContext(engine, metrics_, server_config)
    if server_config.log_interactions is not None:
        serving.interactions = Interactions(InteractionLog(server_config.log_interactions, metrics_.registry,
                                                           server_config.log_interactions_max_bytes))

    engine.attach_on_loaded(serving.on_engine_loaded)  # runs in the engine thread once the model is loaded

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.started:
            engine.start()
        yield
        await engine.shutdown()
        if serving.interactions is not None:
            serving.interactions.log.close()

    app = FastAPI(title="glmserve", lifespan=lifespan)
    app.state.serving = serving
    install_error_handlers(app, server_config.retry_after_s)

    async def on_disconnect(_: Request, __: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    app.add_exception_handler(ClientDisconnectedError, on_disconnect)
    # keys, limits and billing inside the HTTP counters (so that 401s and 429s are counted there too); the parts
    # are built now so that a bad keys or price file fails the start, not the first request
    parts = GatewayParts.build(server_config.gateway)
    if server_config.gateway.request_timeout_s is not None:  # inside admission: a timed-out request is not billed
        app.add_middleware(RequestDeadline, timeout_s=server_config.gateway.request_timeout_s,
                           registry=metrics_.registry)
    if server_config.gateway.standby_urls:  # inside admission too: a standby's answers are billed
        app.add_middleware(StandbyFallback, settings=server_config.gateway, registry=metrics_.registry,
                           local_ready=lambda: engine.state is EngineState.READY)
    app.add_middleware(GatewayMiddleware, settings=server_config.gateway, registry=metrics_.registry,
                       tokenizer=serving.count_tokens, parts=parts)
    app.add_middleware(BodySizeLimit, max_bytes=server_config.limits.max_body_bytes)  # before any body is parsed
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics_)
    app.add_middleware(RequestIdMiddleware)  # outermost: every log line of the request carries its id
    app.include_router(router)
    app.include_router(sessions_router)
    app.include_router(compress_router)
    app.include_router(responses_router)
    app.include_router(feedback_router)
    return app
