"""The labeled corpus generators of the data benchmark (small pieces; the full corpus is built by
bench/bench_data.py)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("datatrove")

from stdnum import luhn  # noqa: E402

from glmserve.data.corpus import NOISE_KINDS, _card, _near_dup, _noise, _ric, jaccard  # noqa: E402
from glmserve.data.pii import is_resident_id  # noqa: E402

_VOCAB = [a + b for a in ("al", "be", "co", "de", "ep", "fo", "gu", "hi", "io", "ju")
          for b in ("ra", "se", "ti", "vo", "mu", "ne", "pa", "lo", "ki", "zu")]
_RNG = random.Random(7)
TEXT = " ".join(_RNG.choice(_VOCAB) for _ in range(800))


def test_near_duplicates_carry_their_exact_jaccard():
    rng = random.Random(0)
    for target in (0.8, 0.9):
        text, j = _near_dup(rng, TEXT, target)
        assert j == pytest.approx(jaccard(TEXT, text))
        assert abs(j - target) < 0.08


def test_every_noise_kind_is_generated_and_labeled():
    rng = random.Random(1)
    valid = [{"id": "v0", "text": TEXT, "source": "t"}]
    foreign = {"de": [f"Dies ist der deutsche Satz Nummer {i} mit genug Wörtern darin." for i in range(30)]}
    for kind in NOISE_KINDS:
        rec = _noise(kind, rng, valid, foreign)
        assert rec["valid"] is False and rec["kind"] == kind and rec["text"].strip()
    assert _noise("exact_dup", rng, valid, foreign)["text"] == TEXT


def test_planted_ids_and_cards_are_valid_and_lookalikes_are_not():
    rng = random.Random(2)
    for _ in range(50):
        assert is_resident_id(_ric(rng)) and not is_resident_id(_ric(rng, valid=False))
        assert luhn.is_valid(_card(rng)) and not luhn.is_valid(_card(rng, valid=False))
