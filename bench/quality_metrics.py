"""Perplexity and next-token KL divergence from per-position logprobs (the pieces of bench_quality.py).

Windows follow llama.cpp's `llama-perplexity` (tools/perplexity/perplexity.cpp, `perplexity()`): the token
stream is cut into non-overlapping chunks of `ctx` tokens (the remainder is dropped), each chunk is evaluated on
its own, and only its second half is scored: the logits of positions ctx/2 .. ctx-2 predict tokens
ctx/2+1 .. ctx-1, so every scored token sees at least ctx/2 tokens of context.

A position's distribution is known through its top-N logprobs only (the API returns N <= 20), so the KL
divergence KL(reference || tested) is taken over the reference's listed tokens plus one bucket for all other
tokens. A reference token that the tested top-N does not list is at most as likely as the tested N-th token:
it gets that probability, or less when the tested distribution's remaining mass is smaller. Grouping the
unlisted tokens into one bucket makes the figure a lower estimate of the full KL, short by about the share of
the mass outside the reference's top-N (tests/test_quality_metrics.py: about 0.8x of it with 90% of the mass listed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TopLogprobs = dict[int, float]  # token id -> logprob


@dataclass(frozen=True)
class Window:
    """One chunk of a text: its tokens and the first position whose token is scored."""

    text: str
    tokens: list[int]
    first_scored: int  # tokens[first_scored:] are scored


def windows(text: str, token_ids: list[int], ctx: int) -> list[Window]:
    """llama-perplexity's chunks of `token_ids` (at least one: a text shorter than `ctx` is one chunk)."""
    if ctx < 4:
        raise ValueError(f"ctx must be at least 4, got {ctx}")
    count = max(1, len(token_ids) // ctx)
    chunks = [token_ids[i * ctx:(i + 1) * ctx] for i in range(count)]
    return [Window(text, chunk, len(chunk) // 2 + 1) for chunk in chunks]


@dataclass
class Scored:
    """Per scored position of a window: the logprob of the actual token and the top-N alternatives."""

    logprobs: list[float] = field(default_factory=list)
    tops: list[TopLogprobs] = field(default_factory=list)


def kl_top(reference: TopLogprobs, tested: TopLogprobs) -> float:
    """KL(reference || tested) in nats over the reference's listed tokens plus one 'other' bucket."""
    p = {t: math.exp(v) for t, v in reference.items()}
    p_rest = max(0.0, 1.0 - sum(p.values()))
    known = {t: math.exp(tested[t]) for t in p if t in tested}
    missing = [t for t in p if t not in tested]
    left = max(0.0, 1.0 - sum(known.values()))
    floor = math.exp(min(tested.values())) if tested else left
    each = min(floor, left / (len(missing) + 1)) if missing else 0.0
    q = {**known, **{t: each for t in missing}}
    q_rest = max(1e-12, left - each * len(missing))
    kl = sum(pt * (math.log(pt) - math.log(max(q[t], 1e-12))) for t, pt in p.items() if pt > 0)
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(0.0, kl)


@dataclass(frozen=True)
class Summary:
    tokens: int
    ppl: float
    kl: float | None  # mean over positions; None for the reference itself or without top-N
    top1: float | None  # share of positions whose most likely token is the reference's


def summarize(tested: list[Scored], reference: list[Scored] | None) -> Summary:
    """Perplexity of `tested` over all its scored positions; KL and top-1 agreement against `reference`
    (the same windows, position by position)."""
    values = [v for s in tested for v in s.logprobs]
    ppl = math.exp(-sum(values) / len(values))
    if reference is None:
        return Summary(len(values), ppl, None, None)
    pairs = [(r, t) for rs, ts in zip(reference, tested, strict=True)
             for r, t in zip(rs.tops, ts.tops, strict=True) if r and t]
    if not pairs:
        return Summary(len(values), ppl, None, None)
    kl = sum(kl_top(r, t) for r, t in pairs) / len(pairs)
    top1 = sum(max(r, key=r.__getitem__) == max(t, key=t.__getitem__) for r, t in pairs) / len(pairs)
    return Summary(len(values), ppl, kl, top1)
