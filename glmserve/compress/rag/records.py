"""What a RAG index stores: one record per document section, holding the section's compressed summary and its
trace map (glmserve/compress: anchors kept verbatim, narrative chosen to a ratio), or, as the baseline, one
record per plain fixed-size chunk of words.

A record's `text` is what a query hands the reader; each of its `spans` is an exact source substring,
`source[start:end] == text[at:at + end - start]`, cited by section, paragraph and page.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import groupby

from glmserve.compress import Document, compress
from glmserve.compress.locate import Locator
from glmserve.compress.tokens import TokenCounter
from glmserve.errors import InvalidRequestError

MAX_RECORD_CHARS = 16_000  # a longer section is stored as consecutive parts (Milvus VARCHAR holds 65,535 bytes)
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class SpanRef:
    start: int
    end: int
    section: str
    paragraph: int
    page: int
    kind: str  # "anchor", "narrative" or "chunk"
    at: int  # where the span's text begins in the record's text


@dataclass(frozen=True)
class Quote:
    """A span handed to the reader, traced to its source: `text == source[start:end]` of document `doc`."""

    doc: str
    start: int
    end: int
    section: str
    paragraph: int
    page: int
    kind: str
    text: str
    score: float


@dataclass
class Record:
    doc: str
    section: str
    start: int  # the source range the record stands for
    end: int
    text: str
    spans: list[SpanRef] = field(default_factory=list)

    def quote(self, span: SpanRef) -> str:
        return self.text[span.at:span.at + span.end - span.start]


def _join(source: str, pieces: list[tuple[int, int]]) -> tuple[str, list[int]]:
    """The pieces' texts joined (a space between adjacent ones, " … " over a gap) and where each begins."""
    out, at, pos, prev = [], [], 0, None
    for a, b in pieces:
        if prev is not None:
            sep = " " if source[prev:a].strip() == "" else " … "
            out.append(sep)
            pos += len(sep)
        at.append(pos)
        out.append(source[a:b])
        pos += b - a
        prev = b
    return "".join(out), at


def section_ranges(loc: Locator) -> list[tuple[str, int, int]]:
    """(section label, start, end) of each run of units in one section, split at MAX_RECORD_CHARS. A run of
    headings only ("5. Termination" before "5.1 Either party ...") joins the run after it, under the label of its
    last heading."""
    runs = [(label, list(group)) for label, group in groupby(loc.units, key=lambda u: u.section)]
    merged: list[tuple[str, list]] = []
    carry: tuple[str, list] | None = None
    for label, units in runs:
        only_headings = all(u.heading for u in units)
        if carry is not None:
            label, units = (label if only_headings else carry[0]), carry[1] + units
            carry = None
        if only_headings:
            carry = (label, units)
            continue
        merged.append((label, units))
    if carry is not None:
        merged.append(carry)
    out = []
    for label, units in merged:
        first = 0
        for i in range(1, len(units) + 1):
            if i == len(units) or units[i].end - units[first].start > MAX_RECORD_CHARS:
                out.append((label, units[first].start, units[i - 1].end))
                first = i
    return out


def _summary(doc: str, text: str, a: int, b: int, ratio: float,
             count: TokenCounter) -> tuple[list[tuple[int, int]], list[str]]:
    """The source ranges and kinds a section's summary at `ratio` keeps (query-agnostic compression)."""
    result = compress([Document(doc, text[a:b])], ratio=ratio, count_tokens=count)
    return [(a + s.start, a + s.end) for s in result.spans], [s.kind for s in result.spans]


def _spans(loc: Locator, pieces: list[tuple[int, int]], kinds: list[str], at: list[int]) -> list[SpanRef]:
    out = []
    for (s, e), kind, pos in zip(pieces, kinds, at):
        c = loc.cite(s, e)
        out.append(SpanRef(s, e, c.section, c.paragraph, c.page, kind, pos))
    return out


def section_records(doc: str, text: str, ratio: float, count: TokenCounter) -> list[Record]:
    """One record per section: its summary at `ratio` (1 keeps the section whole: then the record's text is the
    exact source range, one span per sentence), with the trace map."""
    loc = Locator(doc, text)
    records = []
    for label, a, b in section_ranges(loc):
        if ratio <= 1.0:
            records.append(_whole(loc, label, a, b))
            continue
        pieces, kinds = _summary(doc, text, a, b, ratio, count)
        body, at = _join(text, pieces)
        records.append(Record(doc, label, a, b, body, _spans(loc, pieces, kinds, at)))
    return records


def _whole(loc: Locator, label: str, a: int, b: int) -> Record:
    units = [u for u in loc.units if a <= u.start < b]
    pieces = [(u.start, u.end) for u in units]
    kinds = ["anchor" if u.heading else "narrative" for u in units]
    return Record(loc.doc, label, a, b, loc.text[a:b], _spans(loc, pieces, kinds, [s - a for s, _ in pieces]))


def parent_records(doc: str, text: str, key_ratio: float,
                   count: TokenCounter) -> tuple[list[Record], list[tuple[int, SpanRef]]]:
    """Whole sections as parent records (text = the exact source range, one span per sentence) and their keys:
    the spans of each section's summary at `key_ratio` (1: every sentence), as (record index, span) pairs; each
    key is stored as a vector of its own that points to its section (glmserve/compress/rag/store.py)."""
    loc = Locator(doc, text)
    records: list[Record] = []
    keys: list[tuple[int, SpanRef]] = []
    for label, a, b in section_ranges(loc):
        record = _whole(loc, label, a, b)
        if key_ratio <= 1.0:
            kept = record.spans
        else:
            pieces, kinds = _summary(doc, text, a, b, key_ratio, count)
            kept = _spans(loc, pieces, kinds, [s - a for s, _ in pieces])
        keys += [(len(records), s) for s in kept]
        records.append(record)
    return records, keys


def chunk_records(doc: str, text: str, words: int, overlap: int = 0) -> list[Record]:
    """Plain fixed-size chunking: `words` whitespace-separated words a chunk, `overlap` shared with the next."""
    if words < 1 or not 0 <= overlap < words:
        raise InvalidRequestError(f"chunks need words >= 1 and 0 <= overlap < words, got {words}, {overlap}")
    loc = Locator(doc, text)
    bounds = [(m.start(), m.end()) for m in _WORD.finditer(text)]
    records = []
    for i in range(0, len(bounds), words - overlap):
        a, b = bounds[i][0], bounds[min(i + words, len(bounds)) - 1][1]
        c = loc.cite(a, b)
        records.append(Record(doc, c.section, a, b, text[a:b], [SpanRef(a, b, c.section, c.paragraph, c.page,
                                                                          "chunk", 0)]))
        if i + words >= len(bounds):
            break
    return records
