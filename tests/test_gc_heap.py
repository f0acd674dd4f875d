"""The startup heap is frozen out of the cycle collector (glmserve/gc_heap.py): garbage from before is collected,
not frozen, and the engine freezes its heap once it is ready."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Iterator

import pytest

from glmserve.config import EngineConfig
from glmserve.engine.async_engine import AsyncEngine, EngineState
from glmserve.gc_heap import freeze_startup_heap, pause_startup_collection


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cycle collector frees it


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session collects as before


def test_freezing_collects_cycles_first_and_freezes_what_lives(unfrozen: None) -> None:
    garbage = _Node()
    gone = weakref.ref(garbage)
    del garbage
    alive = _Node()
    assert freeze_startup_heap() > 0
    assert gone() is None  # collected before the freeze, not kept for good
    assert not any(obj is alive for gen in range(3) for obj in gc.get_objects(gen))  # frozen: no generation
    assert gc.collect() >= 0 and alive.me is alive


def test_a_paused_collector_runs_again_once_the_heap_is_frozen(unfrozen: None) -> None:
    """`glmserve serve` pauses automatic collection at its start; freezing the ready heap turns it back on."""
    try:
        pause_startup_collection()
        assert not gc.isenabled()
        freeze_startup_heap()
        assert gc.isenabled()
    finally:
        gc.enable()


def _ready(engine: AsyncEngine, deadline: float) -> None:
    engine.start()
    while engine.state is not EngineState.READY and time.monotonic() < deadline:
        assert engine.state not in (EngineState.FAILED, EngineState.STOPPED), engine.failure
        time.sleep(0.05)
    assert engine.state is EngineState.READY


def test_a_serving_engine_freezes_its_heap_once_ready_and_an_embedded_one_does_not(unfrozen: None,
                                                                                    tiny_model_dir) -> None:
    config = EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=128)
    deadline = time.monotonic() + 120
    embedded = AsyncEngine(config)  # inside another program (or this test process): its heap is not ours
    try:
        _ready(embedded, deadline)
        time.sleep(0.2)
        assert gc.get_freeze_count() == 0
    finally:
        asyncio.run(embedded.shutdown())
    serving = AsyncEngine(config, freeze_heap_when_ready=True)  # as `glmserve serve` builds it
    try:
        _ready(serving, deadline)
        while gc.get_freeze_count() == 0 and time.monotonic() < deadline:  # frozen right after READY
            time.sleep(0.05)
        assert gc.get_freeze_count() > 1000
    finally:
        asyncio.run(serving.shutdown())
