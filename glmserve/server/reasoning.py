"""Reasoning content of models that think: the output's `<think>...</think>` part split from the answer.

Parsers are named as vLLM's `--reasoning-parser` (vllm/reasoning/): `glm45` (GLM-4.5/4.6/5.x: the model opens
`<think>` itself; an answer that does not start with it has no reasoning, e.g. when the chat template was told
`enable_thinking: false` and wrote an empty `<think></think>` into the prompt) and `deepseek_r1` (DeepSeek-R1, QwQ:
the template opens `<think>` in the prompt, so everything up to `</think>` is reasoning, all of it while the tag
has not come). The split reads the cumulative output text, so the same call serves a finished answer and a
stream: while streaming, a tail that may be the start of a tag is held back; the reasoning and the content only
ever grow by appending.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

REASONING_PARSERS = ("glm45", "deepseek_r1")
THINK_START = "<think>"
THINK_END = "</think>"


def _held_back(text: str, marker: str) -> int:
    """Length of the longest proper suffix of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class Sections:
    """Where an output's parts lie: the reasoning text `text[reasoning[0]:reasoning[1]]` (None: the output has no
    reasoning part) and the content `text[content:]`."""

    reasoning: tuple[int, int] | None
    content: int


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opened_in_prompt: bool  # the chat template wrote <think> before the output (deepseek_r1)

    def sections(self, text: str, final: bool) -> Sections:
        """The reasoning and content parts of the output so far (while streaming, a tail that may be the start of a
        tag belongs to neither yet)."""
        lead = len(text) - len(text.lstrip())
        head = text[lead:]
        if not final and THINK_START.startswith(head) and head != THINK_START:
            return Sections((0, 0) if self.opened_in_prompt else None, len(text))  # may still become <think>: wait
        if head.startswith(THINK_START):
            start = lead + len(THINK_START)
        elif self.opened_in_prompt:
            start = 0
        else:
            return Sections(None, 0)
        end = text.find(THINK_END, start)
        if end < 0:
            return Sections((start, len(text) - (0 if final else _held_back(text[start:], THINK_END))), len(text))
        content = end + len(THINK_END)
        return Sections((start, end), len(text) - len(text[content:].lstrip("\n")))

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, content) of the output so far; reasoning None when the output has no reasoning part."""
        parts = self.sections(text, final)
        reasoning = text[parts.reasoning[0]:parts.reasoning[1]] if parts.reasoning is not None else None
        return reasoning, text[parts.content:]


def tokens_within(text_ends: list[int], start: int, end: int) -> tuple[int, int]:
    """The tokens (as a range [first, last)) whose text overlaps `text[start:end]`, given each token's end in the
    text (CompletionOutput.text_ends); an empty span has none. A token that straddles an edge counts."""
    if end <= start:
        return 0, 0
    first = bisect.bisect_right(text_ends, start)  # the tokens before it end at or before `start`
    last = min(len(text_ends), bisect.bisect_left(text_ends, end) + 1)  # token i starts at text_ends[i - 1]
    return first, max(first, last)


def reasoning_tokens(parser: ReasoningParser | None, text: str, text_ends: list[int]) -> int:
    """How many of a finished output's tokens wrote its reasoning (`usage.completion_tokens_details.
    reasoning_tokens`): those between the tags, as vLLM's thinking parsers count the tokens between their tag
    tokens (vllm/reasoning/basic_parsers.py); with tags of several tokens, a token that holds both a tag's end and
    reasoning text counts. All of them for an output cut short while thinking."""
    parts = parser.sections(text, final=True) if parser is not None else None
    if parts is None or parts.reasoning is None:
        return 0
    first, last = tokens_within(text_ends, *parts.reasoning)
    return last - first


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {REASONING_PARSERS}")
    return ReasoningParser(name, opened_in_prompt=name == "deepseek_r1")


def thinking_disabled(template_kwargs: dict | None) -> bool:
    """Whether the request switched thinking off in the chat template (`enable_thinking` as GLM and Qwen 3
    templates name it, `thinking` as DeepSeek's): then the whole output is content."""
    kwargs = template_kwargs or {}
    return kwargs.get("enable_thinking", True) is False or kwargs.get("thinking", True) is False


class ReasoningStream:
    """One choice's output read as reasoning and content, with what each adds since the last call."""

    def __init__(self, parser: ReasoningParser | None) -> None:
        self._parser = parser
        self._sent_reasoning = 0
        self.reasoning: str | None = None
        self.content = ""
        self.content_start = 0  # where the content begins in the output text

    def update(self, text: str, final: bool) -> str:
        """Reads the cumulative `text`; returns the reasoning it adds (the content so far is `self.content`)."""
        if self._parser is None:
            self.content = text
            return ""
        self.reasoning, self.content = self._parser.split(text, final)
        self.content_start = len(text) - len(self.content)
        added = (self.reasoning or "")[self._sent_reasoning:]
        self._sent_reasoning += len(added)
        return added
