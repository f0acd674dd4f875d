"""Segmentation with exact character offsets: pages, sections, paragraphs and sentences of one document.

Every `Unit` is a sentence (or a heading line) whose text is exactly `source[start:end]`; the trace map
cites these offsets. Pages come from form feeds or "Page N" marker lines, sections from headings
(Markdown `#`, underlined titles, numbered titles "4.2. Title", "Section 4.2", "Article 5", Chinese
第X章/第X节/第X条), paragraphs from blank lines, sentences from end punctuation (English `.?!` with an
abbreviation guard, Chinese `。！？；`) and list items. Rules after the legal-text splitters the field uses
(pySBD's golden rules for abbreviations and numbered references; no code of theirs is copied).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

_PAGE_MARK = re.compile(r"\f|^[ \t]*(?:-+\s*)?(?:Page|PAGE|第)\s*\d+\s*(?:页)?(?:\s*-+)?[ \t]*$", re.M)
_PARAGRAPH_GAP = re.compile(r"\n[ \t]*\n\s*|\f\s*")
_CN_NUM = "零一二三四五六七八九十百千0-9０-９"
_HEADING = re.compile(
    r"^[ \t]*(?:"
    r"#{1,6}[ \t]+\S.*"  # Markdown
    rf"|第[{_CN_NUM}]+[章节编部分][^\n]{{0,60}}"  # 第一章 总则
    rf"|第[{_CN_NUM}]+条[ \t]*[^\n。；，]{{0,20}}"  # 第三条 (a title line, not a clause with its text)
    r"|(?:Section|SECTION|Article|ARTICLE|Chapter|CHAPTER|Part|PART|Appendix|APPENDIX)"
    r"[ \t]+[0-9IVXLA-Z][\w.]*\b[^\n]{0,80}"
    r"|\d+(?:\.\d+)*\.?[ \t]+[A-Z\"'“][^\n]{0,100}"  # 4.2. Package relationships
    r")(?<![.。;；:,，])$",
    re.M,
)
_UNDERLINE = re.compile(r"^[ \t]*([=\-~^*#]{3,})[ \t]*$", re.M)
_SECTION_LABEL = re.compile(
    rf"(第[{_CN_NUM}]+[章节条款编部分])|(?:Section|Article|Chapter|Part|Appendix)[ \t]+([0-9IVXLA-Z][\w.]*)"
    r"|^(\d+(?:\.\d+)*)\.?(?=[ \t])",
    re.I,
)
# sentence ends: English .?! (and closing quotes/brackets) before whitespace; Chinese ends need no space;
# a newline that starts a list item or a numbered clause also ends a sentence
_SENTENCE_END = re.compile(
    r"(?<=[.?!])[\"'”’)\]]*(?=\s+[\"'“‘(\[]?[A-Z0-9])"
    r"|[。！？；][”’」』）)]*"
    r"|(?=\n[ \t]*(?:[*•\-–]\s|\(?[a-z0-9]{1,3}[.)]\s|第[" + _CN_NUM + r"]+条))"
)
_ABBREVIATION = re.compile(
    r"(?:\b(?:e\.g|i\.e|etc|vs|cf|Mr|Mrs|Ms|Dr|No|Nos|Sec|Secs|Art|Ch|Inc|Ltd|Co|Corp|St|Fig|approx|incl|"
    r"resp|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec|U\.S|p|pp|para|Vol)\.|\b[A-Z]\.)$"
)
_CLAUSE_START = re.compile(rf"[ \t]*(第[{_CN_NUM}]+条|\d+(?:\.\d+)+)\.?(?=[ \t　]|$)")
_FENCE_LINE = re.compile(r"^[ \t]*(?:```+|~~~(?!~))[ \t]*[\w+#.-]*[ \t]*$", re.M)  # not an RST ~~~~ underline
MAX_UNIT_CHARS = 1200  # a longer run without sentence punctuation (a table, a literal block) splits at lines


@dataclass(frozen=True)
class Unit:
    """One sentence or heading of a document: `text == source[start:end]`."""

    doc: str
    start: int
    end: int
    page: int
    section: str  # label of the enclosing section ("4.2", "第三条", a heading's text), "" before the first
    paragraph: int  # 1-based paragraph number within the document
    heading: bool  # the unit is a section heading line
    text: str


def _spans(text: str, cuts: list[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """Whitespace-stripped non-empty pieces of text[lo:hi] between sorted cut positions."""
    out = []
    for a, b in zip([lo, *cuts], [*cuts, hi]):
        piece = text[a:b]
        stripped = piece.strip()
        if stripped:
            s = a + (len(piece) - len(piece.lstrip()))
            out.append((s, s + len(stripped)))
    return out


def _sentence_cuts(text: str, lo: int, hi: int) -> list[int]:
    cuts = []
    for m in _SENTENCE_END.finditer(text, lo, hi):
        pos = m.end()
        if lo < pos < hi:
            if text[pos - 1] == "." and _ABBREVIATION.search(text, max(lo, pos - 12), pos):
                continue
            cuts.append(pos)
    return cuts


def _split_long(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for a, b in spans:
        if b - a <= MAX_UNIT_CHARS:
            out.append((a, b))
            continue
        cuts = [m.start() for m in re.finditer(r"\n", text[a:b])]
        lines = _spans(text, [a + c for c in cuts], a, b)
        # greedy regroup of lines into pieces of at most MAX_UNIT_CHARS (a single longer line is cut hard)
        cur_a, cur_b = lines[0]
        for la, lb in lines[1:]:
            if lb - cur_a > MAX_UNIT_CHARS:
                out.extend(_hard_cut(cur_a, cur_b))
                cur_a = la
            cur_b = lb
        out.extend(_hard_cut(cur_a, cur_b))
    return out


def _hard_cut(a: int, b: int) -> list[tuple[int, int]]:
    return [(s, min(s + MAX_UNIT_CHARS, b)) for s in range(a, b, MAX_UNIT_CHARS)]


def _heading_lines(text: str) -> list[tuple[int, int]]:
    """(start, end) of heading lines: pattern headings and lines underlined by ===/---."""
    found = [(m.start() + len(m.group(0)) - len(m.group(0).lstrip()), m.end()) for m in _HEADING.finditer(text)]
    for m in _UNDERLINE.finditer(text):
        prev_end = m.start() - 1
        if prev_end <= 0:
            continue
        prev_start = text.rfind("\n", 0, prev_end) + 1
        line = text[prev_start:prev_end]
        if line.strip() and len(line.strip()) <= 120 and not _UNDERLINE.fullmatch(line):
            found.append((prev_start + len(line) - len(line.lstrip()), prev_start + len(line.rstrip())))
            found.append((m.start() + len(m.group(0)) - len(m.group(0).lstrip()), m.end()))  # the rule itself
    return sorted(set(found))


def fenced_blocks(text: str) -> list[tuple[int, int]]:
    """(start, end) of each closed Markdown code fence, from its opening ``` line to the end of its closing one."""
    marks = [(m.start(), m.end()) for m in _FENCE_LINE.finditer(text)]
    return [(marks[i][0], marks[i + 1][1]) for i in range(0, len(marks) - 1, 2)]


def section_label(heading: str) -> str:
    """The citable label of a heading: its number ("4.2", "第三条", "Article 5") or its text, shortened."""
    m = _SECTION_LABEL.search(heading.lstrip("# \t"))
    if m:
        if m.group(1):
            return m.group(1)
        if m.group(2):
            return m.group(0).split()[0].capitalize() + " " + m.group(2).rstrip(".")
        return m.group(3)
    return heading.strip("#=-~ \t")[:60]


def segment(doc: str, text: str) -> list[Unit]:
    """Sentences and headings of one document, in order, with pages, sections and paragraphs."""
    if not text.strip():
        return []
    page_starts = np.array([0] + [m.end() for m in _PAGE_MARK.finditer(text)], dtype=np.int64)
    headings = _heading_lines(text)
    heading_starts = {a: b for a, b in headings}
    fenced = fenced_blocks(text)
    inside = np.zeros(len(text) + 1, dtype=np.int64)  # fence nesting depth at each offset (a running sum)
    for a, b in fenced:
        inside[a] += 1
        inside[b] -= 1
    inside = np.cumsum(inside)
    gaps = [(m.start(), m.end()) for m in _PARAGRAPH_GAP.finditer(text) if not inside[m.start()]]
    gaps = sorted(gaps + [(a, a) for a, _ in fenced] + [(b, b) for _, b in fenced])
    para_bounds = list(zip([0, *[g[1] for g in gaps]], [*[g[0] for g in gaps], len(text)]))
    fence_starts = {a for a, _ in fenced}
    units: list[Unit] = []
    section = ""
    paragraph = 0
    for lo, hi in para_bounds:
        if not text[lo:hi].strip():
            continue
        paragraph += 1
        if lo in fence_starts:  # a fenced code block is one unit, kept or dropped whole
            units.append(_unit(doc, text, lo, hi, page_starts, section, paragraph, False))
            continue
        # heading lines inside the paragraph are units of their own; the rest splits into sentences
        cuts = sorted({p for a, b in headings if lo <= a < hi for p in (a, min(b, hi))} - {lo, hi})
        pieces = _spans(text, cuts, lo, hi)
        for a, b in pieces:
            if a in heading_starts:
                is_rule = bool(_UNDERLINE.fullmatch(text[a:b]))
                if not is_rule:
                    section = section_label(text[a:b])
                units.append(_unit(doc, text, a, b, page_starts, section, paragraph, True))
                continue
            clause = _CLAUSE_START.match(text, a) if a == lo or text[a - 1] == "\n" else None
            if clause:  # a numbered clause with its text ("4.2 The Licensee ...", "第三条 甲方应当...") opens a section
                section = clause.group(1)
            for sa, sb in _split_long(text, _spans(text, _sentence_cuts(text, a, b), a, b)):
                units.append(_unit(doc, text, sa, sb, page_starts, section, paragraph, False))
    return units


def _unit(doc: str, text: str, a: int, b: int, page_starts: np.ndarray, section: str, paragraph: int,
          heading: bool) -> Unit:
    page = int(np.searchsorted(page_starts, a, side="right"))
    return Unit(doc, a, b, page, section, paragraph, heading, text[a:b])
