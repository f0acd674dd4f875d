"""Choosing narrative units to a token budget.

Without a query: k-means over the sentence embeddings (spherical, cosine), the unit nearest each centroid
represents its cluster (clusters by size), then maximal marginal relevance fills what is left with
centrality as the relevance. With a query: relevance = BM25 (min-max normalized) + cosine to the query,
then MMR (Carbonell & Goldstein, SIGIR 1998: lambda * relevance - (1 - lambda) * max similarity to what
is already kept). Fact anchors (dates, amounts, cross-references, entities) add a bonus. With a query, a unit
also takes half of the larger relevance of its neighbours in the same section (`with_neighbours`): the answer to
a question often sits next to the sentence that matches its words (the "sentence window" of retrieval pipelines,
as a score instead of a fixed expansion; the weight was chosen on the tune split of bench/bench_compress.py's
paraphrased license questions, where it took answer retention from 59% to 94%; a section-heading term added
nothing there and was left out). A unit both of whose neighbours are relevant also takes a quarter of the
smaller of the two (BETWEEN_WEIGHT): it sits inside a relevant passage, which a short sentence scoring low on its
own words would otherwise drop from its middle (chosen on tune splits: 0 / 0.25 / 0.5 / 1 kept 92.9 / 100 / 98.6 /
98.6% of the larger license set's tune questions and 93.8 / 96.9 / 96.9 / 96.9% of GPL-3's, gold in the middle).
Greedy by score under the budget: a unit that does not fit is skipped, smaller ones may still fit.
"""

from __future__ import annotations

import numpy as np

FACT_BONUS = 0.15
MMR_LAMBDA = 0.75
NEIGHBOUR_WEIGHT = 0.5
BETWEEN_WEIGHT = 0.25


def kmeans_representatives(emb: np.ndarray, k: int, iters: int = 8, seed: int = 0) -> np.ndarray:
    """Indices of the unit nearest each centroid of a spherical k-means, largest clusters first."""
    n = emb.shape[0]
    k = max(1, min(k, n))
    rng = np.random.default_rng(seed)
    centroids = emb[rng.choice(n, size=k, replace=False)]
    for _ in range(iters):
        assign = (emb @ centroids.T).argmax(axis=1)
        sums = np.zeros_like(centroids)
        np.add.at(sums, assign, emb)
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        centroids = np.where(norms > 0, sums / np.maximum(norms, 1e-12), centroids)
    sims = emb @ centroids.T
    assign = sims.argmax(axis=1)
    sizes = np.bincount(assign, minlength=k)
    masked = np.where(assign[:, None] == np.arange(k)[None, :], sims, -np.inf)
    reps = masked.argmax(axis=0)
    order = np.argsort(-sizes, kind="stable")
    return reps[order][sizes[order] > 0]


def relevance(emb: np.ndarray, bm25: np.ndarray | None, query_emb: np.ndarray | None,
              facts: np.ndarray) -> np.ndarray:
    """Per-unit relevance in about [0, 2]."""
    if query_emb is None:
        centroid = emb.mean(axis=0)
        rel = emb @ (centroid / max(float(np.linalg.norm(centroid)), 1e-12))
    else:
        rel = emb @ query_emb
        if bm25 is not None and bm25.max() > 0:
            rel = rel + bm25 / bm25.max()
    return rel + FACT_BONUS * facts


def with_neighbours(rel: np.ndarray, group: np.ndarray, weight: float | None = None,
                    between: float | None = None) -> np.ndarray:
    """`rel` plus `weight` x the larger relevance of the units before and after it, plus `between` x the smaller
    one (in order, same `group`: one section of one document; none across a group's edge; a unit with one
    neighbour has no smaller one)."""
    weight = NEIGHBOUR_WEIGHT if weight is None else weight
    between = BETWEEN_WEIGHT if between is None else between
    same_prev = np.zeros(rel.shape[0], dtype=bool)
    same_prev[1:] = group[1:] == group[:-1]
    prev = np.where(same_prev, np.roll(rel, 1), -np.inf)
    nxt = np.where(np.roll(same_prev, -1), np.roll(rel, -1), -np.inf)  # same_prev[0] is False: no wrap
    near, inner = np.maximum(prev, nxt), np.minimum(prev, nxt)
    return (rel + weight * np.where(np.isfinite(near), near, 0.0)
            + between * np.where(np.isfinite(inner), inner, 0.0))


def mmr_fill(emb: np.ndarray, rel: np.ndarray, cost: np.ndarray, budget: int, chosen: np.ndarray) -> np.ndarray:
    """Greedy MMR under a token budget, starting from `chosen`; returns all chosen indices."""
    n = emb.shape[0]
    taken = np.zeros(n, dtype=bool)
    taken[chosen] = True
    left = budget - int(cost[chosen].sum())
    max_sim = (emb @ emb[chosen].T).max(axis=1) if chosen.size else np.zeros(n, dtype=np.float32)
    open_ = ~taken & (cost <= left)
    while left > 0 and open_.any():
        score = np.where(open_, MMR_LAMBDA * rel - (1.0 - MMR_LAMBDA) * max_sim, -np.inf)
        i = int(score.argmax())
        taken[i] = True
        left -= int(cost[i])
        np.maximum(max_sim, emb @ emb[i], out=max_sim)
        open_ &= ~taken & (cost <= left)
    return np.flatnonzero(taken)


def fit_representatives(reps: np.ndarray, cost: np.ndarray, budget: int) -> np.ndarray:
    """The representatives, in priority order, that fit together in the budget."""
    fits = np.cumsum(cost[reps]) <= budget
    return reps[fits]
