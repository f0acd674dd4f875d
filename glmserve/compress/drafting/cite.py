"""Findings of the draft checks, each cited by section, paragraph, page and character offsets.

Offsets come from glmserve/compress/segment.py: the unit (sentence or heading) holding an offset gives the
section label and paragraph number, as the compression trace map cites them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from glmserve.compress.segment import Unit, segment


@dataclass(frozen=True)
class Cite:
    """Where a piece of the draft is: `text[start:end]`, in `section` (its label), paragraph and page."""

    start: int
    end: int
    section: str
    paragraph: int
    page: int


@dataclass(frozen=True)
class Finding:
    check: str  # time_order, duration_sum, date_span, defined_before_use, defined_twice, abbreviation_before_use,
    #             abbreviation_undefined, term_variant, term_misspelling
    message: str
    doc: str
    at: Cite
    quote: str  # the draft's text at `at` (exactly text[at.start:at.end])
    related: Cite | None = None  # the other place the finding refers to (the definition, the other date)

    def to_dict(self) -> dict:
        return asdict(self)

    def where(self) -> str:
        a = self.at
        section = f"§{a.section} " if a.section else ""
        return f"{self.doc} {section}¶{a.paragraph} p.{a.page} @{a.start}-{a.end}"


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

    def finding(self, check: str, message: str, start: int, end: int,
                related: tuple[int, int] | None = None) -> Finding:
        other = self.cite(*related) if related is not None else None
        return Finding(check, message, self.doc, self.cite(start, end), self.text[start:end], other)
