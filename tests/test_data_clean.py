"""`glmserve data clean` end to end on datatrove's local executor: output contracts, reasons, resume, Parquet,
bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datatrove")

from glmserve.cli import main  # noqa: E402
from glmserve.data.records import read_records, write_records  # noqa: E402

DOCS = [
    "The scheduler keeps a queue of waiting requests and admits them while the token budget allows. Each step "
    "it runs the decodes first, then the chunked prefills that still fit in the budget. When the cache runs out "
    "of blocks, the youngest sequence is preempted and its blocks are freed. A preempted sequence is recomputed "
    "later from its prompt and the tokens it already produced. This keeps the memory bounded while every "
    "request still finishes, and the order of arrival is respected for the ones that wait.",
    "Quantized weights are repacked once when the model is loaded, so that the kernels read them in the layout "
    "they expect. Embeddings and the output head stay in high precision by default, because their errors "
    "reach every token. A calibration pass measures how sensitive each layer is, and the most sensitive ones "
    "keep more bits. The checkpoint is then written in a format that other engines can read as well, which "
    "lets a team compare the same file across several servers. Nothing has to be converted again.",
    "A session keeps its key and value cache between the turns of a conversation. When the user comes back, "
    "the cache is read from disk in a background thread and verified chunk by chunk. One chunk is copied per "
    "engine step, so other requests keep decoding while the session is restored. Sessions that were not used "
    "for a day are dropped, and the least recently used ones go first when the store reaches its size cap. "
    "Replicas can share the store through a network database instead of the local disk.",
]


def _doc(i: int) -> str:
    return f"Note {i}.\n\n" + DOCS[i]


def _corpus() -> list[dict]:
    recs = [{"id": f"good{i}", "text": _doc(i), "valid": True} for i in range(3)]
    recs.append({"id": "dup", "text": _doc(0), "valid": False})
    recs.append({"id": "short", "text": "Home | About | Contact", "valid": False})
    recs.append({"id": "german", "text": "Der Planer hält eine Warteschlange der Anfragen und lässt sie zu, "
                 "solange das Budget reicht. " * 8, "valid": False})
    recs.append({"id": "log", "text": "\n".join(f"2024-01-0{i % 9 + 1} 12:00:0{i % 10} INFO worker-{i} ok id={i}"
                                                for i in range(40)), "valid": False})
    return recs


def test_clean_cli_writes_kept_rejected_report_and_resumes(tmp_path: Path, capsys):
    src = tmp_path / "in.parquet"
    write_records(src, _corpus())
    out = tmp_path / "out"
    main(["data", "clean", str(src), "--out", str(out), "--format", "parquet"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kept = list(read_records(out / "kept.jsonl"))
    rejected = list(read_records(out / "rejected.jsonl"))
    report = json.loads((out / "report.json").read_text())
    assert sorted(r["id"] for r in kept) == ["good0", "good1", "good2"]
    reasons = {r["id"]: r["reason"] for r in rejected}
    assert reasons["dup"] == "minhash" and reasons["german"] == "language"
    assert set(reasons) == {"dup", "short", "german", "log"}
    assert all(r["text"] for r in rejected) and kept[0]["text"].startswith("Note")
    assert report["records_in"] == 7 and report["records_out"] == 3 == summary["records_out"]
    steps = report["steps"]
    assert [s["step"] for s in steps][0] == "mojibake" and steps[-1]["step"] == "minhash"
    assert all(a["out"] == b["in"] for a, b in zip(steps, steps[1:]))
    assert report["estimated_valid_share"] == 1.0
    assert any(s["step"] == "c4_badwords" for s in report["skipped_steps"])
    assert [r["id"] for r in read_records(out / "kept.parquet")] == [r["id"] for r in kept]
    # a rerun finds every stage's tasks completed and leaves the same output
    done = sorted(p.name for p in (out / "work" / "logs").iterdir())
    assert "filters" in done and "minhash_buckets" in done
    marker = out / "work" / "filtered" / "00000.jsonl"
    mtime = marker.stat().st_mtime_ns
    main(["data", "clean", str(src), "--out", str(out)])
    assert marker.stat().st_mtime_ns == mtime
    assert [r["id"] for r in read_records(out / "kept.jsonl")] == [r["id"] for r in kept]


def test_clean_config_switches_steps_off(tmp_path: Path):
    src = tmp_path / "in.jsonl"
    write_records(src, _corpus())
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("minhash: false\nlanguages: [en, de]\n")
    main(["data", "clean", str(src), "--out", str(tmp_path / "out"), "--config", str(cfg)])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "minhash" not in [s["step"] for s in report["steps"]]
    kept = {r["id"] for r in read_records(tmp_path / "out" / "kept.jsonl")}
    assert "dup" in kept  # no dedup


@pytest.mark.parametrize("content,message", [
    ('{"id": 1, "text": "ok"}\nnot json\n', "in.jsonl:2: not valid JSON"),
    ('{"id": 1, "body": "no text"}\n', "a record must be a JSON object with a string 'text'"),
])
def test_clean_bad_input_is_a_clear_error(tmp_path: Path, capsys, content: str, message: str):
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["data", "clean", str(src), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_clean_unknown_config_key(tmp_path: Path, capsys):
    src = tmp_path / "in.jsonl"
    write_records(src, _corpus())
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"gopher": {}}')
    with pytest.raises(SystemExit):
        main(["data", "clean", str(src), "--out", str(tmp_path / "out"), "--config", str(cfg)])
    assert "unknown keys ['gopher']" in capsys.readouterr().err


@pytest.mark.slow
def test_minhash_pool_from_an_unguarded_main_finishes(tmp_path: Path):
    """The known trap: with datatrove's forkserver a pool's workers re-import an unguarded __main__ (here
    `python -c`) and the run hangs; our pool forks."""
    src = tmp_path / "in.jsonl"
    write_records(src, _corpus())
    code = (f"from glmserve.data.clean import clean; "
            f"print(clean({str(src)!r}, {str(tmp_path / 'out')!r}, progress=False, workers=2)['records_out'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "3"
