"""Time logic of a draft, checked sentence by sentence (rule-based):

- order: where a sentence puts one time point before or after another ("delivery on 2025-03-01, before the
  inspection on 2025-02-01", "no later than the Closing Date"), the dates must be in that order; "from D1
  to D2" and "between D1 and D2" need D1 <= D2. A time point is a date or a named event whose date the draft
  defines ('the "Closing Date" is 30 June 2025', 'the Effective Date (1 March 2025)');
- offsets: "D1, 30 days after D2" must be 30 days apart; "from D1 to D2 (90 days)" must span 90 days (the
  end day counted or not);
- sums: a total duration split into parts ("a term of 12 months, consisting of a 3-month pilot and a
  6-month rollout") must add up (days with weeks, months with years; business days on their own).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

from glmserve.compress.drafting.cite import Finding, Locator
from glmserve.compress.drafting.dates import Duration, dates, durations, span_lengths

_ORDER = re.compile(
    r"\b(?:(?P<le>no later than|not later than|on or before)|(?P<ge>no earlier than|not earlier than|on or after"
    r"|not before)|(?P<lt>before|prior to|earlier than|preceding|ahead of)|(?P<gt>after|following|later than"
    r"|subsequent to))\b", re.I)
_RELATION = {"lt": ("before", lambda a, b: a < b), "gt": ("after", lambda a, b: a > b),
             "le": ("no later than", lambda a, b: a <= b), "ge": ("no earlier than", lambda a, b: a >= b)}
_EVENT_DEF = re.compile(
    r"[\"“]?(?P<name>(?:[A-Z][\w-]*\s+){0,3}(?:Date|Deadline|Day))[\"”]?\s*(?:is|shall be|will be|means|falls on"
    r"|occurs on|:|\()\s*(?:on\s+|the\s+)?")
_ARTICLE = re.compile(r"^(?:The|A|An|This|Each)\s+")
_CLAUSE_BREAK = re.compile(r"[;:]|\b(?:and|but|while|whereas|or)\b", re.I)
_RANGE_START = re.compile(r"\b(?:from|between)\s+(?:the\s+)?$", re.I)
_RANGE_JOIN = re.compile(r"\s*,?\s*(?:to|until|till|through|and|–|-)\s+(?:the\s+)?", re.I)
_TOTAL = re.compile(r"(?:total(?:\s+\w+)?\s+of|term of|period of|duration of|runs?\s+for|lasts?(?:\s+for)?"
                    r"|over)\s+(?:a\s+|an\s+)?$", re.I)
_SPLIT = re.compile(r"consist(?:s|ing) of|compris(?:es|ing)|(?:is |are )?(?:divided|split) into|made up of"
                    r"|composed of|namely|as follows|:", re.I)
OFFSET_SLACK = 3  # characters between "30 days" and the "after" it belongs to


@dataclass(frozen=True)
class Point:
    start: int
    end: int
    date: dt.date
    label: str  # the date as written, or the event's name

    def __str__(self) -> str:
        return self.label if self.label == self.date.isoformat() else f"{self.label} ({self.date})"


def events(text: str) -> dict[str, tuple[dt.date, int]]:
    """Named events the draft dates, with their first definition's offset: {"Closing Date": (date, offset)}."""
    starts = {d.start: d for d in dates(text)}
    out: dict[str, tuple[dt.date, int]] = {}
    for m in _EVENT_DEF.finditer(text):
        d = starts.get(m.end())
        raw = m.group("name")
        name = _ARTICLE.sub("", raw).strip()  # "The Effective Date is ..." names "Effective Date"
        if d is not None and name not in out:
            out[name] = (d.date, m.start("name") + len(raw) - len(_ARTICLE.sub("", raw)))
    return out


def _points(text: str, lo: int, hi: int, named: dict[str, tuple[dt.date, int]],
            event_re: re.Pattern[str] | None) -> list[Point]:
    pts = [Point(d.start, d.end, d.date, text[d.start:d.end]) for d in dates(text, lo, hi)]
    if event_re is not None:
        for m in event_re.finditer(text, lo, hi):
            date, defined_at = named[m.group(0)]
            if m.start() != defined_at:  # the definition itself is no reference
                pts.append(Point(m.start(), m.end(), date, m.group(0)))
    return sorted(pts, key=lambda p: p.start)


def _clause_free(text: str, a: int, b: int) -> bool:
    return a <= b and not _CLAUSE_BREAK.search(text, a, b)


def check_timeline(loc: Locator) -> list[Finding]:
    text = loc.text
    named = events(text)
    event_re = (re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(named, key=len, reverse=True))) + r")\b")
                if named else None)
    out: list[Finding] = []
    for u in loc.units:
        if u.heading:
            continue
        pts = _points(text, u.start, u.end, named, event_re)
        spans = durations(text, u.start, u.end)
        out += _order_findings(loc, u.start, u.end, pts, spans)
        out += _range_findings(loc, pts, spans)
        out += _sum_findings(loc, spans)
    return out


def _order_findings(loc: Locator, lo: int, hi: int, pts: list[Point], spans: list[Duration]) -> list[Finding]:
    text, out = loc.text, []
    for m in _ORDER.finditer(text, lo, hi):
        left = [p for p in pts if p.end <= m.start()]
        right = [p for p in pts if p.start >= m.end()]
        if not left or not right:
            continue
        a, b = left[-1], right[0]
        offset = next((s for s in spans if a.end <= s.start and 0 <= m.start() - s.end <= OFFSET_SLACK), None)
        if not _clause_free(text, offset.end if offset else a.end, m.start()) or not _clause_free(
                text, m.end(), b.start):
            continue
        kind = m.lastgroup
        words, holds = _RELATION[kind]
        if not holds(a.date, b.date):
            out.append(loc.finding("time_order", f"{a} is said to be {words} {b}, but it is not", a.start, b.end,
                                   (b.start, b.end)))
        elif offset is not None and kind in ("lt", "gt"):
            first, last = (b.date, a.date) if kind == "gt" else (a.date, b.date)
            if offset.amount not in span_lengths(first, last, offset.family):
                said = text[offset.start:offset.end]
                out.append(loc.finding("date_offset", f"{said} {words} {b} is not {a}", a.start, b.end,
                                       (offset.start, offset.end)))
    return out


def _range_findings(loc: Locator, pts: list[Point], spans: list[Duration]) -> list[Finding]:
    text, out = loc.text, []
    for a, b in zip(pts, pts[1:]):
        if not _RANGE_START.search(text, max(0, a.start - 16), a.start):
            continue
        if not _RANGE_JOIN.fullmatch(text, a.end, b.start):
            continue
        if a.date > b.date:
            out.append(loc.finding("time_order", f"the period from {a.label} to {b.label} ends before it starts",
                                   a.start, b.end))
            continue
        stated = next((s for s in spans if s.start >= b.end), None)
        if stated is not None and _clause_free(text, b.end, stated.start) and stated.family != "business days":
            if stated.amount not in span_lengths(a.date, b.date, stated.family):
                said = text[stated.start:stated.end]
                out.append(loc.finding("date_span", f"the period from {a.date} to {b.date} is said to last {said}",
                                       a.start, stated.end, (stated.start, stated.end)))
    return out


def _sum_findings(loc: Locator, spans: list[Duration]) -> list[Finding]:
    text, out = loc.text, []
    for i, total in enumerate(spans):
        if not _TOTAL.search(text, max(0, total.start - 28), total.start):
            continue
        rest = spans[i + 1:]
        split = _SPLIT.search(text, total.end, rest[0].start) if rest else None
        if split is None or len(rest) < 2 or any(p.family != total.family for p in rest):
            continue
        parts = sum(p.amount for p in rest)
        if parts != total.amount:
            unit = total.family
            out.append(loc.finding("duration_sum", f"the parts add up to {parts} {unit}, not the "
                                   f"{total.amount} {unit} of the total ({text[total.start:total.end]})",
                                   total.start, rest[-1].end, (rest[0].start, rest[-1].end)))
    return out
