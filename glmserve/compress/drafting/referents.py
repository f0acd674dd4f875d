"""Referents defined before use (rule-based):

- defined terms: a term the draft defines ('"Supplier" means', '(the "Supplier")', '(hereinafter "Buyer")')
  must not be used (capitalized, outside quotes) before its first definition, and is defined once;
- abbreviations: an abbreviation introduced as "Service Level Agreement (SLA)" must not be used before that,
  and one never introduced is reported (2-6 characters; headings, all-caps runs, roman numerals and a short
  list of common ones such as USD or UTC are left alone; `known` adds more).
The definition forms follow glmserve/compress/anchors.py's "definition" anchor.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from glmserve.compress.drafting.cite import Finding, Locator

_DEFINITION = re.compile(
    r"[\"“](?P<a>[A-Z][^\"”\n]{0,59})[\"”]\s*(?:\([^)\n]{0,40}\)\s*)?(?:means|shall mean|refers to|has the meaning"
    r"|is defined as|shall have the meaning)"
    r"|\((?:the |each a |an? |hereinafter(?: referred to as)? (?:the )?|together,? the )?"
    r"[\"“](?P<b>[A-Z][^\"”\n]{0,59})[\"”]\)")
_ABBREVIATION = re.compile(r"\b[A-Z][A-Z0-9&]{0,4}[A-Z0-9](?:s\b|\b)")  # 2-6 characters: a longer all-caps word is
# emphasis ("MERCHANTABILITY")
_PAREN_ABBREVIATION = re.compile(r"\((?:the\s+)?[\"“]?(?P<abbr>[A-Z][A-Z0-9&]*[A-Z0-9])s?[\"”]?\)")
_ROMAN = re.compile(r"[IVXLCDM]+")
_SMALL_WORDS = frozenset("of and for the to on in at by with de du".split())
COMMON = frozenset(
    "USD EUR GBP CNY RMB JPY CHF UTC GMT AM PM EU UK US USA UN ISO PDF URL HTTP HTTPS API FAQ CEO CFO CTO VAT GDPR "
    "PRC ID OK TV PC".split())


def definitions(text: str) -> list[tuple[str, int, int]]:
    """(term, start, end) of each definition site, in order; the term without its quotes."""
    out = []
    for m in _DEFINITION.finditer(text):
        group = "a" if m.group("a") else "b"
        out.append((m.group(group).strip(), m.start(group), m.end(group)))
    return out


def check_defined_terms(loc: Locator) -> list[Finding]:
    text, out = loc.text, []
    first: dict[str, tuple[int, int]] = {}
    for term, a, b in definitions(text):
        if term in first:
            out.append(loc.finding("defined_twice", f'"{term}" is defined again (first defined at '
                                   f"{loc.cite(*first[term]).section or 'the start'})", a, b, first[term]))
        else:
            first[term] = (a, b)
    for term, (a, b) in first.items():
        for m in re.compile(r"(?<![\w\"“])" + re.escape(term) + r"(?![\w\"”])").finditer(text, 0, a):
            out.append(loc.finding("defined_before_use", f'"{term}" is used before its definition',
                                   m.start(), m.end(), (a, b)))
            break  # the first use is enough
    return out


def _initials_match(text: str, open_paren: int, abbr: str) -> bool:
    words = re.findall(r"[A-Za-z][\w-]*", text[max(0, open_paren - 16 * len(abbr)):open_paren])
    content = [w for w in words if w.lower() not in _SMALL_WORDS]
    letters = abbr.replace("&", "")
    tail = content[-len(letters):]
    return len(tail) == len(letters) and all(w[0].upper() == c for w, c in zip(tail, letters))


def abbreviation_definitions(text: str) -> dict[str, tuple[int, int]]:
    """Each abbreviation's first introduction ("Long Form (LF)"), by its span inside the parentheses."""
    out: dict[str, tuple[int, int]] = {}
    for m in _PAREN_ABBREVIATION.finditer(text):
        abbr = m.group("abbr")
        if abbr not in out and _initials_match(text, m.start(), abbr):
            out[abbr] = (m.start("abbr"), m.end("abbr"))
    return out


def check_abbreviations(loc: Locator, known: Iterable[str] = ()) -> list[Finding]:
    text = loc.text
    defined = abbreviation_definitions(text)
    quoted_terms = {t for t, _, _ in definitions(text)}
    skip = COMMON | set(known) | quoted_terms
    reported: set[str] = set()
    out = []
    for u in loc.units:
        if u.heading:
            continue
        for m in _ABBREVIATION.finditer(text, u.start, u.end):
            word = m.group(0)
            abbr = word[:-1] if word.endswith("s") else word
            if abbr in reported or abbr in skip or _ROMAN.fullmatch(abbr) or _in_caps_run(text, m.start(), m.end()):
                continue
            where = defined.get(abbr)
            if where is None:
                out.append(loc.finding("abbreviation_undefined", f"{abbr} is never spelled out",
                                       m.start(), m.end()))
                reported.add(abbr)
            elif m.start() < where[0]:
                out.append(loc.finding("abbreviation_before_use", f"{abbr} is used before it is spelled out",
                                       m.start(), m.end(), where))
                reported.add(abbr)
    return out


def _in_caps_run(text: str, a: int, b: int) -> bool:
    """The word is part of an all-caps phrase (a title such as "MASTER SERVICES AGREEMENT")."""
    before = re.search(r"([A-Z][A-Z0-9&'-]+)[,;]?\s+$", text[max(0, a - 40):a])
    after = re.match(r"[,;]?\s+([A-Z][A-Z0-9&'-]+)\b", text[b:b + 40])
    return bool(before or after)
