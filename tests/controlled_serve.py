"""`glmserve` whose engine a test can hold with files, so that it sees a state for as long as it needs on a
machine of any speed:

- GLMSERVE_TEST_LOAD_GATE=PATH: the model is not loaded before PATH exists (the server stays "loading");
- GLMSERVE_TEST_STEP_PAUSE=PATH: no engine step starts while PATH exists (requests stay in flight).

Usage: python tests/controlled_serve.py serve ARGS... (the arguments of `glmserve`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from server_process import LOAD_GATE_ENV, STEP_PAUSE_ENV

from glmserve.cli import main
from glmserve.engine.llm_engine import LLMEngine


def _held(method: Callable[..., Any], until: Callable[[], bool]) -> Callable[..., Any]:
    def held(self: LLMEngine, *args: Any, **kwargs: Any) -> Any:
        while not until():
            time.sleep(0.01)
        return method(self, *args, **kwargs)

    return held


def install_controls() -> None:
    """Wraps LLMEngine's model load and step with the holds the environment asks for."""
    if gate := os.environ.get(LOAD_GATE_ENV):
        LLMEngine.__init__ = _held(LLMEngine.__init__, Path(gate).exists)  # type: ignore[method-assign]
    if pause := os.environ.get(STEP_PAUSE_ENV):
        LLMEngine.step = _held(LLMEngine.step, lambda: not Path(pause).exists())  # type: ignore[method-assign]


if __name__ == "__main__":
    install_controls()
    main(sys.argv[1:])
