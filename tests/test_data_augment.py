"""`glmserve data augment`: code-explanation pairs from Python docstrings (files the test writes and a stdlib
module), section-summary pairs only where a document states its summary (abstract or lead), in English and
Chinese, with provenance spans that slice the source file back to the code, section and answer."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from glmserve.cli import main
from glmserve.data.augment import augment, headings
from glmserve.errors import InvalidRequestError

CODE = '''\
"""Module docstring: not a definition."""
import functools


def add(a, b):
    """Return the sum of a and b, both numbers."""
    return a + b


@functools.lru_cache
def 平方(x):
    """返回 x 的平方，x 是一个整数。"""
    return x * x


class Stack:
    """A last-in first-out stack of items."""

    def __init__(self):
        self.items = []

    def push(self, item):
        """Put one item on top of the stack."""
        self.items.append(item)

    def peek(self):
        return self.items[-1]


def stub():
    """Only a docstring here, nothing else at all."""
'''

MARKDOWN = """\
# Cache guide

This guide explains how the cache keeps blocks and how blocks are evicted when memory runs out.

## Blocks

Blocks hold sixteen tokens each and are shared between requests with the same prefix. The allocator
keeps a free list and a table from prefix hashes to blocks, so that a repeated prompt is found again.

```
# not a heading: inside a code fence
```

## Eviction

Summary: least recently used blocks whose reference count is zero are evicted first.

When the pool is full the scheduler preempts the newest request and frees its blocks; evicted blocks are
recomputed later. Eviction never touches a block that a running request still reads.

## Notes

A leaf section without any summary, which gives no pair.
"""

RST = """\
=========
Scheduler
=========

Overview
========

The scheduler runs decodes first and fills the rest of the budget with prefills of waiting requests.

Budget
======

Each step has a token budget; decodes take one token each and prefills are cut into chunks to fit it,
so that a long prompt never stalls the running requests for more than one step at a time.
"""

NUMBERED = """\
4. Source packages

This chapter lists what every source package must contain for the archive to build it.

4.1. Standards conformance

Source packages should specify the most recent version number of this policy document with which
your package complied when it was last updated, in the Standards-Version field of the control file.

4.2. Package relationships

Source packages should specify which binary packages they require to be installed or not to be
installed in order to build correctly, in the Build-Depends field and its relatives.
"""


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_python_definitions_with_docstrings(tmp_path: Path) -> None:
    src = tmp_path / "mod.py"
    src.write_text(CODE.replace("\n\nclass Stack", "\n\x0c\nclass Stack"), encoding="utf-8")  # a form feed line
    report = augment([str(src)], tmp_path / "out.jsonl")
    records = _records(tmp_path / "out.jsonl")
    assert report["by_task"] == {"code_explanation": 4, "code_generation": 4}
    assert report["skipped"] == {"no_docstring": 2, "no_code_besides_docstring": 1}  # __init__, peek; stub
    text = src.read_text(encoding="utf-8")
    names = [r["provenance"]["name"] for r in records if r["task"] == "code_explanation"]
    assert names == ["add", "平方", "Stack", "Stack.push"]
    for r in records:
        p = r["provenance"]
        user, answer = (m["content"] for m in r["messages"])
        segment = text[p["span"][0]:p["span"][1]]
        if r["task"] == "code_explanation":
            assert text[p["answer_span"][0]:p["answer_span"][1]].strip('"') == answer  # the docstring literal
            assert answer not in user  # the question shows the code without its docstring
        else:
            assert textwrap.dedent(segment).rstrip() in answer and answer.startswith("```python")
        assert segment.splitlines()[0].lstrip().startswith(("def ", "class ", "@"))
        assert p["sha256"] and p["source"] == str(src) and p["lines"][0] <= p["lines"][1]
    square = next(r for r in records if r["provenance"]["name"] == "平方" and r["task"] == "code_generation")
    assert "@functools.lru_cache" in square["messages"][1]["content"]  # decorators belong to the code
    assert len({r["id"] for r in records}) == len(records)


def test_stdlib_module_and_chinese_templates(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = Path(textwrap.__file__)
    main(["data", "augment", str(source), "--out", str(tmp_path / "zh.jsonl"), "--lang", "zh"])
    report = json.loads(capsys.readouterr().out)
    records = _records(tmp_path / "zh.jsonl")
    assert report["records"] == len(records) >= 10
    by_name = {r["provenance"]["name"]: r for r in records if r["task"] == "code_explanation"}
    assert "dedent" in by_name and "TextWrapper.wrap" in by_name
    assert by_name["dedent"]["messages"][0]["content"].startswith(("请解释", "下面的"))
    text = source.read_text(encoding="utf-8")
    for r in records:
        s, e = r["provenance"]["span"]
        assert r["lang"] == "zh" and text[s:e].strip()


def test_sections_with_abstracts_and_leads(tmp_path: Path) -> None:
    for name, body in (("guide.md", MARKDOWN), ("sched.rst", RST), ("policy.txt", NUMBERED)):
        (tmp_path / "docs" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "docs" / name).write_text(body)
    (tmp_path / "docs" / "ignored.bin").write_bytes(b"\x00\x01")  # a directory is walked for known suffixes
    report = augment([str(tmp_path / "docs")], tmp_path / "out.jsonl", kind="sections")
    records = _records(tmp_path / "out.jsonl")
    got = {(Path(r["provenance"]["source"]).name, r["provenance"]["title"], r["provenance"]["summary_from"])
           for r in records}
    assert got == {("guide.md", "Cache guide", "lead"),
                   ("guide.md", "Cache guide > Eviction", "abstract_paragraph"),
                   ("sched.rst", "Scheduler", "abstract_section"),
                   ("policy.txt", "Source packages", "lead")}
    assert report["skipped"]["section_without_summary"] >= 4
    for r in records:
        p = r["provenance"]
        source = Path(p["source"]).read_text()
        assert source[p["answer_span"][0]:p["answer_span"][1]].strip() == r["messages"][1]["content"]
        assert r["messages"][1]["content"] not in r["messages"][0]["content"]  # the summary is not shown
    eviction = next(r for r in records if r["provenance"]["summary_from"] == "abstract_paragraph")
    assert eviction["messages"][1]["content"].startswith("least recently used")


def test_headings_skip_fenced_code_and_numbered_lists() -> None:
    assert [h.title for h in headings(MARKDOWN, ".md")] == ["Cache guide", "Blocks", "Eviction", "Notes"]
    steps = "1. Install the package\n\nThen run it.\n\n2. Run the tests\n\nThey pass.\n"
    assert headings(steps, ".txt") == []  # numbers without a dotted level are a list, not sections


def test_bad_input_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "data.bin").write_bytes(b"x")
    with pytest.raises(InvalidRequestError, match="--kind"):
        augment([str(tmp_path / "data.bin")], tmp_path / "out.jsonl")
    with pytest.raises(InvalidRequestError, match="does not exist"):
        augment([str(tmp_path / "missing.py")], tmp_path / "out.jsonl")
