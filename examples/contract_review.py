"""Contract compliance review on compressed context (issue 17, the seeds' section 4.1): each rule compresses
the contract for its own question, scans only the kept spans, and cites every finding by document, section,
paragraph and page through the trace map.

    .venv/bin/python examples/contract_review.py CONTRACT.txt [--rate-cap 24] [--ratio 3.4] [--json]

Rules (rule-based, model-free): an interest or penalty rate above the cap is a violation; a guarantee, a
limitation of liability, a termination notice period and a governing-law clause must each be found.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmserve.compress import Document, compress  # noqa: E402

_RATE = re.compile(r"(\d+(?:\.\d+)?)\s?(?:%|percent)\s*(?:per\s+(annum|year|month)|a\s+(year|month))?", re.I)


@dataclass(frozen=True)
class Rule:
    name: str
    query: str
    pattern: re.Pattern[str]


RULES = [
    Rule("rate_cap", "interest rate, late payment penalty or fee percentage", _RATE),
    Rule("guarantee", "guarantee, guarantor or security for the obligations",
         re.compile(r"\bguarant(?:ee|or|ees|y)\b|担保|保证", re.I)),
    Rule("liability", "limitation of liability, damages cap, indemnity",
         re.compile(r"\bliabilit(?:y|ies)\b|\bindemnif|责任", re.I)),
    Rule("termination", "termination and notice period",
         re.compile(r"\bterminat\w*\b[^.]*\b\d+\s+(?:business\s+)?days\b|解除|终止", re.I)),
    Rule("governing_law", "governing law and jurisdiction",
         re.compile(r"\bgoverned by\b|\bgoverning law\b|适用法律", re.I)),
]


@dataclass(frozen=True)
class Finding:
    rule: str
    status: str  # "ok", "violation" or "missing"
    doc: str = ""
    section: str = ""
    paragraph: int = 0
    page: int = 0
    quote: str = ""
    note: str = ""


def annual_rate(match: re.Match[str]) -> float:
    value = float(match.group(1))
    return value * 12 if (match.group(2) or match.group(3) or "").lower() == "month" else value


def review(documents: list[Document], rate_cap: float, ratio: float) -> list[Finding]:
    texts = {d.id: d.text for d in documents}
    findings = []
    for rule in RULES:
        result = compress(documents, query=rule.query, ratio=ratio)
        hits = []
        for span in result.spans:
            quote = texts[span.doc][span.start:span.end]
            for m in rule.pattern.finditer(quote):
                status, note = "ok", ""
                if rule.name == "rate_cap":
                    rate = annual_rate(m)
                    status = "violation" if rate > rate_cap else "ok"
                    note = f"{rate:g}% a year against a cap of {rate_cap:g}%"
                hits.append(Finding(rule.name, status, span.doc, span.section, span.paragraph, span.page, quote, note))
                break
        findings.extend(hits or [Finding(rule.name, "missing", note=f"no kept span matches: {rule.query}")])
    return findings


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--rate-cap", type=float, default=24.0, help="highest lawful annual rate, percent")
    ap.add_argument("--ratio", type=float, default=3.4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    docs = [Document(f, Path(f).read_text(encoding="utf-8")) for f in args.files]
    findings = review(docs, args.rate_cap, args.ratio)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], ensure_ascii=False, indent=1))
        return
    for f in findings:
        where = f"{f.doc} §{f.section} ¶{f.paragraph} p.{f.page}" if f.doc else "-"
        print(f"[{f.status:9}] {f.rule:13} {where}: {f.note or f.quote[:100]}")


if __name__ == "__main__":
    main()
