"""`glmserve draft check FILE [--glossary FILE] [--abbreviations A,B] [--json]`: the draft checks alone
(glmserve/cli.py delegates here). Exit status 0 with no finding, 1 with findings."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from glmserve.errors import InvalidRequestError


def _cmd_check(args: argparse.Namespace) -> None:
    from glmserve.compress.drafting import check_draft, load_glossary

    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read {args.file}: {exc}") from exc
    glossary = load_glossary(args.glossary) if args.glossary else None
    known = [a.strip() for a in args.abbreviations.split(",") if a.strip()] if args.abbreviations else []
    findings = check_draft(text, args.file, glossary, known)
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], ensure_ascii=False, indent=1))
    else:
        for f in findings:
            print(f"[{f.check}] {f.where()}: {f.message}")
        print(f"{len(findings)} finding(s) in {args.file}", file=sys.stderr)
    if findings:
        sys.exit(1)


def add_draft_parser(sub: argparse._SubParsersAction) -> None:
    draft = sub.add_parser("draft", help="drafting assistant tools: consistency checks on a draft")
    draft_sub = draft.add_subparsers(dest="draft_command", required=True)
    check = draft_sub.add_parser("check", help="time logic, referents defined before use, glossary spelling; each "
                                 "finding cited by section, paragraph and offsets (exit 1 when there are findings)")
    check.add_argument("file", metavar="FILE", help="the draft (UTF-8 text)")
    check.add_argument("--glossary", default=None, metavar="FILE",
                       help="canonical terms, one a line, optionally 'Term = variant; variant'")
    check.add_argument("--abbreviations", default=None, metavar="A,B",
                       help="abbreviations that need no spelling out (besides USD, UTC, ...)")
    check.add_argument("--json", action="store_true", help="the findings as JSON")
    check.set_defaults(handler=_cmd_check)
