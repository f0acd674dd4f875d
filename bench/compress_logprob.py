"""The model metric of bench/bench_compress.py: how much of the gold answer's log-probability a compression keeps.

The embedded SmolLM2-135M cannot read a 120K-token document, so the metric looks at the window that matters:
the gold section, i.e. the run of units that share the gold sentence's `section` label (the label the trace map
cites), cut to at most WINDOW_TOKENS SmolLM2 tokens around the gold sentence (the section's heading is kept in
the window when the cut would drop it). For each question:

    gold context    = every unit of the window, in order
    method context  = the window's units that the method kept, in order (" … " where units between were dropped)
    prompt          = context + "\n\n" + question line + "\nAnswer:" ; scored tokens = " " + answer

The answer's tokens are scored by the engine's prompt logprobs (SamplingParams.prompt_logprobs, no sampling),
and the loss of a method is (log p(answer | gold context) - log p(answer | method context)) / answer tokens,
in nats per answer token, averaged over the questions (negative: the method's context made the answer likelier).
Units the method kept outside the window are not shown to the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from glmserve.compress.segment import Unit

WINDOW_TOKENS = 1024


def section_window(units: Sequence[Unit], costs: np.ndarray, gold: int, limit: int = WINDOW_TOKENS) -> list[int]:
    """Indices of the gold sentence's section, at most `limit` tokens around it (heading kept)."""
    doc, label = units[gold].doc, units[gold].section
    lo = hi = gold
    while lo > 0 and units[lo - 1].doc == doc and units[lo - 1].section == label:
        lo -= 1
    while hi + 1 < len(units) and units[hi + 1].doc == doc and units[hi + 1].section == label:
        hi += 1
    head = [lo] if units[lo].heading and lo != gold else []
    a = b = gold
    used = int(costs[gold]) + sum(int(costs[i]) for i in head)
    while True:  # grow one unit to the left, then one to the right, while it fits
        grown = False
        for side in (-1, 1):
            j = a - 1 if side < 0 else b + 1
            if (lo + len(head)) <= j <= hi and used + int(costs[j]) <= limit:
                used += int(costs[j])
                a, b = (j, b) if side < 0 else (a, j)
                grown = True
        if not grown:
            break
    return sorted(set(head) | set(range(a, b + 1)))


def join_units(units: Sequence[Unit], indices: Sequence[int]) -> str:
    """The units in order: a space (or a blank line between paragraphs) when adjacent, " … " across a gap."""
    parts: list[str] = []
    prev = None
    for i in indices:
        if prev is not None:
            if i != prev + 1:
                parts.append(" … ")
            else:
                parts.append("\n\n" if units[i].paragraph != units[prev].paragraph else " ")
        parts.append(units[i].text)
        prev = i
    return "".join(parts)


class AnswerScorer:
    """log p(answer | prompt) with the embedded SmolLM2 (glmserve's engine, prompt logprobs)."""

    def __init__(self) -> None:
        from glmserve import LLM, SamplingParams

        self._llm = LLM(max_model_len=WINDOW_TOKENS + 512)
        self._params = SamplingParams(max_tokens=0, prompt_logprobs=0)
        self._encode = self._llm.tokenizer

    def tokens(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=False)["input_ids"]

    def score(self, items: Sequence[tuple[str, str]]) -> list[tuple[float, int]]:
        """(summed logprob, answer tokens) of each (prompt, answer); repeated prompts are scored once."""
        keyed = [(tuple(self.tokens(p)), tuple(self.tokens(" " + a))) for p, a in items]
        unique = list(dict.fromkeys(keyed))
        outs = self._llm.generate([list(p + a) for p, a in unique], self._params)
        value = {}
        for (p, a), out in zip(unique, outs):
            scored = out.prompt_logprobs[len(p):]
            value[(p, a)] = (float(sum(s.logprob for s in scored)), len(a))
        return [value[k] for k in keyed]
