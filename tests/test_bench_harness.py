"""bench/harness.py: the decode rate counts only the steps after every prompt has its first token; the mix runs one
request set per sample; bench/mix_halves.py splits a mix at that same step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import harness  # noqa: E402
import workloads  # noqa: E402


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


def test_the_mix_has_a_sample_per_request_set() -> None:
    # each sample runs its own set of requests (a second run of one set would hit the prefix cache)
    class Recorder(harness.Engine):
        def __init__(self) -> None:
            self.runs: list[list[list[int]]] = []

        def load(self, args: object) -> None: ...

        def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
            self.runs.append(prompts)
            return [max_tokens] * len(prompts)

        def decode_timeline(self, prompts: list[list[int]], max_tokens: int) -> harness.Timeline:
            raise NotImplementedError

    sets = [[[1, 2], [3]], [[4, 5, 6]], [[7], [8], [9]]]
    work = workloads.Workloads(quick=False, decode_tokens=4, repeats=3, startup=[1], warmup=[1], prefill={},
                               decode_b1=[], decode_b32=[], throughput=sets, prefix_cold=[], prefix_warm=[])
    engine = Recorder()
    suite = harness.Suite(engine, work)
    assert harness.repeats(work, "throughput_64_tok_s") == 3
    for index in range(3):
        suite.sample("throughput_64_tok_s", index)
    assert engine.runs == sets
    assert [d["requests"] for d in suite.details["throughput"]] == [2, 1, 3]


def test_mix_halves_splits_at_the_step_where_every_prompt_has_a_token() -> None:
    import mix_halves

    # 2 requests: a prefill step, a mixed step (the second prompt's first token), then 3 decode steps
    timeline = [(1.0, 1, 1), (3.0, 3, 2), (3.5, 5, 2), (4.0, 7, 2), (5.0, 9, 2)]
    run = mix_halves.halves(timeline, start=0.0, requests=2)
    assert run["prefill_steps"] == 2 and run["prefill_half_s"] == 3.0
    assert run["decode_steps"] == 3 and run["decode_half_s"] == 2.0 and run["decode_step_median_ms"] == 500.0
    assert run["total_s"] == 5.0 and run["tok_s"] == 9 / 5.0
