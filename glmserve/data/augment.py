"""`glmserve data augment`: structured pairs from sources that carry their own answer, as chat/SFT JSONL.

Code (`.py`, read with `ast`): each function, method or class with a docstring gives a code-explanation pair
(the code with its docstring removed -> the docstring) and a code-generation pair (the docstring -> the code).
Documents (`.md`, `.rst`, `.txt`: Markdown ATX/setext headings, reStructuredText underlined titles, numbered
headings as in the Debian Policy's text form, "4.", "4.1"): a section whose summary is written in it gives a
section-summary pair, the summary being (a) an explicit abstract, a paragraph that starts "Abstract:",
"Summary:", "TL;DR:", "摘要：" ..., or a subsection titled Abstract / Summary / Overview / 摘要 / 概述, or (b) the
lead, the text between a section's heading and its first subsection, when it is at most three paragraphs and
shorter than half of the subsections. A section with neither gives nothing: no summary is invented.
Each record has `id`, `messages` (user, assistant), `task`, `lang` and `provenance`: source file, its sha256,
the character span [start, end) of the code or section in the file and of the answer taken from it, lines.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import re
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmserve.data.records import write_records
from glmserve.data.templates import LANGS, render
from glmserve.errors import InvalidRequestError

CODE_SUFFIXES = (".py",)
DOC_SUFFIXES = (".md", ".markdown", ".rst", ".txt")
MIN_DOC_WORDS = 4  # a docstring or summary shorter than this says too little to be an answer
MAX_CODE_CHARS = 6000
MAX_SECTION_CHARS = 12000
ABSTRACT_CUE = re.compile(r"^\s*(?:\*\*)?(?:abstract|summary|tl;\s?dr|synopsis|摘要|概要|内容提要)(?:\*\*)?\s*[:：]\s*",
                          re.IGNORECASE)
ABSTRACT_TITLE = re.compile(r"^(?:abstract|summary|overview|synopsis|tl;\s?dr|摘要|概述|概要|简介)$", re.IGNORECASE)


@dataclass
class Stats:
    """What the run made and what it skipped, and why."""

    files: int = 0
    records: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)


def _lines(text: str) -> list[str]:
    """Lines with their ends, split only at \\n, \\r\\n and \\r as Python's tokenizer does (str.splitlines also
    splits at form feeds and other separators, which would shift ast's line numbers)."""
    return re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", text)


def _line_offsets(text: str) -> list[int]:
    """Character offset of the start of each line (1-based line n starts at offsets[n - 1])."""
    offsets, pos = [0], 0
    for line in _lines(text):
        pos += len(line)
        offsets.append(pos)
    return offsets


def _record(task: str, lang: str, answer: str, provenance: dict[str, Any], **fields: str) -> dict[str, Any]:
    """One chat record: the user turn rendered from `task`'s template, the answer taken from the source."""
    key = f"{provenance['source']}:{provenance['span']}:{task}:{lang}"
    user, variant = render(task, lang, key, **fields)
    return {"id": "aug-" + hashlib.sha1(key.encode()).hexdigest()[:16], "task": task, "lang": lang,
            "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
            "provenance": provenance | {"template": f"{task}/{lang}/{variant}"}}


def _words(text: str) -> int:
    """Words, counting each CJK character as one."""
    return len(re.findall(r"[A-Za-z0-9_]+|[\u4e00-\u9fff]", text))


def _char_col(line: str, byte_col: int) -> int:
    """ast's UTF-8 byte column as a character column."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def _definitions(body: list[ast.stmt], prefix: str = "", in_class: bool = False) -> Iterator[tuple[Any, str, str]]:
    """(node, qualified name, kind) of every function, method and class, nested ones included."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            kind = "class" if isinstance(node, ast.ClassDef) else "method" if in_class else "function"
            yield node, name, kind
            yield from _definitions(node.body, f"{name}.", isinstance(node, ast.ClassDef))
        else:  # definitions under if / try / with at any level
            for child_body in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, child_body, None)
                if isinstance(inner, list):
                    stmts = [s for h in inner for s in (h.body if isinstance(h, ast.ExceptHandler) else [h])]
                    yield from _definitions([s for s in stmts if isinstance(s, ast.stmt)], prefix, in_class)


def code_pairs(source: dict[str, Any], text: str, lang: str, stats: Stats) -> Iterator[dict[str, Any]]:
    """Code-explanation and code-generation records of one Python file."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        stats.skipped["python_syntax_error"] += 1
        return
    lines = _lines(text)
    offsets = _line_offsets(text)
    for node, name, kind in _definitions(tree.body):
        doc = ast.get_docstring(node)
        first = node.body[0]
        if not doc:
            stats.skipped["no_docstring"] += 1
            continue
        if _words(doc) < MIN_DOC_WORDS:
            stats.skipped["docstring_too_short"] += 1
            continue
        if len(node.body) == 1 or first.lineno == node.lineno:
            stats.skipped["no_code_besides_docstring"] += 1
            continue
        start_line = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        end_line = node.end_lineno or node.lineno
        code = textwrap.dedent("".join(lines[start_line - 1:end_line])).rstrip()
        bare = textwrap.dedent("".join(lines[start_line - 1:first.lineno - 1] +
                                       lines[(first.end_lineno or first.lineno):end_line])).rstrip()
        if len(code) > MAX_CODE_CHARS:
            stats.skipped["code_too_long"] += 1
            continue
        span = [offsets[start_line - 1], offsets[end_line]]
        doc_span = [offsets[first.lineno - 1] + _char_col(lines[first.lineno - 1], first.col_offset),
                    offsets[(first.end_lineno or first.lineno) - 1]
                    + _char_col(lines[(first.end_lineno or first.lineno) - 1], first.end_col_offset or 0)]
        where = source | {"span": span, "lines": [start_line, end_line], "name": name, "kind": kind}
        yield _record("code_explanation", lang, doc, where | {"answer_span": doc_span},
                      kind=kind, name=name, code=bare)
        yield _record("code_generation", lang, f"```python\n{code}\n```", where | {"answer_span": span},
                      kind=kind, name=name, doc=doc)
        stats.records["code_explanation"] += 1
        stats.records["code_generation"] += 1


@dataclass
class Heading:
    level: int
    title: str
    start: int  # offset of the heading's first line
    body_start: int  # offset just after its last line
    end: int = -1  # where the section ends (the next heading of the same or a higher level, or the end)


_ATX = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_ADORNMENT = re.compile(r"^([=\-~^\"'`#*+:.<>_])\1{2,}[ \t]*$")
_NUMBERED = re.compile(r"^(\d{1,2}(?:\.\d{1,2}){0,4})\.?[ \t]+(\S.{0,78})$")


def _markdown_headings(lines: list[str], offsets: list[int]) -> list[Heading]:
    out, fenced = [], False
    for i, raw in enumerate(lines):
        line = raw.rstrip("\n")
        if _FENCE.match(line):
            fenced = not fenced
        if fenced:
            continue
        if m := _ATX.match(line):
            out.append(Heading(len(m.group(1)), m.group(2), offsets[i], offsets[i + 1]))
        elif (i + 1 < len(lines) and line.strip() and not line.lstrip().startswith(("-", "*", ">", "|"))
              and (under := re.match(r"^(=+|-+)[ \t]*$", lines[i + 1].rstrip("\n")))
              and (i == 0 or not lines[i - 1].strip())):
            out.append(Heading(1 if under.group(1)[0] == "=" else 2, line.strip(), offsets[i], offsets[i + 2]))
    return out


def _rst_headings(lines: list[str], offsets: list[int]) -> list[Heading]:
    out, styles = [], []
    i = 0
    while i < len(lines) - 1:
        title, under = lines[i].rstrip("\n"), lines[i + 1].rstrip("\n")
        m = _ADORNMENT.match(under)
        if title.strip() and not _ADORNMENT.match(title) and m and len(under.rstrip()) >= len(title.rstrip()):
            over = i > 0 and lines[i - 1].rstrip("\n") == under
            style = (m.group(1), over)
            if style not in styles:
                styles.append(style)
            start = offsets[i - 1] if over else offsets[i]
            out.append(Heading(styles.index(style) + 1, title.strip(), start, offsets[i + 2]))
            i += 2
        else:
            i += 1
    return out


def _numbered_headings(lines: list[str], offsets: list[int]) -> list[Heading]:
    """"4. Title", "4.1. Title" lines with a blank line before and after; kept only when every dotted number's
    parent number is a heading too (so that a numbered list is not read as sections)."""
    found = []
    for i, raw in enumerate(lines):
        m = _NUMBERED.match(raw.rstrip("\n"))
        if (m and (i == 0 or not lines[i - 1].strip()) and (i + 1 >= len(lines) or not lines[i + 1].strip()
                                                              or _ADORNMENT.match(lines[i + 1].rstrip("\n")))
                and not m.group(2).rstrip().endswith((".", ",", ":", ";"))):
            found.append((m.group(1), Heading(m.group(1).count(".") + 1, m.group(2).strip(), offsets[i],
                                              offsets[i + 1])))
    numbers = {n for n, _ in found}
    nested = [h for n, h in found if "." not in n or n.rsplit(".", 1)[0] in numbers]
    return nested if any(h.level > 1 for h in nested) else []


def headings(text: str, suffix: str) -> list[Heading]:
    """The document's headings with their section ends."""
    lines = _lines(text)
    offsets = _line_offsets(text)
    if suffix in (".md", ".markdown"):
        found = _markdown_headings(lines, offsets)
    elif suffix == ".rst":
        found = _rst_headings(lines, offsets)
    else:
        found = _numbered_headings(lines, offsets) or _rst_headings(lines, offsets)
    for k, h in enumerate(found):
        h.end = next((g.start for g in found[k + 1:] if g.level <= h.level), len(text))
    return found


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


def _summary(text: str, h: Heading, children: list[Heading]) -> tuple[str, str, int, int] | None:
    """(how found, body shown to the model, summary start, summary end) of section `h`, or None."""
    direct = [c for c in children if c.level == min(c.level for c in children)] if children else []
    for c in direct:
        if ABSTRACT_TITLE.match(c.title.strip(" *:：")):
            body = text[h.body_start:c.start] + text[c.end:h.end]
            return "abstract_section", body, c.body_start, c.end
    intro_end = children[0].start if children else h.end
    intro = text[h.body_start:intro_end]
    paragraphs = _paragraphs(intro)
    if paragraphs and (cue := ABSTRACT_CUE.match(paragraphs[0])):
        start = h.body_start + intro.index(paragraphs[0])
        end = start + len(paragraphs[0])
        return "abstract_paragraph", text[h.body_start:start] + text[end:h.end], start + cue.end(), end
    if children and 1 <= len(paragraphs) <= 3 and len(intro.strip()) < 0.5 * len(text[intro_end:h.end].strip()):
        start = h.body_start + intro.index(paragraphs[0])
        return "lead", text[intro_end:h.end], start, start + len(intro.strip())
    return None


def section_pairs(source: dict[str, Any], text: str, suffix: str, lang: str,
                  stats: Stats) -> Iterator[dict[str, Any]]:
    """Section-summary records of one document."""
    found = headings(text, suffix)
    offsets = _line_offsets(text)
    trail: list[Heading] = []
    for k, h in enumerate(found):
        while trail and trail[-1].level >= h.level:
            trail.pop()
        trail.append(h)
        children = [c for c in found[k + 1:] if c.start < h.end]
        got = _summary(text, h, children)
        if got is None:
            stats.skipped["section_without_summary"] += 1
            continue
        how, body, s0, s1 = got
        summary = text[s0:s1].strip()
        body = body.strip()
        if _words(summary) < MIN_DOC_WORDS or len(body) < 2 * len(summary):
            stats.skipped["summary_too_short_or_body_too_short"] += 1
            continue
        if h.end - h.start > MAX_SECTION_CHARS:
            stats.skipped["section_too_long"] += 1
            continue
        title = " > ".join(t.title for t in trail)
        line = [bisect.bisect_right(offsets, h.start), bisect.bisect_right(offsets, h.end - 1)]
        where = source | {"span": [h.start, h.end], "answer_span": [s0, s1], "lines": line, "title": title,
                          "summary_from": how}
        yield _record("section_summary", lang, summary, where, title=h.title, body=body)
        stats.records["section_summary"] += 1


def _files(inputs: list[str], kind: str) -> list[Path]:
    """Input files: given ones as they are, directories walked for the suffixes of `kind`."""
    suffixes = {"code": CODE_SUFFIXES, "sections": DOC_SUFFIXES, "auto": CODE_SUFFIXES + DOC_SUFFIXES}[kind]
    out = []
    for name in inputs:
        p = Path(name)
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
        elif p.is_file():
            if kind == "auto" and p.suffix.lower() not in suffixes:
                raise InvalidRequestError(f"{p}: cannot tell code from a document by its suffix (use --kind code "
                                          f"or --kind sections; known: {', '.join(suffixes)})")
            out.append(p)
        else:
            raise InvalidRequestError(f"input {p} does not exist")
    return out


def augment(inputs: list[str], out: str | Path, kind: str = "auto", lang: str = "en",
            progress: bool | None = None) -> dict[str, Any]:
    """Writes the pairs of every input to `out` (JSONL, atomically); returns the counts."""
    from tqdm import tqdm

    if kind not in ("code", "sections", "auto"):
        raise InvalidRequestError(f"kind must be code, sections or auto, not {kind!r}")
    if lang not in LANGS:
        raise InvalidRequestError(f"lang must be one of {LANGS}, not {lang!r}")
    files = _files(inputs, kind)
    stats = Stats()
    records: list[dict[str, Any]] = []
    show = sys.stderr.isatty() if progress is None else progress
    for path in tqdm(files, desc="augment", unit="file", disable=not show):
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats.skipped["file_not_utf8"] += 1
            continue
        stats.files += 1
        source = {"source": str(path), "sha256": hashlib.sha256(raw).hexdigest()}
        as_code = kind == "code" or (kind == "auto" and path.suffix.lower() in CODE_SUFFIXES)
        records += (code_pairs(source, text, lang, stats) if as_code
                    else section_pairs(source, text, path.suffix.lower(), lang, stats))
    write_records(out, records)
    return {"files": stats.files, "records": len(records), "by_task": dict(stats.records),
            "skipped": dict(stats.skipped), "out": str(out)}
