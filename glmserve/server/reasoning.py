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
class ReasoningParser:
    name: str
    opened_in_prompt: bool  # the chat template wrote <think> before the output (deepseek_r1)

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, content) of the output so far; reasoning None when the output has no reasoning part."""
        head = text.lstrip()
        if not final and THINK_START.startswith(head) and head != THINK_START:
            return ("" if self.opened_in_prompt else None), ""  # may still become <think>: wait
        if head.startswith(THINK_START):
            body = head[len(THINK_START):]
        elif self.opened_in_prompt:
            body = text
        else:
            return None, text
        end = body.find(THINK_END)
        if end < 0:
            return body[: len(body) - (0 if final else _held_back(body, THINK_END))], ""
        return body[:end], body[end + len(THINK_END):].lstrip("\n")


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

    def update(self, text: str, final: bool) -> str:
        """Reads the cumulative `text`; returns the reasoning it adds (the content so far is `self.content`)."""
        if self._parser is None:
            self.content = text
            return ""
        self.reasoning, self.content = self._parser.split(text, final)
        added = (self.reasoning or "")[self._sent_reasoning:]
        self._sent_reasoning += len(added)
        return added
