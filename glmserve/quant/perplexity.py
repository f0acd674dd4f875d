"""Text as fixed-length token windows, and a float model's mean next-token loss on them (the calibration loss
of sensitivity measurement and the held-out perplexity of quantization reports; in process, on a
transformers-style model whose forward takes input_ids [1, T] and returns `.logits`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from glmserve.errors import InvalidRequestError


def token_windows(tokenizer, text: str, seq_len: int, max_tokens: int | None = None) -> list[torch.Tensor]:
    """The text's tokens cut into [1, seq_len] windows (a shorter last one is dropped unless it is the only one),
    at most `max_tokens` tokens in all."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise InvalidRequestError("the text has fewer than 2 tokens")
    t = torch.tensor(ids, dtype=torch.long)
    windows = [t[i:i + seq_len] for i in range(0, len(t) - seq_len + 1, seq_len)] or [t]
    return [w.unsqueeze(0) for w in windows]


@torch.no_grad()
def mean_nll(model: torch.nn.Module, windows: Sequence[torch.Tensor], batch: int = 8) -> float:
    """Mean negative log-likelihood per predicted token over the windows (each window predicts its own tokens
    2..T from the previous ones); windows of one length run `batch` at a time."""
    total, count = 0.0, 0
    by_len: dict[int, list[torch.Tensor]] = {}
    for w in windows:
        by_len.setdefault(w.shape[1], []).append(w)
    for same in by_len.values():
        for i in range(0, len(same), batch):
            ids = torch.cat(same[i:i + batch])
            logits = model(ids).logits[:, :-1].float()
            total += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
            count += ids[:, 1:].numel()
    return total / count


def window_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of one batch of windows [b, T], differentiable (Fisher sensitivity)."""
    logits = model(ids).logits[:, :-1].float()
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def perplexity(model: torch.nn.Module, windows: Sequence[torch.Tensor]) -> float:
    return math.exp(mean_nll(model, windows))
