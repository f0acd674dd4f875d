"""The interaction log's writer (glmserve/server/interaction_log.py): rotation by size and by UTC day, files
only the owner reads, and a failing directory that drops and counts lines (logged once) instead of raising."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from glmserve.server.interaction_log import InteractionLog

DAY = 24 * 3600


def _lines(directory: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(directory.glob("interactions-*.jsonl"))
            for line in f.read_text().splitlines()]


def _wait(registry: CollectorRegistry, name: str, value: float) -> None:
    deadline = time.monotonic() + 10
    while (registry.get_sample_value(name) or 0) < value:
        assert time.monotonic() < deadline, f"{name} stayed below {value}"
        time.sleep(0.01)


def test_rotates_by_size_and_day_and_keeps_order(tmp_path: Path) -> None:
    log = InteractionLog(tmp_path / "logs", max_bytes=1024)
    now = 1_800_000_000.0  # 2027-01-15 UTC
    for i in range(12):
        log.submit({"type": "interaction", "id": f"r{i}", "pad": "x" * 200, "time": now})
    log.submit({"type": "interaction", "id": "next-day", "time": now + DAY})
    log.close()
    files = sorted((tmp_path / "logs").glob("*.jsonl"))
    names = [f.name for f in files]
    assert names[0] == "interactions-20270115-001.jsonl" and names[-1] == "interactions-20270116-001.jsonl"
    assert len(names) >= 4  # 12 lines of ~250 bytes in files of at most 1 KiB, then a new day
    assert all(f.stat().st_size <= 1024 for f in files)
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    assert [r["id"] for r in _lines(tmp_path / "logs")] == [f"r{i}" for i in range(12)] + ["next-day"]


def test_restart_starts_a_new_file(tmp_path: Path) -> None:
    for run in range(2):
        log = InteractionLog(tmp_path, max_bytes=4096)
        log.submit({"type": "interaction", "id": f"run{run}", "time": 1_800_000_000.0})
        log.close()
    assert [f.name[-9:] for f in sorted(tmp_path.glob("*.jsonl"))] == ["001.jsonl", "002.jsonl"]
    assert [r["id"] for r in _lines(tmp_path)] == ["run0", "run1"]


def test_unwritable_directory_drops_counts_and_logs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    directory = tmp_path / "logs"
    log = InteractionLog(directory, registry=registry, max_bytes=1024)
    log.submit({"id": "before", "pad": "x" * 900})
    _wait(registry, "glmserve_interaction_log_records_total", 1)
    shutil.rmtree(directory)
    directory.write_text("a file where the directory was")  # every new file fails (as a full disk does)
    with caplog.at_level(logging.ERROR, logger="glmserve.server.interaction_log"):
        for i in range(3):
            log.submit({"id": f"lost{i}", "pad": "x" * 900})  # each needs a new file: > max_bytes together
        _wait(registry, "glmserve_interaction_log_errors_total", 3)
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    directory.unlink()  # the disk is back: the next line opens a new file
    log.submit({"id": "after"})
    log.close()
    assert registry.get_sample_value("glmserve_interaction_log_records_total") == 2
    assert [r["id"] for r in _lines(directory)] == ["after"]


def test_bad_max_bytes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max bytes"):
        InteractionLog(tmp_path, max_bytes=10)
