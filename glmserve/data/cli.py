"""`glmserve data clean | scrub`: the command-line side of the data pipeline (glmserve/cli.py delegates here)."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_clean(args: argparse.Namespace) -> None:
    from glmserve.data.clean import clean

    report = clean(args.input, args.out, config=args.config, output_format=args.format, workers=args.workers)
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


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="training-data pipeline: clean, scrub, augment, feedback")
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
                       help="processes for MinHash's bucket tasks (default 1: all in this process)")
    clean.set_defaults(handler=_cmd_clean)
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
