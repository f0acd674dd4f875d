"""glmserve/gateway/fastjson.py parses what json.loads parses, to the same values, and refuses what it refuses."""

from __future__ import annotations

import json
import math

import pytest

from glmserve.gateway import fastjson


@pytest.mark.parametrize("text", [b'{"model": "m", "messages": [{"role": "user", "content": "h\\u00e9"}]}',
                                  b'{"n": 18446744073709551616}', b"[1.5, -0, null, true]", '{"a": "b"}'])
def test_same_values_as_json(text: bytes | str) -> None:
    assert fastjson.loads(text) == json.loads(text)


def test_what_only_json_accepts_still_parses() -> None:
    assert math.isnan(fastjson.loads(b'{"t": NaN}')["t"])
    assert fastjson.loads(b'{"t": Infinity}')["t"] == math.inf


@pytest.mark.parametrize("text", [b"", b"{", b'{"a": 1} x', b"\xff\xfe", b"[" * 100_000])
def test_what_json_refuses_is_refused(text: bytes) -> None:
    with pytest.raises((ValueError, RecursionError)):
        fastjson.loads(text)
