"""The id of the request a log line is about, on every thread: HTTP handlers, the engine thread, its writers.

The server sets it for each HTTP request (glmserve/server/logs.py: the client's `x-request-id` or a new one).
A context variable does not cross into other threads by itself, so the engine takes the id with each request
(`AsyncEngine.generate` reads `current()` on the caller's task), keeps it on the request and its sequences, and
sets it again on its own thread around the work it does for that request (`about`); jobs it hands to writer
and reader threads keep the id that was set when they were submitted (`carried`). Log filters read `current()`.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

NO_REQUEST = "-"  # lines about no request (startup, a whole batch)
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("glmserve_request_id", default=NO_REQUEST)

P = ParamSpec("P")
R = TypeVar("R")


def current() -> str:
    """The id of the request this thread or task is working for now (`NO_REQUEST` if none)."""
    return _request_id.get()


@contextmanager
def about(request_id: str) -> Iterator[None]:
    """Lines logged inside the block (on this thread or task) name `request_id`."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


def carried(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` to run on another thread with the request id (the whole context) of the caller, as
    `asyncio.to_thread` does; for `ThreadPoolExecutor.submit`, which does not."""
    return functools.partial(contextvars.copy_context().run, fn)  # type: ignore[return-value]
