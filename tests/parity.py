"""Comparison against transformers' reference model, shared by the architecture parity tests."""

from __future__ import annotations

import torch

TOL = 2e-4


def reference_logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_reference(hf_model, prompt: list[int], output, tol: float = TOL) -> float:
    """Every reported top logprob of every generated step within `tol` of the reference; greedy
    choices agree unless the reference's top two are a near-tie. Returns the largest error."""
    ref = reference_logprobs(hf_model, prompt + output.token_ids)
    worst = 0.0
    for step, lp in enumerate(output.logprobs):
        row = ref[len(prompt) - 1 + step]
        for token_id, value in lp.top:
            err = abs(row[token_id].item() - value)
            worst = max(worst, err)
            assert err < tol, (step, token_id, row[token_id].item(), value)
        best = row.topk(2)
        if best.values[0] - best.values[1] > tol:
            assert lp.token_id == best.indices[0].item(), step
    return worst
