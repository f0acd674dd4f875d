"""Per-task policy (the seeds: compression off for code, on for policy and legal text; context length by
task): code detection and the named presets short / medium / long."""

from __future__ import annotations

import re
from dataclasses import dataclass

from glmserve.errors import InvalidRequestError

# token budget a preset compresses to (the seeds: short <= 4K, medium <= 32K, long >= 128K)
PRESETS: dict[str, int] = {"short": 4096, "medium": 32768, "long": 131072}

_CODE_LINE = re.compile(
    r"[;{}]\s*$|^\s*(?:def|class|import|from\s+\S+\s+import|return|if\s*\(|for\s*\(|while\s*\(|#include|#define"
    r"|public|private|static|const|let|var|function|fn|func|package|using|namespace|try|catch|except|elif|else\s*[:{])\b"
    r"|^\s*(?:@\w+|//|/\*|\*/|\}|\)|\]|<\w+[^>]*>\s*$|\"\"\"|#\s|#!)"
    r"|^\s*[\w.\[\]]+\s*(?:[+\-*/|&]?=|:=)\s*\S"
    r"|\)\s*(?:->\s*\S+\s*)?:\s*$|=>|::"
)
CODE_THRESHOLD = 0.2  # fraction of non-blank lines that look like code


@dataclass(frozen=True)
class Route:
    mode: str  # "on" or "off"
    reason: str


def code_fraction(text: str) -> float:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return 0.0
    return sum(1 for ln in lines if _CODE_LINE.search(ln)) / len(lines)


def route(text: str) -> Route:
    """"off" for code (compression would break it), "on" for prose."""
    frac = code_fraction(text)
    if frac >= CODE_THRESHOLD:
        return Route("off", f"code ({frac:.0%} of lines look like code)")
    return Route("on", "prose")


def preset_tokens(name: str) -> int:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidRequestError(f"unknown compression preset {name!r}; choose one of {', '.join(PRESETS)}") from None
