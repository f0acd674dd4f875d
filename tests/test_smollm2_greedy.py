"""SmolLM2 from the embedded GGUF: our greedy tokens equal transformers' greedy tokens on the same
weights (fp32), in one batch and one at a time. Where they differ, the reference's top-2 logit gap
at the first difference must be tiny (a near-tie that float rounding may flip)."""

from __future__ import annotations

import pytest
import torch
from parity import smollm2_reference

from glmserve import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "用一句话介绍你自己。",
    "List three prime numbers.",
]
NEW_TOKENS = 24
NEAR_TIE = 0.1


@pytest.fixture(scope="module")
def reference():
    return smollm2_reference()


def _reference_greedy(model, prompt_ids: list[int], eos: set[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy generate (with its KV cache); returns tokens and top-2 logit gaps."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             eos_token_id=sorted(eos), pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    top2 = torch.stack([step[0].topk(2).values for step in out.logits])
    return tokens, top2[:, 0] - top2[:, 1]


def _assert_same_or_near_tie(ours: list[int], ref: list[int], gaps: torch.Tensor) -> None:
    if ours == ref:
        return
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    assert first < len(gaps) and gaps[first] < NEAR_TIE, (
        f"diverged at token {first} where the reference's top-2 gap is {float(gaps[first]):.3f}: {ours} vs {ref}"
    )


def test_greedy_tokens_match_transformers(smollm2, reference):
    engine = smollm2.engine
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    batched = smollm2.generate(prompts, params)
    for prompt, out in zip(prompts, batched):
        ref, gaps = _reference_greedy(reference, prompt, engine.eos_token_ids)
        _assert_same_or_near_tie(out.outputs[0].token_ids, ref, gaps)
        single = smollm2.generate([prompt], params)[0]
        _assert_same_or_near_tie(single.outputs[0].token_ids, ref, gaps)
    assert "Paris" in batched[0].outputs[0].text
