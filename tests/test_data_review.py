"""`glmserve data review export | import`: a stable sample per stage of a clean run, labels read back from CSV
and JSONL, agreement and the kept set's valid share with its Wilson interval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmserve.cli import main
from glmserve.data.records import read_records, write_records
from glmserve.data.review import wilson_interval


def _run_dir(tmp_path: Path, reverse: bool = False) -> Path:
    run = tmp_path / ("run-reversed" if reverse else "run")
    kept = [{"id": f"k{i}", "text": f"kept document {i}, with a comma"} for i in range(10)]
    rejected = [{"id": f"m{i}", "text": f"garbled {i}", "reason": "mojibake", "detail": "mojibake"} for i in range(6)]
    rejected += [{"id": f"g{i}", "text": f"short {i}", "reason": "length", "detail": "too_short"} for i in range(2)]
    write_records(run / "kept.jsonl", kept[::-1] if reverse else kept)
    write_records(run / "rejected.jsonl", rejected[::-1] if reverse else rejected)
    return run


def _export(run: Path, out: Path, per_stage: int, capsys) -> dict:
    main(["data", "review", "export", str(run), "--per-stage", str(per_stage), "--out", str(out)])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_wilson_interval_matches_the_textbook_values():
    low, high = wilson_interval(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    low, high = wilson_interval(10, 10)
    assert high == pytest.approx(1.0) and round(low, 4) == 0.7225
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_export_draws_n_per_stage_stably_whatever_the_file_order(tmp_path: Path, capsys):
    summary = _export(_run_dir(tmp_path), tmp_path / "a.csv", 4, capsys)
    assert summary["per_stage"] == {"kept": 4, "mojibake": 4, "length": 2}
    rows = list(read_records(tmp_path / "a.csv"))
    assert {r["stage"] for r in rows} == {"kept", "mojibake", "length"}
    assert all(r["label"] == "" for r in rows)
    assert all(r["decision"] == ("kept" if r["stage"] == "kept" else "rejected") for r in rows)
    assert {r["reason"] for r in rows if r["stage"] == "length"} == {"length"}
    assert any("," in r["text"] for r in rows)  # CSV quoting round-trips the text
    _export(_run_dir(tmp_path, reverse=True), tmp_path / "b.jsonl", 4, capsys)
    assert sorted(r["id"] for r in read_records(tmp_path / "b.jsonl")) == sorted(r["id"] for r in rows)
    main(["data", "review", "export", str(_run_dir(tmp_path)), "--per-stage", "4", "--out", str(tmp_path / "c.csv"),
          "--seed", "7"])
    assert sorted(r["id"] for r in read_records(tmp_path / "c.csv")) != sorted(r["id"] for r in rows)


def test_import_reports_agreement_and_the_kept_valid_share(tmp_path: Path, capsys):
    _export(_run_dir(tmp_path), tmp_path / "s.csv", 10, capsys)
    rows = list(read_records(tmp_path / "s.csv"))
    kept = [r for r in rows if r["stage"] == "kept"]
    for i, r in enumerate(kept):  # people: 8 of the 10 kept records are valid
        r["label"] = "valid" if i < 8 else "invalid"
    moj = [r for r in rows if r["stage"] == "mojibake"]
    for i, r in enumerate(moj):  # 5 of 6 mojibake rejections right, one wrong; the length ones left unlabeled
        r["label"] = "no" if i < 5 else "yes"
    write_records(tmp_path / "labeled.csv", rows)
    main(["data", "review", "import", str(tmp_path / "labeled.csv"), "--report", str(tmp_path / "rep")])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    report = json.loads((tmp_path / "rep" / "review.json").read_text())
    assert printed == report
    assert report["labeled"] == 16 and report["unlabeled"] == 2
    assert report["agreement"] == round(13 / 16, 4)
    assert report["kept_valid_share"] == {"labeled": 10, "valid": 8, "share": 0.8, "ci95": [0.4902, 0.9433]}
    assert report["stages"]["mojibake"]["valid"] == 1
    assert "length" not in report["stages"]


@pytest.mark.parametrize("rows,message", [
    ([{"id": "a", "text": "t", "stage": "kept", "decision": "kept", "label": "maybe"}], "label 'maybe' is not one of"),
    ([{"id": "a", "text": "t", "stage": "kept", "decision": "kept", "label": ""}], "no record has a label yet"),
    ([{"id": "a", "text": "t", "label": "valid"}], "has no 'stage' column"),
])
def test_import_bad_labels_are_clear_errors(tmp_path: Path, capsys, rows: list, message: str):
    write_records(tmp_path / "s.jsonl", rows)
    with pytest.raises(SystemExit):
        main(["data", "review", "import", str(tmp_path / "s.jsonl"), "--report", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_export_needs_a_clean_run_dir(tmp_path: Path, capsys):
    with pytest.raises(SystemExit):
        main(["data", "review", "export", str(tmp_path), "--per-stage", "3", "--out", str(tmp_path / "s.csv")])
    assert "holds no kept.jsonl" in capsys.readouterr().err
