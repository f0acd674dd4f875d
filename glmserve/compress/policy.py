"""Per-task policy (the seeds: compression off for code, on for policy and legal text; context length by
task): code detection and the named presets short / medium / long.

Code detection reads lines: a line is code when it looks like a statement, a declaration or a data literal;
comment lines (`#`, `//`, `/*`, ` * `) and blank lines do not count either way, so a heavily commented source
file is still code and a Markdown file's `# headings` are not. Lines inside Markdown code fences do not count
either: prose with fenced examples is compressed (each fenced block is one unit, kept or dropped whole, see
glmserve/compress/segment.py), a text that is mostly fences or code lines is routed off.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from glmserve.errors import InvalidRequestError

# token budget a preset compresses to (the seeds: short <= 4K, medium <= 32K, long >= 128K)
PRESETS: dict[str, int] = {"short": 4096, "medium": 32768, "long": 131072}

_CODE_END = r"[;{}:(\[]\s*$"  # a statement's end, an opening bracket, a block's colon
_CODE_LINE = re.compile(
    r"[;{}(\[]\s*$"
    # keywords that are no English words (or are not at a line's start in prose)
    r"|^\s*(?:def|class|import|from\s+\S+\s+c?import|elif|except|lambda|nonlocal|cdef|cpdef|cimport|ctypedef|fi"
    r"|esac|echo|exit|sleep|#include|#define|#if|#ifn?def|#endif|#else|#elif|#pragma|#undef|typedef|namespace|void"
    r"|unsigned|fn|func|var|const|let|sub|my|elsif|endif|endfunction)\s"
    # keywords that are also English words count only on a line that ends like code
    r"|^\s*(?:return|if|for|while|else|try|catch|raise|yield|await|async|with|pass|break|continue|use|our|then|do"
    r"|done|local|export|package|using|public|private|protected|static|function|assert|template|struct|enum|extern"
    r"|int|bool|char|double|float|inline|virtual|goto|global|del)\b.*" + _CODE_END +
    r"|^\s*(?:@\w+|\}|\)|\]|<\w+[^>]*>\s*$|\"\"\"|\'\'\'|#!)"
    r"|^\s*[\w.\[\]$>-]+\s*(?:[+\-*/|&.]?=|:=)\s*[^\s=]"  # an assignment
    r"|^\s*[\w.$]+\(.*\)\s*;?\s*$"  # a call
    r"|^\s*(?:[\"'][^\"']*[\"']|[\w.]+)\s*,(?:\s*(?:[\"'][^\"']*[\"']|[\w.]+)\s*,)*\s*$"  # a literal list
    r"|^\s*\w+\s*:\s*[\w.]+(?:\[[^\]]*\]+)?\s*(?:=\s*\S.*)?$"  # a typed name (stubs, dataclasses)
    r"|^\s*[\w\"']+\s*:\s*\S.*,\s*$|^\s*[A-Z][A-Z0-9]*_[A-Z0-9_]+,?\s*$"  # object entries, enum members
    r"|;\s*(?:then|do)\s*$|==|!=|\*\*"
    r"|^\s*[A-Za-z_]\w*(?:\.\w+)+\s*$"  # a dotted name alone
    r"|^\s*(?:int|double|float|char|bool|long|short|\w+_t)\s+\*?\w+(?:\s*,\s*\*?\w+)*\s*;?\s*$"  # a declaration
    r"|\)\s*(?:->\s*\S+\s*)?:\s*(?:\.\.\.)?\s*$|=>|::|\$\{?\w+|&&|\|\||\w->\w"
)
_COMMENT_LINE = re.compile(r"^\s*(?:#(?!include|define|if|endif|else|pragma|undef|!)|//|/\*|\*(?:\s|/|$)|--\s|;)")
_FENCE = re.compile(r"^\s*(?:```+|~~~(?!~))\s*[\w+#.-]*\s*$")  # not an RST ~~~~ underline
_TRAILING_COMMENT = re.compile(r"\s+(?:#|//)\s.*$")
_RULE_LINE = re.compile(r"^\s*([=\-~^*#+_])\1{2,}\s*$")  # a heading underline or a rule: neither code nor prose
_DOCSTRING = re.compile(r'"""|\'\'\'')
CODE_THRESHOLD = 0.2  # fraction of the counted lines (not blank, not comments, not fenced) that look like code
FENCED_THRESHOLD = 0.8  # a text with fences whose lines are mostly fenced code is code


@dataclass(frozen=True)
class Route:
    mode: str  # "on" or "off"
    reason: str


@dataclass(frozen=True)
class LineCounts:
    code: int  # outside fences
    counted: int  # outside fences: neither blank nor a comment
    fenced: int  # inside fences, not blank
    fences: int  # fenced blocks


def line_counts(text: str) -> LineCounts:
    lines = text.splitlines()
    marks = [i for i, ln in enumerate(lines) if _FENCE.match(ln)]
    marks = marks[: len(marks) // 2 * 2]  # an unclosed fence fences nothing
    code = counted = fenced = 0
    fences = len(marks) // 2
    inside = in_docstring = False
    opens = set(marks[0::2]) | set(marks[1::2])
    for i, ln in enumerate(lines):
        if i in opens:
            inside = not inside
            continue
        if not ln.strip() or _RULE_LINE.match(ln):
            continue
        quotes = len(_DOCSTRING.findall(ln))
        if inside:
            fenced += 1
        elif in_docstring or quotes % 2:
            pass  # the text of a docstring (or of any triple-quoted string) counts as a comment
        elif not _COMMENT_LINE.match(ln):
            counted += 1
            code += bool(_CODE_LINE.search(_TRAILING_COMMENT.sub("", ln)))
        if quotes % 2:
            in_docstring = not in_docstring
    return LineCounts(code, counted, fenced, fences)


def code_fraction(text: str) -> float:
    """Share of the counted lines (outside fences, not blank, not comments) that look like code."""
    c = line_counts(text)
    return c.code / c.counted if c.counted else 0.0


def route(text: str) -> Route:
    """"off" for code (compression would break it), "on" for prose (fenced examples included)."""
    c = line_counts(text)
    frac = c.code / c.counted if c.counted else 0.0
    if c.counted and frac >= CODE_THRESHOLD:
        return Route("off", f"code ({frac:.0%} of lines look like code)")
    if c.fences and c.fenced >= FENCED_THRESHOLD * (c.fenced + c.counted):
        return Route("off", f"code ({c.fenced} of {c.fenced + c.counted} lines in code fences)")
    if c.fences:
        return Route("on", f"prose with {c.fences} fenced code block(s), each kept or dropped whole")
    return Route("on", "prose")


def preset_tokens(name: str) -> int:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidRequestError(f"unknown compression preset {name!r}; choose one of {', '.join(PRESETS)}") from None
