"""Prompt logprobs (SamplingParams.prompt_logprobs) through the engine's Python API: every prompt token's logprob
and top alternatives equal transformers' log-softmax of the same model's logits, with chunked prefill, several
sequences per step, prefix-cache hits refused for the scored prompt, max_tokens 0 and n > 1."""

from __future__ import annotations

import pytest
import torch
from parity import TOL, reference_logprobs, smollm2_reference
from transformers import AutoModelForCausalLM

from glmserve import LLM, SamplingParams
from glmserve.errors import InvalidRequestError

TOP = 3


def check_prompt_logprobs(hf_model, prompt: list[int], scored, tol: float = TOL) -> None:
    """`scored` (RequestOutput.prompt_logprobs) against the reference: the chosen token's value and the top
    alternatives, in order, unless two of them are a near-tie."""
    ref = reference_logprobs(hf_model, prompt)
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        lp = scored[i]
        row = ref[i - 1]
        assert lp.token_id == prompt[i]
        assert abs(lp.logprob - row[prompt[i]].item()) < tol, (i, lp.logprob, row[prompt[i]].item())
        best = row.topk(len(lp.top))
        for rank, (token_id, value) in enumerate(lp.top):
            assert abs(value - best.values[rank].item()) < tol
            assert token_id == best.indices[rank].item() or abs(row[token_id].item() - value) < tol


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    path = tiny_model_dir("llama")
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # float32 KV (the CPU default is int8): compared with transformers' float32 model at float32 tolerances
    llm = LLM(model=str(path), block_size=4, max_num_batched_tokens=24, max_num_seqs=8,
              kv_cache_memory_bytes=4 << 20, kv_cache_dtype="float32")
    return llm, hf_model


def _prompts(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_chunked_batched_prompt_logprobs_match_transformers(tiny):
    llm, hf_model = tiny
    prompts = _prompts(hf_model.config.vocab_size, (5, 17, 40, 2))  # 40 spans two 24-token steps
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP, logprobs=1)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        check_prompt_logprobs(hf_model, prompt, out.prompt_logprobs)
        assert len(out.outputs[0].token_ids) == 3
    plain = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None


def test_scored_prompt_never_takes_cached_blocks(tiny):
    llm, hf_model = tiny
    prompt = _prompts(hf_model.config.vocab_size, (30,), seed=1)[0]
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert llm.generate([prompt], greedy)[0].num_cached_tokens == 0  # now its blocks are cached
    assert llm.generate([prompt], greedy)[0].num_cached_tokens >= 28  # they are hit without prompt logprobs
    scored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0))
    assert scored[0].num_cached_tokens == 0
    check_prompt_logprobs(hf_model, prompt, scored[0].prompt_logprobs)
    assert all(lp.top == [] for lp in scored[0].prompt_logprobs[1:])
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_max_tokens_zero_scores_the_prompt_only(tiny):
    llm, hf_model = tiny
    prompts = _prompts(hf_model.config.vocab_size, (9, 33), seed=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=TOP))
    for prompt, out in zip(prompts, outs):
        assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        check_prompt_logprobs(hf_model, prompt, out.prompt_logprobs)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_n_samples_share_one_scored_prompt(tiny):
    llm, hf_model = tiny
    prompt = _prompts(hf_model.config.vocab_size, (21,), seed=3)[0]
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=4, seed=5, ignore_eos=True, prompt_logprobs=1))[0]
    assert [len(c.token_ids) for c in out.outputs] == [4, 4, 4]
    check_prompt_logprobs(hf_model, prompt, out.prompt_logprobs)


def test_invalid_prompt_logprobs():
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


@pytest.mark.slow
def test_smollm2_prompt_logprobs_match_transformers(smollm2):
    hf_model = smollm2_reference()
    prompts = ["The quick brown fox jumps over the lazy dog because it", "纸和印刷术让知识不再只属于少数人。"]
    outs = smollm2.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=2))
    for text, out in zip(prompts, outs):
        check_prompt_logprobs(hf_model, smollm2.tokenizer.encode(text), out.prompt_logprobs, tol=1e-3)
