"""Dates and durations written in a draft: ISO (2025-03-01), "March 1, 2025", "1 March 2025", 2025年3月1日;
durations "30 days", "thirty (30) days", "a 3-month pilot", "two years". Slash dates (3/1/2025) are left
out: day and month order is ambiguous."""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

MONTHS = {m: i + 1 for i, names in enumerate((
    "january jan", "february feb", "march mar", "april apr", "may", "june jun", "july jul", "august aug",
    "september sep sept", "october oct", "november nov", "december dec")) for m in names.split()}
_MONTH = "(?:" + "|".join(sorted(MONTHS, key=len, reverse=True)) + r")\.?"
_DATE = re.compile(
    r"\b(?P<iy>\d{4})-(?P<im>\d{2})-(?P<id>\d{2})\b"
    rf"|\b(?P<am>{_MONTH})\s+(?P<ad>\d{{1,2}})(?:st|nd|rd|th)?,?\s+(?P<ay>\d{{4}})\b"
    rf"|\b(?P<bd>\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?(?P<bm>{_MONTH}),?\s+(?P<by>\d{{4}})\b"
    r"|(?P<cy>\d{4})年(?P<cm>\d{1,2})月(?P<cd>\d{1,2})日",
    re.I,
)
NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())} | {"thirty": 30, "forty": 40, "forty-five": 45, "fifty": 50,
                                                      "sixty": 60, "ninety": 90}
_NUMBER = r"\d+|" + "|".join(sorted(NUMBER_WORDS, key=len, reverse=True))
_DURATION = re.compile(
    rf"\b(?P<n>{_NUMBER})(?:\s*\((?P<digits>\d+)\))?[\s-]+(?P<kind>business[\s-]|calendar[\s-]|working[\s-])?"
    r"(?P<unit>day|week|month|year)s?\b",
    re.I,
)
# days and weeks compare in days, months and years in months; business days only with business days
UNIT_SCALE = {"day": ("days", 1), "week": ("days", 7), "month": ("months", 1), "year": ("months", 12)}


@dataclass(frozen=True)
class DateMention:
    start: int
    end: int
    date: dt.date


@dataclass(frozen=True)
class Duration:
    start: int
    end: int
    amount: int  # in `family` units
    family: str  # "days", "months" or "business days"


def dates(text: str, lo: int = 0, hi: int | None = None) -> list[DateMention]:
    """Valid calendar dates in text[lo:hi], in order (an impossible date such as 2025-02-30 is skipped)."""
    out = []
    for m in _DATE.finditer(text, lo, len(text) if hi is None else hi):
        g = m.groupdict()
        try:
            if g["iy"]:
                d = dt.date(int(g["iy"]), int(g["im"]), int(g["id"]))
            elif g["ay"]:
                d = dt.date(int(g["ay"]), MONTHS[g["am"].lower().rstrip(".")], int(g["ad"]))
            elif g["by"]:
                d = dt.date(int(g["by"]), MONTHS[g["bm"].lower().rstrip(".")], int(g["bd"]))
            else:
                d = dt.date(int(g["cy"]), int(g["cm"]), int(g["cd"]))
        except ValueError:
            continue
        out.append(DateMention(m.start(), m.end(), d))
    return out


def durations(text: str, lo: int = 0, hi: int | None = None) -> list[Duration]:
    out = []
    for m in _DURATION.finditer(text, lo, len(text) if hi is None else hi):
        raw = m.group("digits") or m.group("n")
        n = int(raw) if raw.isdigit() else NUMBER_WORDS[raw.lower()]
        unit = m.group("unit").lower()
        family, scale = UNIT_SCALE[unit]
        if m.group("kind") and m.group("kind").lower().startswith(("business", "working")):
            if unit != "day":
                continue
            family = "business days"
        out.append(Duration(m.start(), m.end(), n * scale, family))
    return out


def months_between(a: dt.date, b: dt.date) -> int:
    """Whole calendar months from a to b (2025-01-15 to 2025-04-15: 3)."""
    months = (b.year - a.year) * 12 + b.month - a.month
    return months - 1 if b.day < a.day else months


def span_lengths(a: dt.date, b: dt.date, family: str) -> set[int]:
    """The lengths of the period from a to b a draft may state: end excluded or included."""
    if family == "days":
        days = (b - a).days
        return {days, days + 1}
    if family == "months":
        return {months_between(a, b), months_between(a, b + dt.timedelta(days=1))}
    return set()
