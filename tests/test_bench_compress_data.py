"""bench/bench_compress.py's larger license set: distractors from other license families, the gold at each position."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_compress import POSITIONS, with_gold_at  # noqa: E402
from compress_data import license_distractors, license_family  # noqa: E402

from glmserve.compress import Document  # noqa: E402

POOL = ("GPL-1", "GPL-2", "GPL-3", "LGPL-2.1", "LGPL-3", "MPL-2.0", "Apache-2.0", "BSD")


def test_license_family_drops_the_version() -> None:
    assert [license_family(n) for n in ("GPL-2", "LGPL-2.1", "Apache-2.0", "BSD")] == ["GPL", "LGPL", "Apache", "BSD"]


def test_distractors_come_from_other_families_and_are_seeded() -> None:
    got = license_distractors("GPL-2", POOL, 4, seed=17)
    assert len(set(got)) == 4 and not {"GPL-1", "GPL-2", "GPL-3"} & set(got)
    assert got == license_distractors("GPL-2", POOL, 4, seed=17)
    assert any(license_distractors("GPL-2", POOL, 4, seed=s) != got for s in range(5))


def test_distractors_refuse_a_pool_too_small() -> None:
    with pytest.raises(ValueError, match="other families"):
        license_distractors("GPL-2", ("GPL-1", "GPL-3", "BSD"), 2, seed=0)


def test_gold_goes_to_each_named_position() -> None:
    others = [Document(f"d{i}", "x") for i in range(4)]
    gold = Document("gold", "y")
    for where, at in POSITIONS.items():
        docs = with_gold_at(gold, others, where)
        assert docs.index(gold) == at and [d for d in docs if d is not gold] == others
    with pytest.raises(SystemExit, match="unknown gold position"):
        with_gold_at(gold, others, "top")
