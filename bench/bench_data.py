"""Cleaning, quality-model and PII benchmark on the labeled noisy corpus (glmserve/data/corpus.py), offline.

    PYTHONPATH=. .venv/bin/python bench/bench_data.py [--max-valid N] [--pii-per-type N] [--out results.json]

Two corpora from disjoint source halves: 'tune' (seed 0; the thresholds in glmserve/data/config.py were
adjusted looking at it) and 'heldout' (seed 1; never looked at while tuning). For each: valid share before and
after `glmserve data clean`, valid documents lost, per-step precision (share of its removals that were noise)
and recall (share of each noise type removed, and by which step), MinHash recall on planted duplicates of
Jaccard >= 0.8 that reached it, documents per second (one process: the local executor runs workers=1), valid
documents lost per language. The quality model (glmserve/data/quality_model.npz, trained on the tune split by
`glmserve data train-quality`): AUC on the held-out split's sources (all, English, Chinese) and the tune split's
out-of-fold AUC (5 folds by source). Then PII recall per planted type and false findings on look-alike hard
negatives.
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
from glmserve.data.corpus import VALID_KINDS, build_corpus, build_pii_corpus
from glmserve.data.pii import scrub_text
from glmserve.data.quality import auc, load_model, out_of_fold_scores, training_set
from glmserve.data.records import read_records, write_records


def eval_clean(corpus: list[dict], split: str, seed: int, work: Path, config: Path | None = None) -> dict:
    path = work / f"{split}.jsonl"
    write_records(path, corpus)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    out = work / f"out-{split}{'-' + config.stem if config else ''}"
    report = clean(path, out, config=config, progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    by_id = {r["id"]: r for r in corpus}
    rejected = list(read_records(out / "rejected.jsonl"))
    kept = list(read_records(out / "kept.jsonl"))
    n_valid = sum(r["valid"] for r in corpus)
    lost = [r for r in rejected if by_id[r["id"]]["valid"]]
    lost_lang = Counter(by_id[r["id"]].get("lang", "en") for r in lost)
    valid_lang = Counter(r.get("lang", "en") for r in corpus if r["valid"])
    per_step: dict[str, Counter] = defaultdict(Counter)
    for r in rejected:
        per_step[r["reason"]][by_id[r["id"]]["kind"]] += 1
    noise_total = Counter(r["kind"] for r in corpus if not r["valid"])
    removed_kind = Counter(by_id[r["id"]]["kind"] for r in rejected)
    steps = {}
    for step, kinds in per_step.items():
        removed = sum(kinds.values())
        noise = sum(v for k, v in kinds.items() if k not in VALID_KINDS)
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
        "valid_lost_by_language": {lang: round(lost_lang[lang] / n, 4) for lang, n in sorted(valid_lang.items())},
        "rescued_by_quality": report["rescued_by_quality"],
        "rescued_valid": sum(by_id[r["id"]]["valid"] for r in kept if "rescued" in r),
        "rescued_noise": sum(not by_id[r["id"]]["valid"] for r in kept if "rescued" in r),
        "valid_lost_by_step": dict(Counter(f"{r['reason']}:{by_id[r['id']]['kind']}" for r in lost).most_common()),
        "noise_recall_by_kind": {k: round(removed_kind[k] / n, 4) for k, n in sorted(noise_total.items())},
        "steps": steps,
        "minhash_recall_j08": round(mh_hits / len(dups), 4) if dups else None,
        "minhash_dups_reaching_it": len(dups),
        "seconds": round(wall, 2), "cpu_seconds": round(cpu, 2),
        "docs_per_s": round(len(corpus) / wall, 1), "docs_per_cpu_s": round(len(corpus) / cpu, 1),
        "report_steps": report["steps"],
    }


def eval_quality(tune: list[dict], heldout: list[dict]) -> dict:
    """AUC of the shipped model on held-out sources, and out-of-fold on tune (what its threshold was set on)."""
    rows, oof = out_of_fold_scores(tune)
    out = {"tune_out_of_fold_auc": round(auc(oof, training_set(rows)[1]), 4)}
    model = load_model()
    def chinese(r: dict) -> bool:
        return r.get("lang") == "zh" or r["kind"].startswith("zh_")

    for name, keep in (("all", lambda r: True), ("en", lambda r: not chinese(r)), ("zh", chinese)):
        texts, y = training_set([r for r in heldout if keep(r)])
        out[f"heldout_auc_{name}"] = round(auc(model.score(texts), y), 4)
        out[f"heldout_records_{name}"] = len(y)
    return out


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
        corpora = {split: build_corpus(seed=seed, split=split, max_valid=args.max_valid)
                   for split, seed in (("tune", 0), ("heldout", 1))}
        for split, seed in (("tune", 0), ("heldout", 1)):
            results[split] = eval_clean(corpora[split], split, seed, Path(tmp))
            print(json.dumps({k: v for k, v in results[split].items() if k != "report_steps"}, indent=1),
                  file=sys.stderr)
        # ablation: the rules alone, without the quality model's second opinion
        no_quality = Path(tmp) / "no_quality.json"
        no_quality.write_text(json.dumps({"quality": False}))
        for split, seed in (("tune", 0), ("heldout", 1)):
            full = eval_clean(corpora[split], split, seed, Path(tmp), config=no_quality)
            results[f"{split}_without_quality"] = {k: full[k] for k in (
                "valid_share_after", "valid_lost", "valid_lost_by_language", "valid_lost_by_step", "docs_per_cpu_s")}
    results["quality_model"] = eval_quality(corpora["tune"], corpora["heldout"])
    print(json.dumps(results["quality_model"]), file=sys.stderr)
    results["pii"] = eval_pii(args.pii_per_type)
    results["load_average_end"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    if args.out:
        write_records(args.out, results)


if __name__ == "__main__":
    main()
