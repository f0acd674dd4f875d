"""Cleaning and PII benchmark on the labeled noisy corpus (glmserve/data/corpus.py), offline.

    PYTHONPATH=. .venv/bin/python bench/bench_data.py [--max-valid N] [--pii-per-type N] [--out results.json]

Two corpora from disjoint source halves: 'tune' (seed 0; the thresholds in glmserve/data/config.py were
adjusted looking at it) and 'heldout' (seed 1; never looked at while tuning). For each: valid share before and
after `glmserve data clean`, valid documents lost, per-step precision (share of its removals that were noise)
and recall (share of each noise type removed, and by which step), MinHash recall on planted duplicates of
Jaccard >= 0.8 that reached it, documents per second (one process: the local executor runs workers=1).
Then PII recall per planted type and false findings on look-alike hard negatives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from glmserve.data.clean import clean
from glmserve.data.corpus import build_corpus, build_pii_corpus
from glmserve.data.pii import scrub_text
from glmserve.data.records import read_records, write_records


def eval_clean(split: str, seed: int, max_valid: int | None, work: Path) -> dict:
    corpus = build_corpus(seed=seed, split=split, max_valid=max_valid)
    path = work / f"{split}.jsonl"
    write_records(path, corpus)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    report = clean(path, work / f"out-{split}", progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    by_id = {r["id"]: r for r in corpus}
    rejected = list(read_records(work / f"out-{split}" / "rejected.jsonl"))
    kept = list(read_records(work / f"out-{split}" / "kept.jsonl"))
    n_valid = sum(r["valid"] for r in corpus)
    lost = [r for r in rejected if by_id[r["id"]]["valid"]]
    per_step: dict[str, Counter] = defaultdict(Counter)
    for r in rejected:
        per_step[r["reason"]][by_id[r["id"]]["kind"]] += 1
    noise_total = Counter(r["kind"] for r in corpus if not r["valid"])
    removed_kind = Counter(by_id[r["id"]]["kind"] for r in rejected)
    steps = {}
    for step, kinds in per_step.items():
        removed = sum(kinds.values())
        noise = sum(v for k, v in kinds.items() if not _valid_kind(k))
        steps[step] = {"removed": removed, "precision": round(noise / removed, 4) if removed else None,
                       "recall_of_all_noise": round(noise / sum(noise_total.values()), 4),
                       "by_kind": dict(kinds.most_common())}
    reached = {r["id"] for r in rejected if r["reason"] == "minhash"} | {r["id"] for r in kept}
    dups = [r for r in corpus if r["kind"] in ("exact_dup", "near_dup") and r["jaccard"] >= 0.8
            and r["id"] in reached]
    mh_hits = sum(1 for r in rejected if r["reason"] == "minhash" and by_id[r["id"]].get("jaccard", 0) >= 0.8)
    return {
        "split": split, "seed": seed, "records": len(corpus), "valid_in": n_valid,
        "valid_share_before": round(n_valid / len(corpus), 4),
        "valid_share_after": round(sum(by_id[r["id"]]["valid"] for r in kept) / max(1, len(kept)), 4),
        "valid_lost": round(len(lost) / n_valid, 4),
        "valid_lost_by_step": dict(Counter(f"{r['reason']}:{by_id[r['id']]['kind']}" for r in lost).most_common()),
        "noise_recall_by_kind": {k: round(removed_kind[k] / n, 4) for k, n in sorted(noise_total.items())},
        "steps": steps,
        "minhash_recall_j08": round(mh_hits / len(dups), 4) if dups else None,
        "minhash_dups_reaching_it": len(dups),
        "seconds": round(wall, 2), "cpu_seconds": round(cpu, 2),
        "docs_per_s": round(len(corpus) / wall, 1), "docs_per_cpu_s": round(len(corpus) / cpu, 1),
        "report_steps": report["steps"],
    }


def _valid_kind(kind: str) -> bool:
    return kind in ("document", "license", "clauses", "table")


def eval_pii(per_type: int) -> dict:
    corpus = build_pii_corpus(seed=2, per_type=per_type)
    found, total = Counter(), Counter()
    neg, false_findings, neg_docs_hit = 0, Counter(), 0
    t0 = time.perf_counter()
    for r in corpus:
        text, findings = scrub_text(r["text"])
        if r["planted"]:
            e = r["planted"]["entity"]
            total[e] += 1
            found[e] += r["planted"]["value"] not in text
        else:
            neg += 1
            neg_docs_hit += bool(findings)
            false_findings.update(f["entity"] for f in findings)
    wall = time.perf_counter() - t0
    return {"recall": {e: round(found[e] / total[e], 4) for e in sorted(total)}, "planted": dict(total),
            "hard_negatives": neg, "hard_negatives_with_a_finding": neg_docs_hit,
            "hard_negative_precision": round(1 - neg_docs_hit / neg, 4), "false_findings": dict(false_findings),
            "docs_per_s": round(len(corpus) / wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-valid", type=int, default=None, help="cap on plain valid documents per split")
    ap.add_argument("--pii-per-type", type=int, default=200)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    results = {"load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for split, seed in (("tune", 0), ("heldout", 1)):
            results[split] = eval_clean(split, seed, args.max_valid, Path(tmp))
            print(json.dumps({k: v for k, v in results[split].items() if k != "report_steps"}, indent=1),
                  file=sys.stderr)
    results["pii"] = eval_pii(args.pii_per_type)
    results["load_average_end"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    if args.out:
        write_records(args.out, results)


if __name__ == "__main__":
    main()
