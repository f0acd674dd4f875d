"""An engine started before its server is built (`glmserve serve` loads while the server's modules import):
the loaded model waits for the hook, runs it, then warms up; a shutdown while it waits stops it."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from glmserve.config import EngineConfig
from glmserve.engine.async_engine import AsyncEngine, EngineState
from glmserve.engine.llm_engine import LLMEngine

TIMEOUT_S = 120


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _loaded(caplog: pytest.LogCaptureFixture) -> bool:
    return any("startup: model" in r.getMessage() and "loaded in" in r.getMessage() for r in caplog.records)


@pytest.fixture
def config(tiny_model_dir) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=128)


def test_loaded_model_waits_for_its_hook_then_warms_up(config, caplog) -> None:
    caplog.set_level(logging.INFO, logger="glmserve.engine.async_engine")
    engine = AsyncEngine(config)
    seen: list[LLMEngine] = []
    try:
        engine.start(on_loaded_later=True)
        assert engine.started
        _until(lambda: _loaded(caplog), "the model load")
        time.sleep(0.2)
        assert engine.state is EngineState.LOADING and not seen  # held before the hook and the warm-up
        engine.attach_on_loaded(seen.append)
        _until(lambda: engine.state is EngineState.READY, "ready")
        assert len(seen) == 1 and isinstance(seen[0], LLMEngine)
    finally:
        asyncio.run(engine.shutdown())
    with pytest.raises(RuntimeError, match="already called"):
        engine.start()


def test_shutdown_while_waiting_for_the_hook_stops_the_engine(config, caplog) -> None:
    caplog.set_level(logging.INFO, logger="glmserve.engine.async_engine")
    engine = AsyncEngine(config, on_loaded=lambda _: pytest.fail("no hook was attached"))
    engine.start(on_loaded_later=True)
    _until(lambda: _loaded(caplog), "the model load")
    asyncio.run(engine.shutdown(timeout_s=TIMEOUT_S))
    assert engine.state is EngineState.STOPPED and engine.failure is None
