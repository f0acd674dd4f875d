"""Prompt logprobs (`SamplingParams.prompt_logprobs`): every prompt token's logprob given the tokens before it.

A chunk of prefill computes positions [start, end) of a sequence; the logits of position p score prompt token p+1.
The runner adds those rows to the rows the model projects to logits, and `PromptRows.score` turns them into
logprobs with one in-place log-softmax over all of the step's rows, one gather and one top-k. Each sequence keeps
its scores in tensors indexed by token position (`PromptScores`), so a prompt computed again after preemption
overwrites the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmserve.engine.outputs import TokenLogprob


class PromptScores:
    """One sequence's prompt logprobs: entry i is token i's (entry 0 has none), with the top-`top_n` alternatives."""

    def __init__(self, num_prompt_tokens: int, top_n: int):
        self.top_n = top_n
        self.logprobs = torch.full((num_prompt_tokens,), float("nan"))
        self.top_ids = torch.zeros((num_prompt_tokens, top_n), dtype=torch.long)
        self.top_values = torch.zeros((num_prompt_tokens, top_n))
        self.complete = num_prompt_tokens <= 1  # every token is scored (prompts are computed in order)
        self._listed: list[TokenLogprob | None] | None = None

    def write(self, first: int, logprobs: torch.Tensor, top_ids: torch.Tensor, top_values: torch.Tensor) -> None:
        """Scores of tokens first .. first + len(logprobs) - 1 (top_* may be wider than `top_n`)."""
        last = first + len(logprobs)
        self.logprobs[first:last] = logprobs
        self.top_ids[first:last] = top_ids[:, :self.top_n]
        self.top_values[first:last] = top_values[:, :self.top_n]
        self.complete |= last == len(self.logprobs)

    def as_list(self, prompt_token_ids: list[int]) -> list[TokenLogprob | None]:
        """The scores as the engine's output gives them: None for the first token (built once, then reused)."""
        if self._listed is None:
            values, ids, tops = self.logprobs.tolist(), self.top_ids.tolist(), self.top_values.tolist()
            self._listed = [None] + [TokenLogprob(prompt_token_ids[i], values[i], list(zip(ids[i], tops[i])))
                                     for i in range(1, len(values))]
        return self._listed


@dataclass
class _Span:
    scores: PromptScores
    first: int  # the first token this step scores
    count: int


@dataclass
class PromptRows:
    """The flat-batch rows of one step whose logits score prompt tokens, and the tokens they score."""

    index: torch.Tensor  # [R] flat rows (on the model's device)
    targets: torch.Tensor  # [R] the prompt token each row scores
    spans: list[_Span]

    @classmethod
    def plan(cls, chunks: list[tuple[PromptScores | None, list[int], int, int, int]],
             device: torch.device) -> PromptRows | None:
        """`chunks`: per scheduled sequence (its scores or None, its token ids, the chunk's first position, its
        length, its first flat row). None when no sequence of the step scores its prompt."""
        spans, index, targets = [], [], []
        for scores, token_ids, start, length, row in chunks:
            if scores is None:
                continue
            end = min(start + length, len(scores.logprobs) - 1)  # the last prompt token is scored by position P-2
            if end <= start:
                continue
            spans.append(_Span(scores, start + 1, end - start))
            index.append(torch.arange(row, row + end - start))
            targets.extend(token_ids[start + 1:end + 1])
        if not spans:
            return None
        return cls(torch.cat(index).to(device), torch.tensor(targets, dtype=torch.long, device=device), spans)

    def score(self, logits: torch.Tensor) -> None:
        """`logits`: [R, vocab] float32 of `index`'s rows; overwritten by their log-softmax."""
        logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))
        chosen = logits.gather(1, self.targets[:, None])[:, 0].cpu()
        top_n = max(span.scores.top_n for span in self.spans)
        top_values, top_ids = logits.topk(top_n, dim=-1) if top_n else (logits[:, :0], self.targets[:, None][:, :0])
        top_values, top_ids = top_values.cpu(), top_ids.cpu()
        at = 0
        for span in self.spans:
            rows = slice(at, at + span.count)
            span.scores.write(span.first, chosen[rows], top_ids[rows], top_values[rows])
            at += span.count
