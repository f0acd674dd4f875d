"""`glmserve data clean --executor ray`: the same kept and rejected records and report counts as the local
executor on a small benchmark corpus, on a real local Ray instance, and a rerun that skips every finished task."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("datatrove")

from glmserve.data.clean import clean  # noqa: E402
from glmserve.data.corpus import build_corpus  # noqa: E402
from glmserve.data.records import read_records, write_records  # noqa: E402
from glmserve.errors import InvalidRequestError  # noqa: E402

STAGES = ("filters", "minhash_signatures", "minhash_buckets", "minhash_clusters", "minhash_filter")


def _corpus(path: Path) -> Path:
    # valid documents, near and exact duplicates and every noise kind: rule filters and MinHash both remove some
    write_records(path, build_corpus(seed=0, max_valid=20)[:40])
    return path


def test_unknown_executor_and_address_without_ray_are_refused(tmp_path: Path):
    src = tmp_path / "in.jsonl"
    write_records(src, [{"id": "a", "text": "One short record."}])
    with pytest.raises(InvalidRequestError, match="executor must be one of"):
        clean(src, tmp_path / "out", progress=False, executor="spark")
    with pytest.raises(InvalidRequestError, match="--ray-address needs --executor ray"):
        clean(src, tmp_path / "out", progress=False, ray_address="127.0.0.1:6379")


def _ids(out: Path, name: str) -> list[tuple[str, str]]:
    return [(r["id"], r.get("reason", "")) for r in read_records(out / name)]


def _task_logs(out: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in (out / "work" / "logs").glob("*/logs/task_*.log")}


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_ray_executor_matches_local_and_resumes(tmp_path: Path):
    ray = pytest.importorskip("ray")
    src = _corpus(tmp_path / "in.jsonl")
    local = clean(src, tmp_path / "local", progress=False)
    # a short temp dir: Ray's unix sockets live under it and their paths are limited to 107 characters
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, _temp_dir=ray_tmp,
             log_to_driver=False)
    try:
        remote = clean(src, tmp_path / "ray", progress=False, executor="ray")
        logs = _task_logs(tmp_path / "ray")
        assert {Path(p).parts[-3] for p in logs} == set(STAGES)
        again = clean(src, tmp_path / "ray", progress=False, executor="ray")
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    for name in ("kept.jsonl", "rejected.jsonl"):
        assert _ids(tmp_path / "ray", name) == _ids(tmp_path / "local", name)
    assert [r["reason"] for r in read_records(tmp_path / "ray" / "rejected.jsonl")].count("minhash") > 0
    assert remote["records_in"] == local["records_in"] == 40
    assert remote["records_out"] == local["records_out"] < 40
    assert remote["steps"] == local["steps"] == again["steps"]
    # the rerun found every stage's tasks completed: no task ran (and rewrote its log) again
    assert _task_logs(tmp_path / "ray") == logs
