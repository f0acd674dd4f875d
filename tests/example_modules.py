"""Loading a script from examples/ as a module, for the tests that drive the examples."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    """examples/NAME.py as a module (registered while it runs: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module
