"""bench/harness.py's decode rate: only the steps after every prompt has its first token are counted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import harness  # noqa: E402


def test_decode_rate_excludes_prefill_steps() -> None:
    # batch of 2: a slow prefill step gives the first prompt its token, then the second; then 3 decode steps
    timeline = [(10.0, 1, 1), (20.0, 2, 2), (20.5, 4, 2), (21.0, 6, 2), (21.5, 8, 2)]
    assert harness.decode_rate(timeline, batch=2) == pytest.approx(6 / 1.5)


def test_decode_rate_waits_for_every_prompt_not_for_a_token_count() -> None:
    # chunked prefill, batch of 3: two prompts decode while the third is still prefilled; 3 tokens exist at
    # t=2 but the window starts at t=5, when the third prompt has its first token
    timeline = [(1.0, 1, 1), (2.0, 3, 2), (5.0, 6, 3), (6.0, 9, 3), (7.0, 12, 3)]
    assert harness.decode_rate(timeline, batch=3) == pytest.approx(6 / 2.0)


def test_decode_rate_needs_a_decode_step() -> None:
    with pytest.raises(ValueError, match="no decode step"):
        harness.decode_rate([(1.0, 32, 32)], batch=32)


def test_decode_rate_needs_every_prompt_started() -> None:
    with pytest.raises(ValueError, match="only 1 of 2 prompts"):
        harness.decode_rate([(1.0, 1, 1), (2.0, 5, 1)], batch=2)
