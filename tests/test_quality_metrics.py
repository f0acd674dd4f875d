"""bench/quality_metrics.py: llama-perplexity's windows, perplexity, and the top-N KL estimate (exact when the
top-N lists hold the whole distribution, close when they hold most of its mass)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from quality_metrics import Scored, kl_top, summarize, windows  # noqa: E402


def test_windows_are_llama_perplexity_chunks():
    out = windows("t", list(range(10)), 4)
    assert [w.tokens for w in out] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the remainder is dropped
    assert all(w.first_scored == 3 for w in out)  # positions 2.. of 4 predict tokens 3..
    assert [w.tokens for w in windows("t", list(range(6)), 8)] == [list(range(6))]
    with pytest.raises(ValueError):
        windows("t", [1, 2, 3], 2)


def _top(logprobs: torch.Tensor, n: int) -> dict[int, float]:
    values, ids = logprobs.topk(n)
    return dict(zip(ids.tolist(), values.tolist()))


def test_kl_top_is_exact_with_whole_distributions_and_close_with_most_of_the_mass():
    gen = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(12, generator=gen, dtype=torch.float64) * 3, -1)
    q = torch.log_softmax(p + 0.3 * torch.randn(12, generator=gen, dtype=torch.float64), -1)
    exact = torch.sum(p.exp() * (p - q)).item()
    assert kl_top(_top(p, 12), _top(q, 12)) == pytest.approx(exact, rel=1e-9)
    assert kl_top(_top(p, 12), _top(p, 12)) == pytest.approx(0.0, abs=1e-12)
    vocab = torch.log_softmax(torch.randn(5000, generator=gen, dtype=torch.float64) * 5, -1)
    noisy = torch.log_softmax(vocab + 0.2 * torch.randn(5000, generator=gen, dtype=torch.float64), -1)
    full = torch.sum(vocab.exp() * (vocab - noisy)).item()
    assert sum(math.exp(v) for v in _top(vocab, 20).values()) > 0.9  # the top 20 hold 90% of the mass
    estimate = kl_top(_top(vocab, 20), _top(noisy, 20))
    assert 0.75 * full < estimate < full  # coarse-grained: below the full KL, by about the unlisted share


def test_summary_perplexity_and_agreement():
    ref = [Scored([math.log(0.5), math.log(0.25)], [{1: math.log(0.5), 2: math.log(0.3)}, {3: math.log(0.9)}])]
    same = summarize(ref, ref)
    assert same.tokens == 2 and same.ppl == pytest.approx(math.sqrt(8)) and same.kl == pytest.approx(0, abs=1e-12)
    assert same.top1 == 1.0
    other = [Scored([math.log(0.5), math.log(0.5)], [{2: math.log(0.6), 1: math.log(0.2)}, {3: math.log(0.9)}])]
    worse = summarize(other, ref)
    assert worse.ppl == pytest.approx(2.0) and worse.top1 == 0.5 and worse.kl > 0
    assert summarize(ref, None).kl is None
