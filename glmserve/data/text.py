"""Text helpers the filters share: Chinese handling (full-width forms, jieba words), mojibake repair, the
unwrapped view of hard-wrapped plain text and the prose view (the text without its code, data and markup)."""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

# Full-width ASCII (U+FF01..U+FF5E, with ，！？：；) and the ideographic space fold to half-width as NFKC
# does; punctuation with no half-width form (。、《》「」) is kept.
_FULLWIDTH = {cp: cp - 0xFEE0 for cp in range(0xFF01, 0xFF5F)} | {0x3000: 0x20}
# Chinese sentence punctuation seen as its ASCII role by the English-centric filters (terminal marks, commas)
_CJK_PUNCT_ROLE = str.maketrans({"。": ".", "！": "!", "？": "?", "，": ",", "；": ";", "：": ":", "、": ","})
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
# Characters typical of UTF-8 read as Latin-1 / cp1252 ("Ã©", "â€™", "å¤§"): a lead byte 0xC2-0xEF shown as a
# Latin-1 letter followed by a continuation byte shown as one of 0x80-0xBF (or the cp1252 glyphs of 0x80-0x9F).
_MOJIBAKE = re.compile("[\u00c2-\u00ef][\u0080-\u00bf\u2018-\u203a\u20ac\u0152\u0153\u0160\u0161\u0178\u017d"
                       "\u017e\u0192\u02c6\u02dc\u2122]")


def fold_fullwidth(text: str) -> str:
    """Full-width letters, digits and ASCII punctuation to half-width; 。、《》「」 stay."""
    return text.translate(_FULLWIDTH)


_FULLWIDTH_ALNUM = {cp: cp - 0xFEE0 for r in ((0xFF10, 0xFF1A), (0xFF21, 0xFF3B), (0xFF41, 0xFF5B)) for cp in range(*r)}


def fold_fullwidth_alnum(text: str) -> str:
    """Full-width letters and digits to ASCII (the repair kept in the text: Chinese punctuation stays)."""
    return text.translate(_FULLWIDTH_ALNUM)


def cjk_share(text: str) -> float:
    """Share of non-space characters that are CJK ideographs."""
    chars = sum(1 for c in text if not c.isspace())
    return len(_CJK.findall(text)) / chars if chars else 0.0


@lru_cache(maxsize=1)
def _jieba():
    import logging

    import jieba

    jieba.setLogLevel(logging.WARNING)
    return jieba


def chinese_words(text: str) -> list[str]:
    """jieba's words of a Chinese text (spaces dropped)."""
    return [w for w in _jieba().lcut(text) if w.strip()]


def chinese_view(text: str) -> str:
    """Chinese text as the word-based filters expect it: jieba words separated by spaces, line by line, with
    sentence punctuation in its ASCII role (so that terminal-punctuation rules see the end of a sentence)."""
    out = []
    for line in fold_fullwidth(text).split("\n"):
        words = chinese_words(line.translate(_CJK_PUNCT_ROLE))
        out.append(re.sub(r" ([.!?,;:])", r"\1", " ".join(words)))
    return "\n".join(out)


@lru_cache(maxsize=1)
def _common_hanzi() -> frozenset[str]:
    """The frequently used ideographs: GB2312 level 1 (3,755 simplified, lead bytes 0xB0-0xD7) and Big5 level 1
    (5,401 traditional, 0xA440-0xC67E). Chinese prose draws almost all its characters from them; UTF-8 bytes
    read as GBK or Big5 land mostly on rare ones (measured: 0.01% rare in the Vim tutor, 44-69% in its
    mojibake)."""
    codes = [("gb2312", (a << 8) | b) for a in range(0xB0, 0xD8) for b in range(0xA1, 0xFF)]
    codes += [("big5", code) for code in range(0xA440, 0xC67F)]
    chars = set()
    for codec, code in codes:
        try:
            chars.add(bytes([code >> 8, code & 0xFF]).decode(codec))
        except UnicodeDecodeError:  # unassigned code points inside the ranges
            continue
    return frozenset(chars)


def mojibake_score(text: str) -> float:
    """Mojibake marks per 100 characters (0 for clean text): Latin-1/cp1252 pairs of UTF-8 bytes, U+FFFD, and
    rare CJK ideographs (UTF-8 Chinese read as GBK or Big5)."""
    common = _common_hanzi()
    rare = sum(1 for c in _CJK.findall(text) if c not in common)
    return 100.0 * (len(_MOJIBAKE.findall(text)) + text.count("\ufffd") + rare) / max(1, len(text))


def repair_mojibake(text: str) -> str:
    """Undo one round of UTF-8 decoded as cp1252, Latin-1, GBK or Big5, where that makes the text cleaner; else
    unchanged."""
    best, best_score = text, mojibake_score(text)
    if best_score == 0:
        return text
    for codec in ("cp1252", "latin-1", "gbk", "big5"):
        try:
            fixed = text.encode(codec).decode("utf-8")
        except UnicodeError:
            continue
        score = mojibake_score(fixed)
        if score < best_score:
            best, best_score = fixed, score
    return unicodedata.normalize("NFC", best)


_RULE_LINE = re.compile(r"^\s*([=\-~^*#_+])\1{2,}\s*$")
_ATX_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+")
_LIST_ITEM = re.compile(r"^\s*(?:[-*•]|\(?\d+[.)]|\(?[a-zA-Z][.)]|\d+(?:\.\d+)+\.?)\s")


def unwrap(text: str) -> str:
    """Plain text hard-wrapped at a fixed width (licenses, man pages, READMEs) as one line per paragraph or list
    item: the filters written for web text (FineWeb, C4) count lines as paragraphs. A line starting a numbered
    or bulleted item, or a blank line, starts a new one; Markdown/reST markup is no content: rule lines
    (`=====` under a heading) end a paragraph and are dropped, `#` heading marks are dropped."""
    paragraphs: list[str] = []
    current: list[str] = []
    for raw in text.split("\n"):
        line = _ATX_HEADING.sub("", raw).strip()
        if not line or _RULE_LINE.match(raw):
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        if current and _LIST_ITEM.match(raw):
            paragraphs.append(" ".join(current))
            current = []
        current.append(line)
    if current:
        paragraphs.append(" ".join(current))
    return "\n".join(paragraphs)


_FENCE = re.compile(r"^\s*(```|~~~)")
_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_MD_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")  # [text](url) and ![alt](src): the text is prose, the URL is not
_SETEXT_RULE = re.compile(r"^\s*[=\-]{3,}\s*$")
_CODE_SYMBOLS = set("{}[]()<>=;:/\\|$&*^~`@#%+\"'_")
CODE_SYMBOL_SHARE = 0.2  # English prose has 2-6% of these characters; shell lines and source code 20-50%


def _code_like(line: str) -> bool:
    """A line of source code, a shell command or tabular data rather than prose: many code symbols, or
    tab-separated columns."""
    chars = [c for c in line if not c.isspace()]
    if "\t" in line.strip() and len(line.split("\t")) >= 3:
        return True
    return len(chars) >= 8 and sum(c in _CODE_SYMBOLS for c in chars) > CODE_SYMBOL_SHARE * len(chars)


def prose(text: str) -> str:
    """The unwrapped prose of a technical document: the filters' word and line statistics (Gopher, FineWeb)
    are about natural language, and a document's code examples, doctests, tables and markup fail them for the
    wrong reason (an alpha-word share, a repeated `import` line). Dropped: fenced code blocks, doctest blocks
    (from a `>>>` line to the next blank line), HTML comments, table rows, headings (Markdown `#` and underlined
    titles: a title is no sentence), code-like lines; Markdown links keep their text."""
    lines = _HTML_COMMENT.sub("", text).split("\n")
    out: list[str] = []
    fenced = doctest = False
    for i, line in enumerate(lines):
        stripped = line.strip()
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if stripped.startswith(">>>"):
            doctest = True
        elif not stripped:
            doctest = False
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if (fenced or doctest or _TABLE_ROW.match(line) or _ATX_HEADING.match(line)
                or (stripped and _SETEXT_RULE.match(nxt) and not _SETEXT_RULE.match(line))):
            continue
        line = _MD_LINK.sub(r"\1", line)
        out.append("" if _code_like(line) else line)
    return unwrap("\n".join(out))
