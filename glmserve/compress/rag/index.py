"""Building an index and answering a query: documents -> records (section summaries with their trace map, or
fixed-size chunks) -> vectors -> Milvus; a question -> its vector -> the top-k records -> within each, the kept
spans that best answer it (cosine to the question plus BM25, as glmserve/compress/select.py scores units),
each traced back to its source offsets, section and paragraph."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from glmserve.compress import Document
from glmserve.compress.bm25 import bm25_scores
from glmserve.compress.rag.records import Record, SpanRef, chunk_records, section_records
from glmserve.compress.rag.store import MilvusStore
from glmserve.compress.rag.vectors import passage_vectors
from glmserve.compress.tokens import TokenCounter, default_counter
from glmserve.embed import embed
from glmserve.errors import InvalidRequestError

ANSWER_SPANS = 2  # spans quoted per retrieved record


@dataclass(frozen=True)
class Quote:
    doc: str
    start: int
    end: int
    section: str
    paragraph: int
    page: int
    kind: str
    text: str  # == source[start:end]
    score: float


@dataclass(frozen=True)
class Hit:
    score: float
    record: Record
    quotes: list[Quote]


def make_records(documents: Sequence[Document], mode: str = "summary", ratio: float = 3.4, chunk_words: int = 128,
                 count: TokenCounter | None = None) -> list[Record]:
    if not documents:
        raise InvalidRequestError("give at least one document to index")
    if mode == "summary":
        count = count or default_counter()
        return [r for d in documents for r in section_records(d.id, d.text, ratio, count)]
    if mode == "chunks":
        return [r for d in documents for r in chunk_records(d.id, d.text, chunk_words)]
    raise InvalidRequestError(f"index mode is 'summary' or 'chunks', got {mode!r}")


def build_index(store: MilvusStore, records: Sequence[Record]) -> int:
    """(Re)creates the store's collection with the records; returns how many were stored."""
    store.create(replace=True)
    store.insert(records, passage_vectors([r.text for r in records]))
    return len(records)


def query(store: MilvusStore, question: str, k: int = 5) -> list[Hit]:
    if not question.strip():
        raise InvalidRequestError("the question is empty")
    if k < 1:
        raise InvalidRequestError(f"k must be >= 1, got {k}")
    q = passage_vectors([question])
    return [Hit(score, r, answer_quotes(r, question, q[0])) for score, r in store.search(q, k)[0]]


def answer_quotes(record: Record, question: str, q_vec: np.ndarray, n: int = ANSWER_SPANS) -> list[Quote]:
    """The record's n spans most relevant to the question, in source order."""
    spans: list[SpanRef] = record.spans
    texts = [record.quote(s) for s in spans]
    if not texts:
        return []
    rel = embed(texts) @ q_vec
    bm25 = bm25_scores(texts, question)
    if bm25.max() > 0:
        rel = rel + bm25 / bm25.max()
    best = sorted(np.argsort(-rel, kind="stable")[:n].tolist())
    return [Quote(record.doc, spans[i].start, spans[i].end, spans[i].section, spans[i].paragraph, spans[i].page,
                  spans[i].kind, texts[i], float(rel[i])) for i in best]
