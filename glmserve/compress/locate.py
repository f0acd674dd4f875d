"""Offsets to citations: which sentence, section, paragraph and page of a document a character offset is in
(the units of glmserve/compress/segment.py, found by binary search), and which kept span of a trace map a
quoted passage comes from (`locate_quote`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import TYPE_CHECKING

import numpy as np

from glmserve.compress.segment import Unit, segment

if TYPE_CHECKING:
    from glmserve.compress.compressor import Span


@dataclass(frozen=True)
class Cite:
    """Where a piece of a document is: `text[start:end]`, in `section` (its label), paragraph and page."""

    start: int
    end: int
    section: str
    paragraph: int
    page: int


class Locator:
    """Maps character offsets of one document to its units (sentences), sections and paragraphs."""

    def __init__(self, doc: str, text: str) -> None:
        self.doc = doc
        self.text = text
        self.units: list[Unit] = segment(doc, text)
        self._starts = np.fromiter((u.start for u in self.units), dtype=np.int64, count=len(self.units))

    def unit_index(self, offset: int) -> int:
        """The unit holding `offset` (the one before it when the offset falls between units); -1 before the first."""
        return int(np.searchsorted(self._starts, offset, side="right")) - 1

    def cite(self, start: int, end: int) -> Cite:
        i = self.unit_index(start)
        if i < 0:
            return Cite(start, end, "", 0, 1)
        u = self.units[i]
        return Cite(start, end, u.section, u.paragraph, u.page)


@dataclass(frozen=True)
class QuoteMatch:
    """Where a quoted passage (a model's answer) is in the kept text: `text[start:end]`, and how it was found:
    `exact` (the quote is that substring) or not (the kept span that shares most of the quote's characters)."""

    start: int
    end: int
    section: str
    paragraph: int
    page: int
    exact: bool


def locate_quote(text: str, spans: Sequence[Span], quote: str, min_overlap: float = 0.75) -> QuoteMatch | None:
    """The kept span (of one document's `spans`, in order) that `quote` comes from, or None.

    Exact first: the quote inside one span, or inside a run of spans that follow each other with only whitespace
    between them (cited at the span where it starts). Otherwise the span that shares the most characters with the
    quote in order (difflib's matching blocks), if they cover at least `min_overlap` of it: the whole span is
    cited, marked not exact."""
    quote = quote.strip()
    if not quote or not spans:
        return None
    runs: list[list[Span]] = [[spans[0]]]
    for s in spans[1:]:
        prev = runs[-1][-1]
        if s.start >= prev.end and not text[prev.end:s.start].strip():
            runs[-1].append(s)
        else:
            runs.append([s])
    for run in runs:
        at = text.find(quote, run[0].start, run[-1].end)
        if at >= 0:
            first = next(s for s in reversed(run) if s.start <= at)
            return QuoteMatch(at, at + len(quote), first.section, first.paragraph, first.page, True)
    best, best_len = None, 0
    for s in spans:
        shared = sum(b.size for b in SequenceMatcher(None, quote, text[s.start:s.end], autojunk=False)
                     .get_matching_blocks())
        if shared > best_len:
            best, best_len = s, shared
    if best is None or best_len < max(12, min_overlap * len(quote)):
        return None
    return QuoteMatch(best.start, best.end, best.section, best.paragraph, best.page, False)
