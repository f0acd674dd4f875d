"""Ranking an index's sections for a question from several ranked lists fused by reciprocal rank (Cormack, Clarke
& Büttcher, "Reciprocal Rank Fusion outperforms Condorcet and individual Rank Learning Methods", SIGIR 2009:
score = sum over lists of 1 / (60 + rank)). The lists, each a Milvus search of the index:

- `mean`: one vector per section (the normalized mean of its sentences' embeddings), cosine to the question;
- `maxsim`: the section's best key (a summary sentence or anchor with a vector of its own), cosine to the
  question: the "parent document" / multi-vector pattern (ColBERT's max-sim at sentence rather than token grain);
- `bm25`: the section's best key by BM25 on its words (Milvus' BM25 function over the keys' text);
- `anchors`: exact-match keys: the question's section numbers, paths, versions, quoted or hyphenated terms, each
  found verbatim in a key (a Milvus `like` filter); sections ranked by how many of them they hold.

A method is a "+"-joined set of lists ("maxsim+bm25"); every list but `mean` needs the keys collection
(`glmserve rag index --mode sections`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

from glmserve.compress.rag.store import MilvusStore
from glmserve.errors import InvalidRequestError

LISTS = ("mean", "maxsim", "bm25", "anchors")
# chosen on the tune split of both corpora (bench/bench_rag.py, bench/RESULTS.md): the template questions share
# words with their answer sentences, which favors BM25; "maxsim+bm25" was 2-4 points lower there and is the
# option where questions paraphrase the text
DEFAULT_METHOD = "bm25"
RRF_K = 60
POOL = 50  # candidates each list contributes to the fusion
_TERM = re.compile(
    r"(?:§\s?|\b)\d+(?:\.\d+)+[a-z]?\b"  # section numbers, versions: 4.2, 3.9.1
    r"|(?<![\w/])/[\w.+-]+(?:/[\w.+-]+)*"  # paths
    r"|[\"'`“‘]([^\"'`”’\n]{2,40})[\"'`”’]"  # quoted terms
    r"|\b[A-Za-z][a-z0-9]*(?:-[A-Za-z0-9]+)+\b"  # hyphenated terms: Build-Depends, pre-install
    r"|\b[A-Z][A-Z0-9_]{2,}\b")  # upper-case names: DEBIAN_FRONTEND, GPL


def parse_method(method: str) -> tuple[str, ...]:
    lists = tuple(dict.fromkeys(m.strip() for m in method.split("+") if m.strip()))
    if not lists or any(m not in LISTS for m in lists):
        raise InvalidRequestError(f"a retrieval method is a '+'-joined set of {', '.join(LISTS)}; got {method!r}")
    return lists


def anchor_terms(question: str) -> list[str]:
    """The question's exact-match keys, in order of appearance (quotes stripped, no Milvus filter metacharacters)."""
    terms = [(m.group(1) or m.group(0)).lstrip("§ ").strip() for m in _TERM.finditer(question)]
    return list(dict.fromkeys(t for t in terms if len(t) >= 2 and not any(c in t for c in '"\\%')))


def rrf(lists: Sequence[Sequence[int]], k: int) -> list[tuple[int, float]]:
    """The k best ids by reciprocal-rank fusion of ranked id lists, with their fused scores (ties: first seen)."""
    score: dict[int, float] = {}
    for ranked in lists:
        for rank, i in enumerate(ranked):
            score[i] = score.get(i, 0.0) + 1.0 / (RRF_K + rank + 1)
    return sorted(score.items(), key=lambda kv: -kv[1])[:k]


def anchor_ranking(store: MilvusStore, question: str) -> list[int]:
    hits: Counter[int] = Counter()
    for term in anchor_terms(question):
        hits.update(store.records_with(term, POOL))
    return [i for i, _ in hits.most_common(POOL)]


def rank(store: MilvusStore, questions: Sequence[str], vectors: np.ndarray, k: int,
         method: str = DEFAULT_METHOD) -> list[list[tuple[int, float]]]:
    """Per question, the ids of its k best sections with their fused scores, best first."""
    if k < 1:
        raise InvalidRequestError(f"k must be >= 1, got {k}")
    lists = parse_method(method)
    if any(m != "mean" for m in lists) and not store.has_keys():
        raise InvalidRequestError(f"index {store.collection!r} has no keys (built with --mode summary or chunks): "
                                  f"retrieve from it with method 'mean', or rebuild it with --mode sections")
    pool = max(POOL, k)
    per_list: list[list[list[int]]] = []
    if "mean" in lists:
        per_list.append(store.search_ids(vectors, pool))
    if "maxsim" in lists:
        per_list.append(store.search_keys(vectors, pool, "vector"))
    if "bm25" in lists:
        worded = [i for i, q in enumerate(questions) if re.search(r"\w", q)]
        found = store.search_keys([questions[i] for i in worded], pool, "sparse") if worded else []
        ranked: list[list[int]] = [[] for _ in questions]
        for i, ids in zip(worded, found):
            ranked[i] = ids
        per_list.append(ranked)
    if "anchors" in lists:
        per_list.append([anchor_ranking(store, q) for q in questions])
    return [rrf([lst[i] for lst in per_list], k) for i in range(len(questions))]
