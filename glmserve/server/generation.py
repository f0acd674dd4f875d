"""Running engine requests for a handler: errors surfaced early, metrics, aborts, disconnects.

A handler opens one `Generation` per engine request and `start`s them before it answers, so
every request error (overloaded, prompt too long, invalid values) becomes a proper HTTP error
instead of a broken 200 stream. Whatever ends a handler early (client gone, error, shutdown)
aborts the engine requests it still owns, which returns their KV blocks to the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import Request

from glmserve.engine.async_engine import AsyncEngine, EngineNotReadyError, EngineStoppedError
from glmserve.engine.outputs import RequestOutput
from glmserve.engine.sampling import SamplingParams
from glmserve.errors import EngineOverloadedError, PromptTooLongError
from glmserve.server.errors import APIError, BadRequestError, ServiceUnavailableError
from glmserve.server.metrics import RequestTracker, ServerMetrics
from glmserve.server.params import TokenBudget

T = TypeVar("T")
CLIENT_FINISH_REASONS = ("stop", "length")


class ClientDisconnectedError(Exception):
    """The client closed the connection before the response was ready."""


def to_api_error(exc: Exception) -> APIError:
    """The client-facing error for an exception raised while starting or running a request.

    Exceptions that are no request error (bugs) propagate unchanged and end as a plain 500.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return BadRequestError(str(exc), code="context_length_exceeded")
    if isinstance(exc, EngineOverloadedError):
        return ServiceUnavailableError(str(exc), code="overloaded")
    if isinstance(exc, EngineNotReadyError):
        return ServiceUnavailableError(str(exc), code="model_not_ready")
    if isinstance(exc, EngineStoppedError):
        return ServiceUnavailableError(str(exc), code="engine_unavailable")
    if isinstance(exc, ValueError):  # the engine's validation of prompts and sampling values
        return BadRequestError(str(exc))
    raise exc


class Generation:
    """One engine request and its stream of cumulative outputs."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        sparse: dict[str, Any] | None = None,
        session_id: str | None = None,
        budget: TokenBudget | None = None,
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self._tracker: RequestTracker = (metrics.track(budget.source, budget.lost) if budget is not None
                                         else metrics.track())
        self._outputs = engine.generate(prompt, params, request_id, sparse=sparse, session_id=session_id)
        self._first: RequestOutput | None = None
        self.last: RequestOutput | None = None

    async def start(self) -> None:
        """Wait for the first output; raises the request's error as an `APIError`."""
        try:
            self._first = await anext(self._outputs)
        except Exception as exc:
            raise to_api_error(exc) from exc
        self._record(self._first)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Every output from the first on (call `start` before)."""
        if self._first is None:
            raise RuntimeError("Generation.start() must run before outputs()")
        output = self._first
        yield output
        while not output.finished:
            try:
                output = await anext(self._outputs)
            except Exception as exc:
                raise to_api_error(exc) from exc
            self._record(output)
            yield output

    async def final(self) -> RequestOutput:
        """Run to the end and return the last output."""
        async for _ in self.outputs():
            pass
        assert self.last is not None
        return self.last

    def abort(self) -> None:
        """Abort the engine request unless it has finished, and release it either way (safe to call more than
        once; without the release, streams aborted at random points left finished requests counted in flight)."""
        if self.last is None or not self.last.finished:
            self._engine.abort(self.request_id)
        else:
            self._engine.release(self.request_id)

    def _record(self, output: RequestOutput) -> None:
        for completion in output.outputs:
            if completion.finish_reason is not None and completion.finish_reason not in CLIENT_FINISH_REASONS:
                raise ServiceUnavailableError(f"The request was aborted ({completion.finish_reason}).")
        self.last = output
        self._tracker.on_output(output)


async def start_all(generations: Sequence[Generation]) -> None:
    """Start every generation; on any error abort all of them and raise the first error."""
    results = await asyncio.gather(*(g.start() for g in generations), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        abort_all(generations)
        raise errors[0]


def abort_all(generations: Sequence[Generation]) -> None:
    for generation in generations:
        generation.abort()


async def merge_outputs(generations: Sequence[Generation]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several generations as they come, tagged with the generation's index."""
    if len(generations) == 1:
        async for output in generations[0].outputs():
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for output in generation.outputs():
                queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work` unless the client disconnects first; then cancel it and raise.

    Same approach as vLLM's `with_cancellation` (vllm/entrypoints/utils.py): race the
    handler's work against the ASGI `http.disconnect` message.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself is cancelled (shutdown)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnectedError()
