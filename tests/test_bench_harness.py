"""bench/harness.py's decode rate: only the steps after every prompt has its first token are counted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import harness  # noqa: E402


def test_decode_rate_excludes_prefill_steps() -> None:
    # batch of 2: a slow prefill step gives the first prompt its token, then the second; then 3 decode steps
    timeline = [(10.0, 1), (20.0, 2), (20.5, 4), (21.0, 6), (21.5, 8)]
    assert harness.decode_rate(timeline, batch=2) == pytest.approx(6 / 1.5)


def test_decode_rate_needs_a_decode_step() -> None:
    with pytest.raises(ValueError, match="no decode step"):
        harness.decode_rate([(1.0, 32)], batch=32)
