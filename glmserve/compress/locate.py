"""Offsets to citations: which sentence, section, paragraph and page of a document a character offset is in
(the units of glmserve/compress/segment.py, found by binary search)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from glmserve.compress.segment import Unit, segment


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
