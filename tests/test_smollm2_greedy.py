"""SmolLM2 from the embedded GGUF: our greedy tokens equal transformers' greedy tokens on the same
weights (fp32), in one batch and one at a time. Where they differ, the reference's top-2 logit gap
at the first difference must be tiny (a near-tie that float rounding may flip)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from glmserve import SamplingParams
from glmserve.models.gguf_loader import embedded_default_gguf, load_gguf

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
    ckpt = load_gguf(embedded_default_gguf())
    model = AutoModelForCausalLM.from_config(ckpt.config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(ckpt.tensors()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def _reference_greedy(model, prompt_ids: list[int], eos: set[int]) -> tuple[list[int], torch.Tensor]:
    ids = list(prompt_ids)
    gaps = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = logits.topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
            if ids[-1] in eos:
                break
    return ids[len(prompt_ids):], torch.tensor(gaps)


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
