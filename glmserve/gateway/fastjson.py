"""JSON bodies on the request path: parsed by orjson (a few times faster than the json module on OpenAI-sized
bodies), with the json module's own rules as the fallback where orjson refuses what json accepts (NaN and
Infinity, integers past 64 bits), so that what parses, and to what, is as before."""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(data: bytes | str) -> Any:
    """json.loads(data), faster; ValueError (or RecursionError) where json.loads raises them."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
