"""Batched sampling: logit bias, grammar masks, penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

One tensor op per stage for the whole batch. Sampling uses the exponential-race trick
(argmax of p / E with E ~ Exp(1) is a draw from p), so that seeded rows only need their own
noise drawn from their own generator.
"""

from __future__ import annotations

import torch

from glmserve import kernels
from glmserve.engine.outputs import TokenLogprob
from glmserve.engine.sequence import Sequence
from glmserve.engine.structured import apply_bitmask, fill_bitmask


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: repetition penalty over prompt+output (HF rule), presence/frequency over output."""
    vocab = logits.shape[1]
    dev = logits.device
    rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=dev)
    if bool((rep != 1.0).any()):
        seen = torch.zeros_like(logits, dtype=torch.bool)
        ids = _padded([s.token_ids for s in seqs], dev)
        seen.scatter_(1, ids.clamp(min=0), ids >= 0)
        penalty = torch.where(logits > 0, 1.0 / rep[:, None], rep[:, None])
        logits.mul_(torch.where(seen, penalty, torch.ones_like(penalty)))
    presence = torch.tensor([s.params.presence_penalty for s in seqs], device=dev)
    frequency = torch.tensor([s.params.frequency_penalty for s in seqs], device=dev)
    if bool((presence != 0).any() or (frequency != 0).any()):
        counts = torch.zeros(len(seqs), vocab + 1, device=dev)
        ids = _padded([s.output_token_ids for s in seqs], dev)
        counts.scatter_add_(1, torch.where(ids >= 0, ids, vocab), torch.ones_like(ids, dtype=counts.dtype))
        counts = counts[:, :vocab]
        logits.sub_(frequency[:, None] * counts + presence[:, None] * (counts > 0))


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: each row's logit_bias added at its tokens (one index_put for the batch)."""
    rows = [i for i, s in enumerate(seqs) for _ in s.params.logit_bias]
    tokens = [t for s in seqs for t in s.params.logit_bias]
    values = [v for s in seqs for v in s.params.logit_bias.values()]
    dev = logits.device
    logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev)),
                      torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)


def apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: the rows of sequences with a grammar keep only the tokens their matcher allows next."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    bitmask = fill_bitmask([seqs[i].matcher for i in rows], logits.shape[1])
    apply_bitmask(logits, torch.tensor(rows, device=logits.device), bitmask)


def apply_truncation(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Masks tokens outside each row's top-k / top-p / min-p set with -inf."""
    dev = logits.device
    vocab = logits.shape[1]
    top_k = torch.tensor([s.params.top_k if s.params.top_k > 0 else vocab for s in seqs], device=dev)
    top_p = torch.tensor([s.params.top_p for s in seqs], device=dev)
    min_p = torch.tensor([s.params.min_p for s in seqs], device=dev)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop |= cumulative >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def first_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, as torch.max documents it): on CPU float32 rows the kernels'
    `first_max` (one vectorized pass per row, 3x faster than torch.max on a [32, 49152] batch of logits:
    bench/RESULTS.md, "Decode step around the linears"), else torch.max over the last dim (3x faster than argmax
    on CPU)."""
    kernel = kernels.op("first_max", x.device, x.dtype)
    if kernel is not None and x.dim() == 2 and x.shape[1] > 0 and x.stride(-1) == 1:
        return kernel(x)
    return x.max(dim=-1).indices


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [S, vocab] float32, one row per sequence that samples this step."""
    raw_logprobs = None
    if any(s.params.logprobs is not None for s in seqs):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    biased = any(s.params.logit_bias for s in seqs)
    guided = any(s.matcher is not None for s in seqs)
    penalized = any(s.params.uses_penalties for s in seqs)
    if biased or guided or penalized:
        logits = logits.clone()
    if biased:
        apply_logit_bias(logits, seqs)
    if guided:
        apply_grammars(logits, seqs)
    if penalized:
        apply_penalties(logits, seqs)
    greedy = [s.params.greedy for s in seqs]
    if all(greedy):
        tokens = first_max(logits)
    else:
        temps = torch.tensor([s.params.temperature or 1.0 for s in seqs], device=logits.device)
        scaled = logits / temps[:, None]
        if any(s.params.uses_truncation for s in seqs):
            scaled = apply_truncation(scaled, seqs)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i] = torch.empty(probs.shape[1]).exponential_(generator=s.generator).to(probs.device)
        tokens = first_max(probs / noise)
        if any(greedy):
            greedy_rows = torch.tensor(greedy, device=logits.device)
            tokens = torch.where(greedy_rows, first_max(logits), tokens)
    token_list = tokens.tolist()
    return token_list, _logprobs(raw_logprobs, tokens, seqs)


def _logprobs(raw: torch.Tensor | None, tokens: torch.Tensor, seqs: list[Sequence]) -> list[TokenLogprob | None]:
    if raw is None:
        return [None] * len(seqs)
    chosen = raw.gather(1, tokens[:, None])[:, 0].tolist()
    top_n = max(s.params.logprobs or 0 for s in seqs)
    top_values, top_ids = (raw.topk(top_n, dim=-1) if top_n else (None, None))
    out: list[TokenLogprob | None] = []
    for i, s in enumerate(seqs):
        n = s.params.logprobs
        if n is None:
            out.append(None)
            continue
        top = list(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist())) if n else []
        out.append(TokenLogprob(int(tokens[i]), chosen[i], top))
    return out
