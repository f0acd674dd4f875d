"""Building an index and answering a query. Index: documents -> records (whole sections as parents with their
summary keys, section summaries with their trace map, or fixed-size chunks) -> vectors -> Milvus. Query: a
question -> its vector -> the top-k records (glmserve/compress/rag/retrieve.py: one list or several fused by
reciprocal rank) -> either the retrieved sections compressed together for the question to the reader's token
budget (`ask`, glmserve/compress/rag/read.py), or, within each record, the kept spans that best answer it
(`query`: cosine to the question plus BM25, as glmserve/compress/select.py scores units); both trace every span
back to its source offsets, section, paragraph and page."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from glmserve.compress import Document
from glmserve.compress.bm25 import bm25_scores
from glmserve.compress.rag.read import Answer, read
from glmserve.compress.rag.records import Quote, Record, SpanRef, chunk_records, parent_records, section_records
from glmserve.compress.rag.retrieve import DEFAULT_METHOD, rank
from glmserve.compress.rag.store import MilvusStore
from glmserve.compress.rag.vectors import passage_vectors
from glmserve.compress.tokens import TokenCounter, default_counter
from glmserve.embed import embed
from glmserve.errors import InvalidRequestError

ANSWER_SPANS = 2  # spans quoted per retrieved record
KEY_RATIO = 1.0  # summary ratio of an index's keys (1: every sentence is a key), chosen on the tune split
READ_TOKENS = 2048  # the reader's budget by default: about what 5 chunks of 256 words hand over


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
    raise InvalidRequestError(f"index mode is 'sections', 'summary' or 'chunks', got {mode!r}")


def make_parents(documents: Sequence[Document], key_ratio: float = KEY_RATIO,
                 count: TokenCounter | None = None) -> tuple[list[Record], list[tuple[int, SpanRef]]]:
    """Whole sections of every document and their keys (record index into the returned list, span)."""
    if not documents:
        raise InvalidRequestError("give at least one document to index")
    count = count or default_counter()
    records: list[Record] = []
    keys: list[tuple[int, SpanRef]] = []
    for d in documents:
        recs, ks = parent_records(d.id, d.text, key_ratio, count)
        keys += [(len(records) + i, s) for i, s in ks]
        records += recs
    return records, keys


def build_index(store: MilvusStore, records: Sequence[Record], keys: Sequence[tuple[int, SpanRef]] = ()) -> int:
    """(Re)creates the store's collection with the records (ids = their positions) and, given keys, its keys
    collection (each key's vector is its own text's); returns how many records were stored."""
    store.create(replace=True)
    store.insert(records, passage_vectors([r.text for r in records]))
    if keys:
        texts = [records[i].quote(s) for i, s in keys]
        store.create_keys()
        store.insert_keys([i for i, _ in keys], texts, passage_vectors(texts))
    return len(records)


def _check(question: str) -> None:
    if not question.strip():
        raise InvalidRequestError("the question is empty")


def query(store: MilvusStore, question: str, k: int = 5, method: str = "mean") -> list[Hit]:
    """The top-k records, each with its ANSWER_SPANS spans that best answer the question."""
    _check(question)
    q = passage_vectors([question])
    ranked = rank(store, [question], q, k, method)[0]
    records = store.get([i for i, _ in ranked])
    return [Hit(score, r, answer_quotes(r, question, q[0])) for (_, score), r in zip(ranked, records)]


def ask(store: MilvusStore, question: str, k: int = 5, target_tokens: int = READ_TOKENS,
        method: str = DEFAULT_METHOD, count: TokenCounter | None = None) -> Answer:
    """Retrieve-then-compress: the top-k sections compressed together for the question to `target_tokens`."""
    _check(question)
    ranked = rank(store, [question], passage_vectors([question]), k, method)[0]
    return read(store.get([i for i, _ in ranked]), question, target_tokens, [s for _, s in ranked], count)


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
