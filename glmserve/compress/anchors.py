"""Rule-based anchor detection (the seeds: "rules first").

Structural anchors are kept whatever the budget and never rewritten: headings, numbered clauses
(a unit that opens with "4.2", "Article 5", "第三条") and definitions ('"Licensee" means', '(the "Term")',
'是指', '以下简称'). Fact anchors raise a unit's priority in selection and are reported in the trace map:
dates and time limits, amounts and rates, cross-references ("Section 4.2", "第三条"), named entities.
Each pattern runs once over the whole document; matches map to units by binary search on their offsets.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from glmserve.compress.segment import Unit

_CN_NUM = "零一二三四五六七八九十百千万亿两0-9０-９"
_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?"
          r"|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")

STRUCTURAL = ("heading", "clause", "definition")
FACTS = ("date", "amount", "xref", "entity")

PATTERNS: dict[str, re.Pattern[str]] = {
    "clause": re.compile(
        rf"^[ \t]*(?:第[{_CN_NUM}]+[条款]|\d+(?:\.\d+)+\.?(?=\s)|\((?:[a-z]|[ivx]+|\d+)\)(?=\s)"
        r"|(?:Article|Section|Clause)\s+\d+(?:\.\d+)*)", re.M),
    "definition": re.compile(
        r"[\"“][^\"”\n]{1,60}[\"”]\s*(?:\([^)\n]{0,40}\)\s*)?(?:means|shall mean|refers to"
        r"|has the meaning|is defined as|shall have the meaning)"
        r"|\((?:the |each a |hereinafter(?: referred to as)? )?[\"“][^\"”\n]{1,60}[\"”]\)"
        r"|本[^\n。；]{0,12}所称|是指|系指|以下简称[“\"「]"),
    "date": re.compile(
        rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b{_MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}\b"
        rf"|\b\d{{1,2}}\s+{_MONTH}\s+\d{{4}}\b|\b\d{{1,2}}/\d{{1,2}}/\d{{2,4}}\b"
        r"|\b(?:within|no later than|at least|not less than|after|before)\s+(?:\w+\s+)?\(?\d+\)?\s+"
        r"(?:business\s+|calendar\s+|working\s+)?(?:days?|weeks?|months?|years?)\b"
        rf"|\d{{4}}年(?:\d{{1,2}}月)?(?:\d{{1,2}}日)?|[{_CN_NUM}]+(?:个)?(?:日|天|个月|月|年)(?:内|以内|之内|前|后)",
        re.I),
    "amount": re.compile(
        r"[$€£¥￥]\s?\d[\d,]*(?:\.\d+)?(?:\s?(?:million|billion|thousand|[mbk])\b)?"
        r"|\b\d[\d,]*(?:\.\d+)?\s?(?:USD|EUR|GBP|CNY|RMB|dollars|euros)\b"
        r"|\b\d+(?:\.\d+)?\s?(?:%|percent\b|per cent\b)"
        rf"|人民币\s?[\d,.{_CN_NUM}]+\s?(?:元|万元|亿元)?|[\d,.]+\s?(?:元|万元|亿元)|百分之[{_CN_NUM}点]+|年利率|利率上限",
        re.I),
    "xref": re.compile(
        r"\b(?:Sections?|Articles?|Clauses?|Chapters?|Appendix|Appendices|Schedule|Exhibit|Annex|Paragraph)\s+"
        r"\d+(?:\.\d+)*[a-z]?\b|§\s?\d+(?:\.\d+)*"
        rf"|(?:本|依照|按照|根据|依据|违反|参见|见)(?:本[合同协议办法法规定]{{1,3}})?第[{_CN_NUM}]+[条款章节]", re.I),
    "entity": re.compile(
        r"\b[A-Z][a-z]+(?:\s+(?:of\s+|and\s+|&\s+)?[A-Z][a-z]+)+(?:\s+(?:Inc|Ltd|LLC|Corp|GmbH|Co|PLC)\b\.?)?"
        r"|\b[A-Z][\w&]+\s+(?:Inc|Ltd|LLC|Corp|GmbH|PLC)\b\.?"
        r"|[\u4e00-\u9fff]{2,20}(?:有限责任公司|股份有限公司|有限公司|公司|银行|委员会|人民法院|仲裁委员会)"),
}


def detect(units: Sequence[Unit], text: str) -> list[frozenset[str]]:
    """Anchor kinds of each unit of one document (units in order, all from `text`)."""
    n = len(units)
    kinds: list[set[str]] = [set() for _ in range(n)]
    if n == 0:
        return []
    starts = np.fromiter((u.start for u in units), dtype=np.int64, count=n)
    ends = np.fromiter((u.end for u in units), dtype=np.int64, count=n)
    for i, u in enumerate(units):
        if u.heading:
            kinds[i].add("heading")
    for kind, pattern in PATTERNS.items():
        pos = np.fromiter((m.start() + len(m.group(0)) - len(m.group(0).lstrip()) for m in pattern.finditer(text)),
                          dtype=np.int64)
        if pos.size == 0:
            continue
        idx = np.searchsorted(starts, pos, side="right") - 1
        ok = (idx >= 0) & (pos < ends[np.clip(idx, 0, None)])
        if kind == "clause":  # a clause label counts only where it opens its unit
            ok &= pos == starts[np.clip(idx, 0, None)]
        for i in np.unique(idx[ok]):
            kinds[int(i)].add(kind)
    return [frozenset(k) for k in kinds]


def is_structural(kinds: frozenset[str]) -> bool:
    return any(k in kinds for k in STRUCTURAL)
