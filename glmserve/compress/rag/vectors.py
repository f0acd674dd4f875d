"""One vector per stored record or query, from the compressor's sentence encoder (glmserve/embed.py):
the L2-normalized mean of the embeddings of the text's sentences (glmserve/compress/segment.py), so that a
record longer than the encoder's window is still seen whole. Summaries and chunks go through the same
function, so the comparison of the two indexes is one of what is stored, not of the embedder."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from glmserve.compress.segment import segment
from glmserve.embed import embed

DIM = 512


def passage_vectors(texts: Sequence[str]) -> np.ndarray:
    """(len(texts), DIM) float32, rows L2-normalized (a blank text gives a zero row)."""
    pieces: list[str] = []
    owner: list[int] = []
    for i, t in enumerate(texts):
        units = [u.text for u in segment("", t)] or ([t] if t.strip() else [])
        pieces += units
        owner += [i] * len(units)
    out = np.zeros((len(texts), DIM), dtype=np.float32)
    if pieces:
        np.add.at(out, np.asarray(owner), embed(pieces))
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return np.divide(out, norms, out=out, where=norms > 0)
