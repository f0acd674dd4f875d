"""`compress()`: documents in, "anchors + compressed narrative" out, with the trace map.

Each document is routed (code: off, kept whole), segmented, and its anchors detected; structural anchors
are always kept, narrative units are chosen to the budget (glmserve/compress/select.py) and everything
kept is emitted verbatim in source order, so each span's text is `documents[doc][start:end]`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from glmserve.compress import anchors as anchor_rules
from glmserve.compress import select
from glmserve.compress.bm25 import bm25_scores
from glmserve.compress.policy import preset_tokens, route
from glmserve.compress.segment import Unit, segment
from glmserve.compress.tokens import TokenCounter, default_counter
from glmserve.embed import embed
from glmserve.errors import InvalidRequestError

DEFAULT_RATIO = 3.4
GAP = " … "  # between kept sentences of one paragraph that were not adjacent


@dataclass(frozen=True)
class Document:
    id: str
    text: str


@dataclass(frozen=True)
class Span:
    """One kept piece: `documents[doc].text[start:end]`, cited by section, paragraph and page."""

    doc: str
    start: int
    end: int
    section: str
    paragraph: int
    page: int
    kind: str  # "anchor" (structural, always kept) or "narrative"
    anchors: tuple[str, ...] = ()  # the anchor kinds found in it (heading, clause, definition, date, ...)


@dataclass(frozen=True)
class DocumentReport:
    id: str
    mode: str  # "on" or "off" (code, kept whole)
    reason: str
    original_tokens: int


@dataclass
class CompressionResult:
    text: str
    original_tokens: int
    compressed_tokens: int
    spans: list[Span]
    documents: list[DocumentReport] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.original_tokens / max(self.compressed_tokens, 1)

    def to_dict(self) -> dict:
        return {"text": self.text, "original_tokens": self.original_tokens,
                "compressed_tokens": self.compressed_tokens, "ratio": round(self.ratio, 3),
                "spans": [asdict(s) | {"anchors": list(s.anchors)} for s in self.spans],
                "documents": [asdict(d) for d in self.documents]}


def _target(original: int, ratio: float | None, target_tokens: int | None, preset: str | None) -> int:
    given = [x is not None for x in (ratio, target_tokens, preset)]
    if sum(given) > 1:
        raise InvalidRequestError("give at most one of target_ratio, target_tokens and preset")
    if target_tokens is not None:
        if target_tokens < 1:
            raise InvalidRequestError(f"target_tokens must be >= 1, got {target_tokens}")
        return int(target_tokens)
    if preset is not None:
        return preset_tokens(preset)
    ratio = DEFAULT_RATIO if ratio is None else ratio
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio >= 1.0):
        raise InvalidRequestError(f"target_ratio must be a number >= 1, got {ratio!r}")
    return max(1, math.ceil(original / ratio))


def _assemble(docs: Sequence[Document], kept: list[list[Unit]], off: set[str]) -> str:
    """Kept units verbatim in source order; documents headed by their id when there are several."""
    parts = []
    for doc, units in zip(docs, kept):
        if doc.id in off:
            body = doc.text
        else:
            pieces: list[str] = []
            prev: Unit | None = None
            for u in units:
                if prev is not None:
                    between = doc.text[prev.end:u.start]
                    adjacent = between.strip() == ""
                    if u.paragraph == prev.paragraph:
                        pieces.append(("\n" if "\n" in between else " ") if adjacent else GAP)
                    else:
                        pieces.append("\n\n" if u.paragraph == prev.paragraph + 1 and adjacent else "\n\n…\n\n")
                pieces.append(u.text)
                prev = u
            body = "".join(pieces)
        if not body:
            continue
        parts.append(f"[{doc.id}]\n{body}" if len(docs) > 1 else body)
    return "\n\n".join(parts)


def compress(documents: Sequence[Document], query: str | None = None, ratio: float | None = None,
             target_tokens: int | None = None, preset: str | None = None,
             count_tokens: TokenCounter | None = None) -> CompressionResult:
    """Compresses the documents together to the budget; see the module docstring."""
    if not documents:
        raise InvalidRequestError("documents must hold at least one document")
    ids = [d.id for d in documents]
    if len(set(ids)) != len(ids):
        raise InvalidRequestError("document ids must be unique")
    count = count_tokens or default_counter()
    doc_tokens = count([d.text for d in documents])
    original = int(doc_tokens.sum())
    target = _target(original, ratio, target_tokens, preset)

    reports, off = [], set()
    units: list[Unit] = []
    kinds: list[frozenset[str]] = []
    for doc, n_tok in zip(documents, doc_tokens):
        r = route(doc.text)
        reports.append(DocumentReport(doc.id, r.mode, r.reason, int(n_tok)))
        if r.mode == "off":
            off.add(doc.id)
            continue
        du = segment(doc.id, doc.text)
        units.extend(du)
        kinds.extend(anchor_rules.detect(du, doc.text))

    n = len(units)
    cost = count([u.text for u in units]) + 1  # + the separator
    structural = np.fromiter((anchor_rules.is_structural(k) for k in kinds), dtype=bool, count=n)
    off_tokens = int(sum(r.original_tokens for r in reports if r.mode == "off"))
    keep = structural.copy()
    priority = np.zeros(n)  # of kept narrative units: the trimming below drops the lowest first
    budget = target - off_tokens - int(cost[structural].sum())
    if original <= target:
        keep[:] = True
    elif budget > 0 and (~structural).any():
        picked, priority[picked] = _choose(units, kinds, structural, cost, budget, query)
        keep[picked] = True

    text, kept_units = _emit(documents, units, keep, off)
    compressed = int(count([text])[0]) if text else 0
    # separators may add a little: drop the least relevant narrative units until the text fits
    while compressed > target and (keep & ~structural).any():
        narrative = np.flatnonzero(keep & ~structural)
        narrative = narrative[np.argsort(priority[narrative], kind="stable")]
        drop = narrative[: int(np.searchsorted(np.cumsum(cost[narrative]), compressed - target)) + 1]
        keep[drop] = False
        text, kept_units = _emit(documents, units, keep, off)
        compressed = int(count([text])[0]) if text else 0

    spans = [Span(d.id, 0, len(d.text), "", 0, 1, "narrative") for d in documents if d.id in off]
    spans += [Span(u.doc, u.start, u.end, u.section, u.paragraph, u.page,
                   "anchor" if structural[i] else "narrative", tuple(sorted(kinds[i])))
              for i, u in kept_units]
    order = {d: i for i, d in enumerate(ids)}
    spans.sort(key=lambda s: (order[s.doc], s.start))
    return CompressionResult(text, original, compressed, spans, reports)


def _emit(documents: Sequence[Document], units: list[Unit], keep: np.ndarray,
          off: set[str]) -> tuple[str, list[tuple[int, Unit]]]:
    kept = [(i, units[i]) for i in np.flatnonzero(keep)]
    by_doc: dict[str, list[Unit]] = {d.id: [] for d in documents}
    for _, u in kept:
        by_doc[u.doc].append(u)
    return _assemble(documents, [by_doc[d.id] for d in documents], off), kept


def _choose(units: list[Unit], kinds: list[frozenset[str]], structural: np.ndarray, cost: np.ndarray,
            budget: int, query: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Indices (into units) of the narrative units to keep, and their relevance."""
    cand = np.flatnonzero(~structural)
    texts = [units[i].text for i in cand]
    emb = embed(texts)
    facts = np.fromiter((len(kinds[i] & set(anchor_rules.FACTS)) > 0 for i in cand), dtype=np.float64,
                        count=cand.size)
    if query and query.strip():
        q_emb = embed([query])[0]
        rel = select.relevance(emb, bm25_scores(texts, query), q_emb, facts)
        rel = select.with_neighbours(rel, _sections(units, cand))
        chosen = np.zeros(0, dtype=np.int64)
    else:
        rel = select.relevance(emb, None, None, facts)
        k = max(1, int(budget / max(float(cost[cand].mean()), 1.0)) // 2)
        reps = select.kmeans_representatives(emb, k)
        chosen = select.fit_representatives(reps, cost[cand], budget)
    picked = select.mmr_fill(emb, rel, cost[cand], budget, chosen)
    return cand[picked], rel[picked]



def _sections(units: list[Unit], cand: np.ndarray) -> np.ndarray:
    """A group id per candidate: one per (document, section)."""
    ids: dict[tuple[str, str], int] = {}
    return np.fromiter((ids.setdefault((units[i].doc, units[i].section), len(ids)) for i in cand), dtype=np.int64,
                       count=cand.size)
