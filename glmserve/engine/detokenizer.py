"""Incremental detokenization that is right across multi-byte UTF-8 and trims stop strings.

Follows the prefix/read-offset scheme of vLLM's `detokenize_incrementally`: decode a short
window before and after the new token and emit only the difference, and wait while the
window ends in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: importing transformers costs seconds at startup
    from transformers import PreTrainedTokenizerBase

PROMPT_CONTEXT_TOKENS = 5  # prompt tail used so the first output token gets its leading space right


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str | None:
        """Add one token; returns the stop string it completed, if any (text is trimmed there)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return self._trim_stop(len(delta))

    def _trim_stop(self, delta_len: int) -> str | None:
        if not self.stop:
            return None
        search_from = max(0, len(self.text) - delta_len - self.holdback)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        return best[1]

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back what could still become a stop string."""
        if finished or self.holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
