"""Consistency checks for a draft (issue 17's drafting assistant; the seeds' section 4): time logic, referents
defined before use, and policy-term spelling against a glossary. Rule-based and model-free; each finding
cites the draft's section, paragraph, page and character offsets (glmserve/compress/segment.py).
Entry point: `check_draft()`; command line: `glmserve draft check FILE [--glossary FILE] [--json]`.
"""

from __future__ import annotations

from collections.abc import Iterable

from glmserve.compress.drafting.cite import Cite, Finding, Locator
from glmserve.compress.drafting.glossary import Term, check_glossary, load_glossary, parse_glossary
from glmserve.compress.drafting.referents import check_abbreviations, check_defined_terms
from glmserve.compress.drafting.timeline import check_timeline

CHECKS = ("time", "referents", "terms")


def check_draft(text: str, doc: str = "draft", glossary: list[Term] | None = None,
                known_abbreviations: Iterable[str] = ()) -> list[Finding]:
    """Every finding on the draft, in the order of the text. Without a glossary the spelling check is skipped."""
    loc = Locator(doc, text)
    findings = check_timeline(loc) + check_defined_terms(loc) + check_abbreviations(loc, known_abbreviations)
    if glossary:
        findings += check_glossary(loc, glossary)
    return sorted(findings, key=lambda f: (f.at.start, f.at.end, f.check))


__all__ = ["CHECKS", "Cite", "Finding", "Term", "check_draft", "load_glossary", "parse_glossary"]
