"""`glmserve data clean | scrub`: the command-line side of the data pipeline (glmserve/cli.py delegates here)."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_clean(args: argparse.Namespace) -> None:
    from glmserve.data.clean import clean

    report = clean(args.input, args.out, config=args.config, output_format=args.format, workers=args.workers,
                   executor=args.executor, ray_address=args.ray_address)
    summary = {k: report[k] for k in ("records_in", "records_out", "estimated_valid_share")}
    summary["removed"] = {s["step"]: s["removed"] for s in report["steps"]}
    print(json.dumps(summary, ensure_ascii=False))


def _cmd_scrub(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from glmserve.data.pii import scrub_records
    from glmserve.data.records import count_records, read_records, write_records

    total = count_records(args.input)
    records = tqdm(read_records(args.input), total=total, desc="scrub", unit="doc", disable=not sys.stderr.isatty())
    write_records(args.out, scrub_records(records, keep_spans=args.spans))
    print(json.dumps({"records": total, "out": args.out}))


def _cmd_augment(args: argparse.Namespace) -> None:
    from glmserve.data.augment import augment

    print(json.dumps(augment(args.input, args.out, kind=args.kind, lang=args.lang), ensure_ascii=False))


def _cmd_feedback(args: argparse.Namespace) -> None:
    from glmserve.data.feedback import feedback

    report = feedback(args.log_dir, args.out, train_sets=args.train_set, max_self_share=args.max_self_share,
                      min_tier=args.min_tier)
    print(json.dumps({k: report[k] for k in ("interactions", "candidates", "kept", "tiers", "rejected_by_reason",
                                             "self_share")}, ensure_ascii=False))


def _cmd_train_quality(args: argparse.Namespace) -> None:
    from glmserve.data.corpus import build_corpus
    from glmserve.data.quality import auc, train, training_set
    from glmserve.data.records import read_records

    train_recs = list(read_records(args.train)) if args.train else build_corpus(seed=0, split="tune")
    heldout = list(read_records(args.heldout)) if args.heldout else build_corpus(seed=1, split="heldout")
    model = train(train_recs)
    model.save(args.out)
    texts, y = training_set(heldout)
    print(json.dumps({"out": args.out, "trained_on": len(training_set(train_recs)[1]), "heldout": len(y),
                      "heldout_auc": round(auc(model.score(texts), y), 4)}))


def _cmd_review_export(args: argparse.Namespace) -> None:
    from glmserve.data.review import export_sample

    counts = export_sample(args.run_dir, args.per_stage, args.out, seed=args.seed)
    print(json.dumps({"out": args.out, "records": sum(counts.values()), "per_stage": counts}))


def _cmd_review_import(args: argparse.Namespace) -> None:
    from glmserve.data.review import import_labels

    print(json.dumps(import_labels(args.sample, args.report), ensure_ascii=False))


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="training-data pipeline: clean, train-quality, review, scrub, augment, feedback")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    clean = data_sub.add_parser("clean", help="rule filters and MinHash dedup on datatrove: kept.jsonl, "
                                "rejected.jsonl, report.json in DIR (a rerun resumes)")
    clean.add_argument("input", metavar="IN.jsonl", help="JSONL or .parquet records with 'text' (and 'id')")
    clean.add_argument("--out", required=True, metavar="DIR")
    clean.add_argument("--config", default=None, metavar="FILE",
                       help="YAML/JSON settings per step (glmserve/data/config.py DEFAULTS); false = step off")
    clean.add_argument("--format", default="jsonl", choices=["jsonl", "parquet"],
                       help="parquet: kept.parquet and rejected.parquet as well")
    clean.add_argument("--workers", type=int, default=1,
                       help="processes for MinHash's bucket tasks (default 1: all in this process; with "
                       "--executor ray the cluster's CPUs decide)")
    clean.add_argument("--executor", default="local", choices=["local", "ray"],
                       help="ray: every task runs on a Ray cluster (pip install 'glmserve[ray]'; IN and DIR on a "
                       "filesystem all its machines share)")
    clean.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="the cluster `ray start --head` started (host:6379); unset: a local Ray instance")
    clean.set_defaults(handler=_cmd_clean)
    tq = data_sub.add_parser("train-quality", help="fit the quality model (logistic regression over sentence "
                             "embeddings) on records labeled `valid`; prints its AUC on held-out sources")
    tq.add_argument("--out", required=True, metavar="MODEL.npz")
    tq.add_argument("--train", default=None, metavar="IN.jsonl",
                    help="labeled records (default: the generated corpus's tune split, glmserve/data/corpus.py)")
    tq.add_argument("--heldout", default=None, metavar="IN.jsonl",
                    help="labeled records from other sources (default: the corpus's heldout split)")
    tq.set_defaults(handler=_cmd_train_quality)
    review = data_sub.add_parser("review", help="the human review sample: export records per stage to label, "
                                 "import the labels (agreement, valid share of the kept set with a Wilson interval)")
    review_sub = review.add_subparsers(dest="review_command", required=True)
    export = review_sub.add_parser("export", help="N kept and N rejected records per step of a clean run")
    export.add_argument("run_dir", metavar="DIR", help="the --out DIR of `glmserve data clean`")
    export.add_argument("--per-stage", type=int, required=True, metavar="N")
    export.add_argument("--out", required=True, metavar="SAMPLE.jsonl|.csv")
    export.add_argument("--seed", type=int, default=0, help="another seed draws another stable sample")
    export.set_defaults(handler=_cmd_review_export)
    imp = review_sub.add_parser("import", help="read the labeled sample ('label': valid/invalid); writes review.json")
    imp.add_argument("sample", metavar="SAMPLE.csv|.jsonl")
    imp.add_argument("--report", required=True, metavar="DIR")
    imp.set_defaults(handler=_cmd_review_import)
    scrub = data_sub.add_parser("scrub", help="replace PII (Presidio + Chinese ID, mobile, bank card, name "
                                "recognizers) by same-shape placeholders")
    scrub.add_argument("input", metavar="IN.jsonl")
    scrub.add_argument("--out", required=True, metavar="OUT.jsonl")
    scrub.add_argument("--spans", action="store_true", help="record each finding's span, not only its type")
    scrub.set_defaults(handler=_cmd_scrub)
    augment = data_sub.add_parser("augment", help="code-explanation pairs (Python docstrings) and section-summary "
                                  "pairs (Markdown, RST, numbered text) as chat JSONL (glmserve/data/augment.py)")
    augment.add_argument("input", nargs="+", metavar="IN", help="files or directories (walked)")
    augment.add_argument("--out", required=True, metavar="OUT.jsonl")
    augment.add_argument("--kind", default="auto", choices=["code", "sections", "auto"],
                         help="auto: .py files are code, .md/.rst/.txt documents")
    augment.add_argument("--lang", default="en", choices=["en", "zh"], help="language of the templates")
    augment.set_defaults(handler=_cmd_augment)
    fb = data_sub.add_parser("feedback", help="served interactions (serve --log-interactions DIR) to training "
                             "records: graded, PII-scrubbed, deduplicated, capped (glmserve/data/feedback.py)")
    fb.add_argument("log_dir", metavar="DIR")
    fb.add_argument("--out", required=True, metavar="OUT", help="directory for kept.jsonl, rejected.jsonl, report.json")
    fb.add_argument("--train-set", action="append", default=[], metavar="FILE",
                    help="JSONL/Parquet training records (text, messages or prompt/completion) to deduplicate "
                         "against and to cap the share against (repeatable)")
    fb.add_argument("--max-self-share", type=float, default=0.2,
                    help="largest share of training set + kept records that may come from the logs (default 0.2)")
    fb.add_argument("--min-tier", default="medium", choices=["high", "medium", "low"],
                    help="lowest confidence tier kept (default medium)")
    fb.set_defaults(handler=_cmd_feedback)
