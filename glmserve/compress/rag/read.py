"""Retrieve-then-compress, the reading half: the retrieved sections (whole, each the exact source range of its
record) are compressed together for the question (glmserve/compress: query-aware relevance = cosine + BM25, MMR,
anchors kept verbatim) to the token budget the reader gets, and every kept span is traced back to its document's
offsets, section, paragraph and page through the record's trace map."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from glmserve.compress import Document, compress
from glmserve.compress.rag.records import Quote, Record
from glmserve.compress.tokens import TokenCounter, default_counter
from glmserve.errors import InvalidRequestError


@dataclass(frozen=True)
class Answer:
    """What the reader is handed for a question: `text` (`tokens` long), built from `quotes` (each
    `source[start:end]` of its document, in the order of `sections`, then by offset)."""

    question: str
    text: str
    tokens: int
    sections: list[Record]
    quotes: list[Quote]


def _ids(records: Sequence[Record]) -> list[str]:
    """Document ids the reader sees ("policy §4.2"); a section stored in parts gets "#2", "#3"..."""
    seen: dict[str, int] = {}
    out = []
    for r in records:
        base = f"{r.doc} §{r.section}" if r.section else r.doc
        seen[base] = seen.get(base, 0) + 1
        out.append(base if seen[base] == 1 else f"{base} #{seen[base]}")
    return out


def _quote(record: Record, start: int, end: int, kind: str, score: float) -> Quote:
    """A kept span of a whole-section record (offsets into its text) as source offsets, cited through the
    record's sentence spans."""
    a, b = record.start + start, record.start + end
    i = max(bisect.bisect_right([s.start for s in record.spans], a) - 1, 0)
    s = record.spans[i]
    return Quote(record.doc, a, b, s.section, s.paragraph, s.page, kind, record.text[start:end], score)


def read(records: Sequence[Record], question: str, target_tokens: int, scores: Sequence[float] | None = None,
         count: TokenCounter | None = None) -> Answer:
    """The records (best first, whole sections: `text == source[start:end]`) compressed together for the question
    to at most `target_tokens`; where the kept anchors alone exceed it, the lowest-ranked section is left out."""
    if target_tokens < 1:
        raise InvalidRequestError(f"target_tokens must be >= 1, got {target_tokens}")
    if not all(s.at == s.start - r.start for r in records for s in r.spans):
        raise InvalidRequestError("retrieve-then-compress reads whole-section records (an index of --mode sections)")
    count = count or default_counter()
    scores = list(scores) if scores is not None else [0.0] * len(records)
    records = list(records)
    while True:
        ids = _ids(records)
        result = compress([Document(i, r.text) for i, r in zip(ids, records)], query=question,
                          target_tokens=target_tokens, count_tokens=count) if records else None
        if result is None or result.compressed_tokens <= target_tokens or len(records) == 1:
            break
        records.pop()
    if result is None:
        return Answer(question, "", 0, [], [])
    at = {i: n for n, i in enumerate(ids)}
    quotes = [_quote(records[at[s.doc]], s.start, s.end, s.kind, scores[at[s.doc]]) for s in result.spans]
    return Answer(question, result.text, result.compressed_tokens, records, quotes)
