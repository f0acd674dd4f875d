"""Exact and MinHash near-duplicate lookup against a set of documents held in memory (the training set that
served interactions must not repeat). Signatures come from datatrove's MinhashDedupSignature with the same
settings as `data clean`'s dedup (5-grams, 14 buckets x 8 hashes, DEFAULTS["minhash"]); two documents are near
duplicates when one whole bucket (band) of their signatures agrees, the LSH rule of datatrove's bucket stage
(Leskovec, Rajaraman, Ullman, "Mining of Massive Datasets", ch. 3.4)."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from glmserve.data.config import DEFAULTS
from glmserve.errors import InvalidRequestError


def minhash_config(settings: dict[str, Any]):
    """datatrove's MinhashConfig from our settings (sha1: datatrove 0.10 passes str to xxhash, which xxhash 4
    refuses)."""
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.hashing import HashConfig

    try:
        return MinhashConfig(**settings, hash_config=HashConfig(precision=64, hash_fc="sha1"))
    except TypeError as e:
        raise InvalidRequestError(f"config step 'minhash': {e}") from e


def exact_key(text: str) -> str:
    """Hash of the text lower-cased with whitespace collapsed."""
    return hashlib.sha1(re.sub(r"\s+", " ", text).strip().lower().encode("utf-8")).hexdigest()


class NearDupIndex:
    """Documents by exact key and by MinHash band; `match` says which indexed document a text repeats."""

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        from datatrove.pipeline.dedup.minhash import MinhashDedupSignature

        from glmserve.data.filters import WORDS

        # the output folder is never written: only get_shingles / get_signature are used
        self._sig = MinhashDedupSignature("unused", config=minhash_config(settings or DEFAULTS["minhash"]),
                                          language=WORDS)
        self._exact: dict[str, str] = {}
        self._bands: dict[tuple[int, tuple[int, ...]], str] = {}

    def __len__(self) -> int:
        return len(self._exact)

    def _bands_of(self, text: str) -> list[tuple[int, tuple[int, ...]]]:
        shingles = self._sig.get_shingles(text)
        if not len(shingles):  # fewer words than one n-gram: exact matching only
            return []
        return [(i, tuple(band)) for i, band in enumerate(self._sig.get_signature(shingles))]

    def match(self, text: str) -> tuple[str, str] | None:
        """("exact" | "near", id of the indexed document) or None."""
        found = self._exact.get(exact_key(text))
        if found is not None:
            return "exact", found
        for band in self._bands_of(text):
            if band in self._bands:
                return "near", self._bands[band]
        return None

    def add(self, text: str, doc_id: str) -> None:
        self._exact.setdefault(exact_key(text), doc_id)
        for band in self._bands_of(text):
            self._bands.setdefault(band, doc_id)
