"""Chat templates of `glmserve data augment`, in English and Chinese: each kind of pair has a few phrasings of
the user turn, picked per record by a stable hash so that a rerun writes the same file. Placeholders:
{kind} (function, class, method), {name}, {code}, {doc}, {title}, {body}."""

from __future__ import annotations

import hashlib

from glmserve.errors import InvalidRequestError

LANGS = ("en", "zh")

TEMPLATES: dict[str, dict[str, list[str]]] = {
    # the user shows code (its docstring removed); the answer is the docstring
    "code_explanation": {
        "en": ["Explain what this Python {kind} `{name}` does.\n\n```python\n{code}\n```",
               "What does the following Python {kind} do?\n\n```python\n{code}\n```"],
        "zh": ["请解释这个 Python {kind_zh} `{name}` 的作用。\n\n```python\n{code}\n```",
               "下面的 Python {kind_zh}做什么？\n\n```python\n{code}\n```"],
    },
    # the user gives the docstring; the answer is the code
    "code_generation": {
        "en": ["Write a Python {kind} `{name}` that does the following:\n\n{doc}",
               "Implement `{name}` in Python ({kind}):\n\n{doc}"],
        "zh": ["请用 Python 写一个{kind_zh} `{name}`，要求如下：\n\n{doc}",
               "用 Python 实现{kind_zh} `{name}`：\n\n{doc}"],
    },
    # the user shows a section (its lead or abstract removed); the answer is that lead or abstract
    "section_summary": {
        "en": ["Summarize the section \"{title}\" in a few sentences.\n\n{body}",
               "Give a short summary of this part of a document (\"{title}\"):\n\n{body}"],
        "zh": ["请用几句话概括“{title}”这一节。\n\n{body}",
               "为下面这段文档（“{title}”）写一个简短的摘要：\n\n{body}"],
    },
}
KIND_ZH = {"function": "函数", "class": "类", "method": "方法"}


def render(task: str, lang: str, key: str, **fields: str) -> tuple[str, int]:
    """(the user turn, the variant used) for `task` in `lang`; `key` picks the variant stably."""
    if lang not in LANGS:
        raise InvalidRequestError(f"template language must be one of {LANGS}, not {lang!r}")
    variants = TEMPLATES[task][lang]
    variant = int(hashlib.sha1(key.encode()).hexdigest(), 16) % len(variants)
    if "kind" in fields:
        fields["kind_zh"] = KIND_ZH[fields["kind"]]
    return variants[variant].format(**fields), variant
