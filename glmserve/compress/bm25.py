"""BM25 relevance of units to a query (Robertson & Zaragoza, "The Probabilistic Relevance Framework:
BM25 and Beyond", 2009; Lucene's idf variant), vectorized with numpy. Words: lowercased Latin/digit runs,
Chinese by jieba (loaded only when the text has Chinese)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

_WORD = re.compile(r"[a-z0-9]+(?:[-_'.][a-z0-9]+)*|[\u4e00-\u9fff]+")
_CJK = re.compile(r"[\u4e00-\u9fff]")
_STOP = frozenset(
    "a an and are as at be by for from has have in is it its of on or that the this to was were will with "
    "which who shall must may not no any all such 的 了 和 与 或 在 是 应 应当".split())


@lru_cache(maxsize=1)
def _jieba() -> Any:
    import jieba

    jieba.setLogLevel(60)
    return jieba


def words(text: str) -> list[str]:
    out: list[str] = []
    for w in _WORD.findall(text.lower()):
        if _CJK.match(w):
            out.extend(t for t in _jieba().lcut(w) if t not in _STOP)
        elif w not in _STOP:
            out.append(w)
    return out


def bm25_scores(units: Sequence[str], query: str, k1: float = 1.5, b: float = 0.75) -> np.ndarray:
    """Score of every unit for the query (0 where no query word occurs)."""
    n = len(units)
    q = set(words(query))
    if n == 0 or not q:
        return np.zeros(n, dtype=np.float64)
    vocab = {w: i for i, w in enumerate(sorted(q))}
    toks = [words(u) for u in units]
    lengths = np.fromiter(map(len, toks), dtype=np.float64, count=n)
    unit_idx = np.fromiter((i for i, ws in enumerate(toks) for w in ws if w in vocab), dtype=np.int64)
    term_idx = np.fromiter((vocab[w] for ws in toks for w in ws if w in vocab), dtype=np.int64)
    tf = np.zeros((n, len(vocab)))
    np.add.at(tf, (unit_idx, term_idx), 1.0)
    df = (tf > 0).sum(axis=0)
    idf = np.log(1.0 + (n - df + 0.5) / (df + 0.5))
    norm = k1 * (1.0 - b + b * lengths / max(lengths.mean(), 1e-9))
    return (tf * (k1 + 1.0) / (tf + norm[:, None]) * idf).sum(axis=1)
