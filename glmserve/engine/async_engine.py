"""AsyncEngine: the LLMEngine driven by its own thread, for an asyncio server.

The engine loop runs in one background thread so the event loop never blocks on a model step.
Requests and aborts enter through a lock-protected queue; the thread sleeps on a condition
variable while there is nothing to do. Each request has a channel on the caller's event loop;
the thread hands outputs over with `loop.call_soon_threadsafe`. Outputs are cumulative, so a
channel keeps only the newest one: a slow consumer skips intermediate outputs instead of
queueing them (the same idea as vLLM's `RequestOutputCollector` in
vllm/v1/engine/output_processor.py, written here from scratch).

Admission: at most `max_num_seqs + max_waiting_requests` requests are in flight (as many as
the engine runs at once, plus the allowed waiting ones); one more is refused at once with
`glmserve.errors.EngineOverloadedError` (the server answers 503 + Retry-After). A consumer that
goes away (generator closed or cancelled) aborts its request, which frees its KV blocks.

Shutdown waits for the engine thread to close the engine (`LLMEngine.close`: the KV of session turns
cut short is saved, pending session and disk-tier writes finish), so that a restart finds them.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from glmserve import log_context
from glmserve.config import EngineConfig
from glmserve.engine.llm_engine import LLMEngine
from glmserve.engine.outputs import EngineStats, RequestOutput, StorageStats
from glmserve.engine.sampling import SamplingParams
from glmserve.errors import EngineOverloadedError, GlmServeError
from glmserve.gc_heap import freeze_startup_heap
from glmserve.models.loader import one_thread
from glmserve.models.quantized import HoldsWeights
from glmserve.models.quantized import weight_bytes as model_weight_bytes
from glmserve.sparse_settings import SparseAttentionParams

logger = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "__glmserve_warmup__"
SHUTDOWN_TIMEOUT_S = 300.0  # the engine's last step, then its KV writes (GBs on a slow disk)


class AsyncEngineError(RuntimeError):
    """Base of the errors raised by `AsyncEngine.generate` before or instead of outputs."""


class EngineNotReadyError(AsyncEngineError):
    """The model is still loading or warming up."""


class EngineStoppedError(AsyncEngineError):
    """The engine is shutting down or has failed."""


class EngineState(str, enum.Enum):
    LOADING = "loading"
    WARMING_UP = "warming_up"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class _Channel:
    """Where one request's outputs land, on its caller's event loop."""

    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None
    error: BaseException | None = None

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        # runs on the event loop thread only
        if isinstance(item, BaseException):
            self.error = item
        else:
            self.latest = item
        self.event.set()

    def send(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe hand-over from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


@dataclass
class _NewRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    channel: _Channel
    sparse: SparseAttentionParams | dict | None = None
    session_id: str | None = None
    log_id: str = field(default_factory=log_context.current)  # read on the caller's task: the HTTP request's id


class AsyncEngine:
    """Thread-driven LLMEngine with an async per-request output stream."""

    def __init__(
        self,
        config: EngineConfig,
        on_loaded: Callable[[LLMEngine], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
        freeze_heap_when_ready: bool = False,
    ) -> None:
        """Hooks run in the engine thread: `on_loaded(engine)` after the model is loaded and
        before warm-up (an exception there fails the engine), `on_failure(message)` if loading,
        `on_loaded` or a step fails. `freeze_heap_when_ready`: the process is a server that owns its heap
        (`glmserve serve`), so everything alive once the engine is ready is frozen out of the garbage collector
        (glmserve/gc_heap.py); off for engines inside other programs and tests."""
        self.config = config
        self._on_loaded = on_loaded
        self._on_failure = on_failure
        self._freeze_heap_when_ready = freeze_heap_when_ready
        self.capacity = config.max_num_seqs + config.max_waiting_requests
        self._cond = threading.Condition()
        self._state = EngineState.LOADING
        self._failure: str | None = None
        self._incoming: list[_NewRequest] = []
        self._aborts: list[str] = []
        self._channels: dict[str, _Channel] = {}
        self._stats: EngineStats | None = None
        self._llm: LLMEngine | None = None
        self._thread: threading.Thread | None = None
        self._hook_attached = threading.Event()  # `start(on_loaded_later=True)`: set by `attach_on_loaded`

    # ------------------------------------------------------------------ lifecycle

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, on_loaded_later: bool = False) -> None:
        """Load the model, warm it up and run the engine loop, all in a background thread. `on_loaded_later`: the
        loaded model waits (before its warm-up) for `attach_on_loaded`, so that loading can begin before the caller
        has built what its hook needs (`glmserve serve` loads while the server's modules are imported)."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        if not on_loaded_later:
            self._hook_attached.set()
        self._thread = threading.Thread(target=self._run, name="glmserve-engine", daemon=True)
        self._thread.start()

    def attach_on_loaded(self, on_loaded: Callable[[LLMEngine], None]) -> None:
        """The `on_loaded` hook of an engine started with `on_loaded_later` (the one given to the constructor
        is replaced); the engine thread runs it once the model is loaded, then warms up."""
        self._on_loaded = on_loaded
        self._hook_attached.set()

    async def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the loop; requests still in flight end with `EngineStoppedError`. Waits up to `timeout_s` for
        the engine thread to save what it must (see the module docstring)."""
        with self._cond:
            if self._state is not EngineState.FAILED:
                self._state = EngineState.STOPPED
            channels = list(self._channels.values())
            self._cond.notify_all()
        self._hook_attached.set()  # a thread still waiting for its hook stops instead
        for channel in channels:
            channel.send(EngineStoppedError("The server is shutting down."))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
            if self._thread.is_alive():
                logger.warning("the engine did not stop within %.0f s; KV still being written may be lost", timeout_s)

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def failure(self) -> str | None:
        """Why the engine failed, when `state` is FAILED."""
        return self._failure

    def stats(self) -> EngineStats | None:
        """The engine's statistics as of its last step (None before the model is loaded)."""
        return self._stats

    def storage_stats(self) -> StorageStats | None:
        """KV tier and session store traffic and bytes, read now (None before the model is loaded)."""
        llm = self._llm
        return None if llm is None else llm.storage_stats()

    # ------------------------------------------------------------------ sessions
    # LLMEngine's session methods, run in a worker thread (the store is a disk or Redis)

    @property
    def sessions_enabled(self) -> bool:
        """Whether the loaded engine keeps sessions (False before the model is loaded)."""
        llm = self._llm
        return llm is not None and llm.sessions_enabled

    def _loaded(self) -> LLMEngine:
        if self._llm is None:
            raise EngineNotReadyError("The model is still loading; try again shortly.")
        return self._llm

    async def session_info(self, session_id: str) -> dict | None:
        return await asyncio.to_thread(self._loaded().session_info, session_id)

    async def delete_session(self, session_id: str) -> bool:
        return await asyncio.to_thread(self._loaded().delete_session, session_id)

    async def session_summary(self, session_id: str) -> dict | None:
        return await asyncio.to_thread(self._loaded().session_summary, session_id)

    async def set_session_summary(self, session_id: str, summary: dict | None) -> None:
        await asyncio.to_thread(self._loaded().set_session_summary, session_id, summary)

    @property
    def num_requests(self) -> int:
        """Requests admitted and not finished yet."""
        return len(self._channels)

    # ------------------------------------------------------------------ requests

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str,
        sparse: SparseAttentionParams | dict | None = None, session_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its cumulative outputs until it finishes.

        Errors (not ready, overloaded, prompt too long, invalid values) are raised by the
        first `__anext__`. Closing or cancelling the iterator early aborts the request.
        """
        channel = _Channel(asyncio.get_running_loop())
        self._admit(_NewRequest(request_id, prompt, params, channel, sparse, session_id))
        finished = False
        try:
            while True:
                await channel.event.wait()
                channel.event.clear()
                if channel.error is not None:
                    finished = True  # the engine no longer holds this request
                    raise channel.error
                output, channel.latest = channel.latest, None
                if output is None:
                    continue
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            with self._cond:
                self._channels.pop(request_id, None)
                if not finished:
                    self._aborts.append(request_id)
                    self._cond.notify()

    def abort(self, request_id: str) -> None:
        """Abort a request (its KV blocks return to the pool); unknown ids are ignored."""
        with self._cond:
            channel = self._channels.pop(request_id, None)
            self._aborts.append(request_id)
            self._cond.notify()
        if channel is not None:
            channel.send(EngineStoppedError(f"Request {request_id} was aborted."))

    def release(self, request_id: str) -> None:
        """Forget a finished request whose output stream was not read to its end (a client that left after the
        last output): otherwise it would count as in flight until its iterator is garbage-collected."""
        with self._cond:
            self._channels.pop(request_id, None)

    def _admit(self, request: _NewRequest) -> None:
        with self._cond:
            if self._state is EngineState.LOADING or self._state is EngineState.WARMING_UP:
                raise EngineNotReadyError("The model is still loading; try again shortly.")
            if self._state is not EngineState.READY:
                raise EngineStoppedError(self._failure or "The server is shutting down.")
            if request.request_id in self._channels:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            if len(self._channels) >= self.capacity:
                raise EngineOverloadedError(
                    f"The server is overloaded: {len(self._channels)} requests in flight "
                    f"(limit {self.capacity}); try again later."
                )
            self._channels[request.request_id] = request.channel
            self._incoming.append(request)
            self._cond.notify()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            start = time.monotonic()
            logger.info("startup: loading %s", self.config.model or "the embedded default model")
            engine = LLMEngine(self.config)
            self._llm = engine
            _log_loaded(engine, time.monotonic() - start)
            self._hook_attached.wait()
            loaded = time.monotonic()
            if self._on_loaded is not None and self._state is not EngineState.STOPPED:
                self._on_loaded(engine)
            self._stats = engine.stats()
            self._set_state(EngineState.WARMING_UP)
            self._warm_up(engine)
            self._stats = engine.stats()
            logger.info("startup: warm-up generation in %.2f s; ready after %.2f s", time.monotonic() - loaded,
                        time.monotonic() - start)
            self._set_state(EngineState.READY)
            if self._freeze_heap_when_ready:  # the model's objects live as long as the process: no more GC walks
                logger.debug("heap: %d objects alive after startup frozen out of the garbage collector",
                             freeze_startup_heap())
            self._loop(engine)
            engine.close()
        except GlmServeError as exc:  # a deliberate, explained error (bad option, unsupported model)
            self._fail(f"The engine failed: {exc}")
        except Exception as exc:  # anything else is a bug: clients get 503, the log gets the trace
            logger.exception("engine thread failed")
            self._fail(f"The engine failed: {type(exc).__name__}: {exc}")

    def _set_state(self, state: EngineState) -> None:
        with self._cond:
            if self._state is EngineState.STOPPED:
                return
            self._state = state

    def _warm_up(self, engine: LLMEngine) -> None:
        """One tiny greedy generation, so the first real request does not pay for lazy init. On one torch thread
        (`one_thread`, as the load): its few-token steps gain nothing from more, and on a shared host each of their
        ~100 OpenMP barriers waits for a thread the OS has not scheduled (0.05 s on one thread, 0.1-3.7 s on two at
        load 3-5 on 2 cores, bench/RESULTS.md "Startup on the Xeon without AMX")."""
        with one_thread():
            engine.add_request(WARMUP_REQUEST_ID, "Hello", SamplingParams(max_tokens=2, temperature=0.0))
            while engine.has_unfinished_requests() and self._state is not EngineState.STOPPED:
                engine.step()

    def _loop(self, engine: LLMEngine) -> None:
        while True:
            with self._cond:
                while not (self._incoming or self._aborts or engine.has_unfinished_requests()):
                    if self._state is EngineState.STOPPED:
                        return
                    self._cond.wait()
                if self._state is EngineState.STOPPED:
                    return
                incoming, self._incoming = self._incoming, []
                aborts, self._aborts = self._aborts, []
            for request in incoming:
                try:
                    engine.add_request(request.request_id, request.prompt, request.params, sparse=request.sparse,
                                       session_id=request.session_id, log_id=request.log_id)
                except Exception as exc:  # invalid request: only this request fails
                    request.channel.send(exc)
            for request_id in aborts:
                engine.abort_request(request_id)
            if engine.has_unfinished_requests():
                self._dispatch(engine.step())
            self._stats = engine.stats()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._cond:
            channels = [(self._channels.get(out.request_id), out) for out in outputs]
        for channel, output in channels:
            if channel is not None:
                channel.send(output)

    def _fail(self, message: str) -> None:
        with self._cond:
            self._state = EngineState.FAILED
            self._failure = message
            channels = list(self._channels.values())
        for channel in channels:
            channel.send(EngineStoppedError(message))
        if self._on_failure is not None:
            self._on_failure(message)


def _log_loaded(engine: LLMEngine, seconds: float) -> None:
    """Startup lines: the weights (format, bytes) and the KV pool (blocks, bytes)."""
    model = engine.runner.model
    tensors = [*model.parameters(), *model.buffers()]
    schemes = {m.scheme.name for m in model.modules() if isinstance(m, HoldsWeights)}
    formats = "+".join(sorted(schemes | {str(t.dtype).removeprefix("torch.") for t in tensors}))
    weight_bytes = model_weight_bytes(model) + sum(t.numel() * t.element_size() for t in model.buffers())
    quant = engine.config.quantization or "as in the checkpoint"
    logger.info("startup: model %s loaded in %.2f s: weights %s (quantization: %s), %.1f MB on %s", engine.model_name,
                seconds, formats, quant, weight_bytes / 1e6, engine.device)
    pool = engine.runner.kv_cache
    stats = engine.stats()
    logger.info("startup: KV pool %d blocks x %d tokens (%s), %.1f MB; max_model_len %d", stats.num_total_blocks,
                engine.config.block_size, engine.kv_format.name, pool.numel() * pool.element_size() / 1e6,
                engine.max_model_len)
