"""The human review sample of a `data clean` run: `export` draws N records per stage (the kept output, and each
step's rejections with their reason) for people to label in a JSONL or CSV file; `import_labels` reads their
`label` column back and reports how often the pipeline agreed with them and the estimated valid share of the
kept set with a Wilson confidence interval (Wilson 1927; Brown, Cai & DasGupta 2001 recommend it over the
normal interval for small samples and shares near 1)."""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from glmserve.data.records import read_records, write_records
from glmserve.errors import InvalidRequestError

LABELS = {"valid": True, "yes": True, "y": True, "1": True, "true": True, "keep": True, "good": True,
          "invalid": False, "no": False, "n": False, "0": False, "false": False, "reject": False, "bad": False}
COLUMNS = ("id", "stage", "decision", "reason", "detail", "label", "text")


def _sample_key(seed: int, record_id: Any) -> str:
    return hashlib.sha256(f"{seed}:{record_id}".encode()).hexdigest()


def _stable_sample(records: list[dict], n: int, seed: int) -> list[dict]:
    """n records chosen by a hash of (seed, id): the same records however the file is ordered or rerun."""
    return sorted(records, key=lambda r: _sample_key(seed, r.get("id")))[:n]


def export_sample(run_dir: str | Path, per_stage: int, out: str | Path, seed: int = 0) -> dict[str, int]:
    """Writes `out` (.jsonl or .csv) with up to `per_stage` kept records and as many rejected ones per step
    of the run in `run_dir` (kept.jsonl, rejected.jsonl); `label` is left empty. Returns records per stage."""
    run = Path(run_dir)
    if per_stage < 1:
        raise InvalidRequestError(f"--per-stage must be at least 1, not {per_stage}")
    if Path(out).suffix not in (".jsonl", ".csv"):
        raise InvalidRequestError(f"the review sample is written as .jsonl or .csv, not {Path(out).name!r}")
    for name in ("kept.jsonl", "rejected.jsonl"):
        if not (run / name).is_file():
            raise InvalidRequestError(f"{run} holds no {name}: export from the --out DIR of `glmserve data clean`")
    stages: dict[str, list[dict]] = {"kept": list(read_records(run / "kept.jsonl"))}
    for rec in read_records(run / "rejected.jsonl"):
        stages.setdefault(rec.get("reason") or "unknown", []).append(rec)
    rows = []
    for stage, recs in stages.items():
        for rec in _stable_sample(recs, per_stage, seed):
            rejected = stage != "kept"
            rows.append({"id": rec.get("id"), "stage": stage, "decision": "rejected" if rejected else "kept",
                         "reason": rec.get("reason", "") if rejected else "",
                         "detail": rec.get("detail", "") if rejected else "", "label": "", "text": rec["text"]})
    write_records(out, rows)
    return {stage: min(per_stage, len(recs)) for stage, recs in stages.items()}


def parse_label(value: Any, where: str) -> bool | None:
    """True (valid), False (invalid) or None (not labeled yet)."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if not text:
        return None
    if text not in LABELS:
        raise InvalidRequestError(f"{where}: label {value!r} is not one of {sorted(LABELS)} (or empty)")
    return LABELS[text]


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial share (95% for z = 1.96)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def _share(k: int, n: int) -> dict[str, Any]:
    low, high = wilson_interval(k, n)
    return {"labeled": n, "valid": k, "share": round(k / n, 4) if n else None,
            "ci95": [round(low, 4), round(high, 4)]}


def import_labels(sample: str | Path, report_dir: str | Path) -> dict[str, Any]:
    """Reads the labeled sample; writes and returns `review.json` in `report_dir`: agreement of the pipeline's
    decisions with the labels (kept = valid, rejected = invalid), per stage the share labeled valid, and the
    estimated valid share of the kept set with its 95% Wilson interval."""
    by_stage: dict[str, list[bool]] = defaultdict(list)
    unlabeled = 0
    for n, rec in enumerate(read_records(sample), 1):
        for column in ("stage", "decision"):
            if column not in rec:
                raise InvalidRequestError(f"{sample}: record {n} has no {column!r} column (export the sample with "
                                          "`glmserve data review export`)")
        label = parse_label(rec.get("label"), f"{sample}: record {n}")
        if label is None:
            unlabeled += 1
        else:
            by_stage[rec["stage"] if rec["decision"] == "rejected" else "kept"].append(label)
    labeled = sum(len(v) for v in by_stage.values())
    if not labeled:
        raise InvalidRequestError(f"{sample}: no record has a label yet (fill the 'label' column: valid or invalid)")
    agree = sum(sum(v) if stage == "kept" else len(v) - sum(v) for stage, v in by_stage.items())
    kept = by_stage.get("kept", [])
    report = {
        "sample": str(sample), "labeled": labeled, "unlabeled": unlabeled,
        "agreement": round(agree / labeled, 4),
        "kept_valid_share": _share(sum(kept), len(kept)),
        "stages": {stage: _share(sum(v), len(v)) for stage, v in sorted(by_stage.items())},
    }
    write_records(Path(report_dir) / "review.json", report)
    return report
