"""`glmserve data feedback DIR --out OUT`: served interactions (`serve --log-interactions DIR`,
glmserve/server/interactions.py) back into training data: graded, de-identified, deduplicated, capped.

Every choice of every logged request is a candidate. Hard rejects first: an empty answer, a prompt sent as
token ids, a conversation with tool calls (their arguments are not scrubbed), a thumbs-down (`rating` -1).
The rest get a confidence score (RULE below) and a tier: high >= 0.8, medium >= 0.6, low below; tiers under
`min_tier` (default medium) are rejected as `low_confidence`. Survivors have every message and the answer
scrubbed of PII (glmserve/data/pii.py), then are dropped when they repeat the training set or a better
candidate (exact or MinHash near duplicate of the text scrubbed or not, system turns left out,
glmserve/data/near_dup.py), best score first. Last, the
self-generated share is capped: at most `max_self_share` of training set + kept records come from the logs
(lowest scores dropped first, `self_share_cap`); without --train-set there is nothing to cap against, which the
report says. OUT/kept.jsonl holds chat records (`messages`) or prompt/completion records, each with `id`, tier,
confidence, signals and provenance (log file, line, response id, choice, time, model, the feedback lines used);
OUT/rejected.jsonl the rejected ones without any text (`reason`, provenance); OUT/report.json the counts per
tier and per reason. Request `user`, `metadata` and feedback comments never reach an output.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmserve.data.records import jsonl_lines, write_records
from glmserve.errors import InvalidRequestError

TIERS = (("high", 0.8), ("medium", 0.6), ("low", -math.inf))
RULE = ("score = 0.5; finish_reason stop +0.2, length -0.3; user rating (last one sent, -1/0/+1) x 0.3; "
        "-0.2 per later regeneration of the same conversation prefix (at most 2 counted); mean logprob m "
        "(when the request asked for logprobs) + clamp(0.1 x (m + 1), -0.2, +0.1); clamped to [0, 1]. "
        "Tiers: high >= 0.8, medium >= 0.6, low below. Always rejected: empty answer, token-id prompt, tool "
        "calls, rating -1.")
MAX_MALFORMED_LISTED = 20
TRAIN_ID = "train:"  # the near-dup index's ids of training records (feedback records' ids start "fb-")


@dataclass
class Logs:
    """What the log directory holds: interactions (with file and line), ratings per response id."""

    files: list[str] = field(default_factory=list)
    interactions: list[tuple[dict[str, Any], str, int]] = field(default_factory=list)
    ratings: dict[str, list[tuple[int, str, int]]] = field(default_factory=lambda: defaultdict(list))
    malformed: list[dict[str, Any]] = field(default_factory=list)


def _valid_interaction(rec: dict[str, Any]) -> bool:
    return (isinstance(rec.get("id"), str) and isinstance(rec.get("choices"), list)
            and all(isinstance(c, dict) and isinstance(c.get("text"), str) for c in rec["choices"])
            and (isinstance(rec.get("messages"), list) or isinstance(rec.get("prompt"), (str, list))))


def read_logs(directory: str | Path) -> Logs:
    """Every `*.jsonl` under `directory`, in name order (the writer's names sort by time). A line that is not
    an interaction or feedback record (a crash's last half line, say) is counted, not fatal."""
    root = Path(directory)
    if not root.is_dir():
        raise InvalidRequestError(f"interaction log directory {root} does not exist")
    logs = Logs()
    for path in sorted(root.rglob("*.jsonl")):
        name = str(path.relative_to(root))
        logs.files.append(name)
        for n, rec in jsonl_lines(path, errors="replace"):
            if isinstance(rec, json.JSONDecodeError):
                logs.malformed.append({"file": name, "line": n, "error": f"not JSON ({rec.msg})"})
                continue
            kind = rec.get("type") if isinstance(rec, dict) else None
            if kind == "interaction" and _valid_interaction(rec):
                logs.interactions.append((rec, name, n))
            elif kind == "feedback" and isinstance(rec.get("id"), str) and rec.get("rating") in (-1, 0, 1):
                logs.ratings[rec["id"]].append((rec["rating"], name, n))
            else:
                logs.malformed.append({"file": name, "line": n, "error": "not an interaction or feedback line"})
    return logs


def tier_of(score: float) -> str:
    return next(name for name, floor in TIERS if score >= floor)


def grade(finish_reason: str | None, rating: int | None, regenerated_after: int,
          mean_logprob: float | None) -> float:
    """The confidence score of one answer (RULE)."""
    score = 0.5 + {"stop": 0.2, "length": -0.3}.get(finish_reason or "", 0.0)
    if rating is not None:
        score += 0.3 * rating
    score -= 0.2 * min(regenerated_after, 2)
    if mean_logprob is not None:
        score += min(0.1, max(-0.2, 0.1 * (mean_logprob + 1.0)))
    return round(min(1.0, max(0.0, score)), 4)


def _regenerated_after(logs: Logs) -> dict[int, int]:
    """Per interaction (its index in logs.interactions): how many later requests asked the same prefix."""
    by_prefix: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for k, (rec, _, _) in enumerate(logs.interactions):
        if isinstance(rec.get("prefix_hash"), str):
            by_prefix[rec["prefix_hash"]].append((float(rec.get("time") or 0.0), k))
    later: dict[int, int] = {}
    for group in by_prefix.values():
        group.sort()
        for rank, (_, k) in enumerate(group):
            later[k] = len(group) - 1 - rank
    return later


@dataclass
class Candidate:
    key: str
    rec: dict[str, Any]
    choice: dict[str, Any]
    provenance: dict[str, Any]
    signals: dict[str, Any]
    score: float = 0.0
    tier: str = "low"
    reason: str | None = None
    detail: str | None = None


def candidates(logs: Logs) -> Iterator[Candidate]:
    """One candidate per logged choice, graded, with its hard reject reason if any."""
    later = _regenerated_after(logs)
    for k, (rec, name, line) in enumerate(logs.interactions):
        ratings = logs.ratings.get(rec["id"], [])
        rating = ratings[-1][0] if ratings else None
        for choice in rec["choices"]:
            prompt_index = rec.get("prompt_index")
            key = rec["id"] + (f"-p{prompt_index}" if prompt_index is not None else "") + f"-c{choice.get('index', 0)}"
            signals = {"finish_reason": choice.get("finish_reason"), "rating": rating,
                       "regenerated_after": later.get(k, 0), "regeneration": rec.get("regeneration"),
                       "mean_logprob": choice.get("mean_logprob")}
            provenance = {"source": "interaction_log", "file": name, "line": line, "response_id": rec["id"],
                          "prompt_index": prompt_index, "choice": choice.get("index", 0),
                          "endpoint": rec.get("endpoint"), "model": rec.get("model"),
                          "x_request_id": rec.get("x_request_id"), "prefix_hash": rec.get("prefix_hash"),
                          "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(rec.get("time") or 0))),
                          "feedback": [{"file": f, "line": n} for _, f, n in ratings]}
            c = Candidate(key, rec, choice, provenance, signals)
            c.score = grade(signals["finish_reason"], rating, signals["regenerated_after"], signals["mean_logprob"])
            c.tier = tier_of(c.score)
            messages = rec.get("messages")
            if not choice["text"].strip():
                c.reason = "empty_answer"
            elif messages is None and not isinstance(rec.get("prompt"), str):
                c.reason = "token_id_prompt"
            elif messages is not None and any(not isinstance(m, dict) or m.get("tool_calls") or m.get("role") == "tool"
                                              for m in messages):
                c.reason = "tool_calls"
            elif rating == -1:
                c.reason = "negative_feedback"
            yield c


def _dedup_text(rec: dict[str, Any]) -> str:
    """The text a record is compared by: `text`, or its messages' contents (system and developer turns left out:
    one deployment's instructions are in every conversation and would make them all near duplicates), or
    prompt and completion."""
    if isinstance(rec.get("text"), str):
        return rec["text"]
    if isinstance(rec.get("messages"), list):
        return "\n".join(str(m.get("content") or "") for m in rec["messages"]
                         if isinstance(m, dict) and m.get("role") not in ("system", "developer"))
    return f"{rec.get('prompt') or ''}\n{rec.get('completion') or ''}"


def _raw_text(c: Candidate) -> str:
    """The candidate's text before scrubbing (a training set that was never scrubbed matches this one)."""
    if c.rec.get("messages") is not None:
        return _dedup_text({"messages": [*c.rec["messages"], {"role": "assistant", "content": c.choice["text"]}]})
    return _dedup_text({"prompt": c.rec["prompt"], "completion": c.choice["text"]})


def _read_train_set(path: str | Path) -> Iterator[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise InvalidRequestError(f"training set {p} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(p).to_pylist()
        return
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(f"{p}:{n}: not valid JSON ({e.msg})") from e
                if not isinstance(rec, dict):
                    raise InvalidRequestError(f"{p}:{n}: a record must be a JSON object")
                yield rec


def _scrubbed(c: Candidate, pii: Counter) -> dict[str, Any]:
    """The output record of a kept candidate, every text scrubbed."""
    from glmserve.data.pii import scrub_text

    found: set[str] = set()

    def scrub(text: str) -> str:
        clean, findings = scrub_text(text)
        for f in findings:
            found.add(f["entity"])
            pii[f["entity"]] += 1
        return clean

    answer = scrub(c.choice["text"])
    if c.rec.get("messages") is not None:
        body: dict[str, Any] = {"messages": [{"role": m.get("role"), "content": scrub(str(m.get("content") or ""))}
                                             for m in c.rec["messages"]] + [{"role": "assistant", "content": answer}]}
    else:
        body = {"prompt": scrub(c.rec["prompt"]), "completion": answer}
    return {"id": f"fb-{c.key}", **body, "tier": c.tier, "confidence": c.score, "signals": c.signals,
            "pii": sorted(found), "provenance": c.provenance}


def feedback(log_dir: str | Path, out_dir: str | Path, train_sets: list[str] | None = None,
             max_self_share: float = 0.2, min_tier: str = "medium", progress: bool | None = None) -> dict[str, Any]:
    """Runs the loop on `log_dir`; writes OUT/kept.jsonl, OUT/rejected.jsonl, OUT/report.json; returns the report."""
    from tqdm import tqdm

    from glmserve.data.near_dup import NearDupIndex

    t0 = time.perf_counter()
    if not 0.0 < max_self_share <= 1.0:
        raise InvalidRequestError(f"max_self_share must be in (0, 1], not {max_self_share}")
    tier_names = [name for name, _ in TIERS]
    if min_tier not in tier_names:
        raise InvalidRequestError(f"min_tier must be one of {tier_names}, not {min_tier!r}")
    floor = dict(TIERS)[min_tier]
    logs = read_logs(log_dir)
    index = NearDupIndex()
    n_train = 0
    for path in train_sets or []:
        for k, rec in enumerate(_read_train_set(path)):
            index.add(_dedup_text(rec), f"{TRAIN_ID}{path}#{rec.get('id', k)}")
            n_train += 1
    all_candidates = list(candidates(logs))
    graded = sorted((c for c in all_candidates if c.reason is None), key=lambda c: (-c.score, c.provenance["time"]))
    for c in graded:
        if c.score < floor:
            c.reason = "low_confidence"
    survivors = [c for c in graded if c.reason is None]
    pii: Counter = Counter()
    show = sys.stderr.isatty() if progress is None else progress
    kept_records: list[tuple[Candidate, dict[str, Any]]] = []
    for c in tqdm(survivors, desc="feedback", unit="answer", disable=not show):
        record = _scrubbed(c, pii)
        text = _dedup_text(record)
        hit = index.match(text) or index.match(_raw_text(c))
        if hit is not None:
            how, other = hit
            from_train = other.startswith(TRAIN_ID)
            c.reason = ("duplicate_of_train" if how == "exact" else "near_duplicate_of_train") if from_train \
                else "duplicate_in_logs"
            c.detail = other
            continue
        index.add(text, record["id"])
        kept_records.append((c, record))
    cap: dict[str, Any] = {"max_share": max_self_share, "train_records": n_train if train_sets else None}
    if train_sets and max_self_share < 1.0:
        allowed = math.floor(max_self_share / (1.0 - max_self_share) * n_train + 1e-9)
        for c, _ in kept_records[allowed:]:
            c.reason = "self_share_cap"
        kept_records = kept_records[:allowed]
        cap |= {"applied": True, "allowed_records": allowed}
    else:
        cap |= {"applied": False, "why": "no --train-set given: nothing to cap the share against" if not train_sets
                else "max_self_share is 1"}
    kept = [record for _, record in kept_records]
    rejected = [{"id": f"fb-{c.key}", "reason": c.reason, "detail": c.detail, "tier": c.tier,
                 "confidence": c.score, "signals": c.signals, "provenance": c.provenance}
                for c in all_candidates if c.reason is not None]
    total = n_train + len(kept)
    report = {
        "log_dir": str(log_dir), "files": len(logs.files), "interactions": len(logs.interactions),
        "feedback_lines": sum(len(v) for v in logs.ratings.values()),
        "feedback_without_interaction": sorted(set(logs.ratings) - {r["id"] for r, _, _ in logs.interactions}),
        "malformed_lines": len(logs.malformed), "malformed": logs.malformed[:MAX_MALFORMED_LISTED],
        "candidates": len(all_candidates), "kept": len(kept),
        "tiers": dict(Counter(c.tier for c in all_candidates)),
        "kept_by_tier": dict(Counter(r["tier"] for r in kept)),
        "rejected_by_reason": dict(Counter(c.reason for c in all_candidates if c.reason is not None)),
        "pii_found": dict(pii), "train_records": n_train, "self_share": cap,
        "self_share_of_output": round(len(kept) / total, 4) if total else None,
        "min_tier": min_tier, "rule": RULE, "seconds": round(time.perf_counter() - t0, 3),
    }
    out = Path(out_dir)
    write_records(out / "kept.jsonl", kept)
    write_records(out / "rejected.jsonl", rejected)
    write_records(out / "report.json", report)
    return report
