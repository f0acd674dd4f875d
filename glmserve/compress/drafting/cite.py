"""Findings of the draft checks, each cited by section, paragraph, page and character offsets
(glmserve/compress/locate.py: the unit holding an offset gives its section label and paragraph number, as the
compression trace map cites them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from glmserve.compress import locate
from glmserve.compress.locate import Cite


@dataclass(frozen=True)
class Finding:
    check: str  # time_order, date_offset, date_span, duration_sum, defined_before_use, defined_twice,
    #             abbreviation_before_use, abbreviation_undefined, term_variant, term_misspelling
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


class Locator(locate.Locator):
    """A document's locator that also writes findings."""

    def finding(self, check: str, message: str, start: int, end: int,
                related: tuple[int, int] | None = None) -> Finding:
        other = self.cite(*related) if related is not None else None
        return Finding(check, message, self.doc, self.cite(start, end), self.text[start:end], other)
