"""Every architecture against transformers' own model on a tiny random config: logprobs of the
prefill's last position and of every paged incremental decode step, with several sequences of
different lengths in one batch, chunked prefill and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch
from parity import check_against_reference, reference_logprobs
from tiny_models import CONFIGS
from transformers import AutoModelForCausalLM

from glmserve import LLM, SamplingParams


@pytest.fixture(params=["cpp-kernel", "torch-only"])
def attention_backend(request, monkeypatch):
    """Decode attention through our C++ kernel (when it builds) and through the PyTorch fallback."""
    from glmserve.layers import attention

    if request.param == "torch-only":
        monkeypatch.setattr(attention, "paged_decode_op", lambda: None)
    elif attention.paged_decode_op() is None:
        pytest.skip("C++ kernels unavailable here")
    return request.param


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_logits_match_transformers(arch, tiny_model_dir, attention_backend):
    path = tiny_model_dir(arch)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), block_size=4, max_num_batched_tokens=24, max_num_seqs=8,
              kv_cache_memory_bytes=4 << 20)
    gen = torch.Generator().manual_seed(1)
    vocab = hf_model.config.vocab_size
    shared = torch.randint(2, vocab, (30,), generator=gen).tolist()
    first = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (5, 17, 40)] + [shared]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=5)
    for prompt, out in zip(first, llm.generate(first, params)):
        assert out.num_cached_tokens == 0
        check_against_reference(hf_model, prompt, out.outputs[0])
    # second wave: prompts that extend the shared prefix hit the prefix cache
    second = [shared + torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (3, 11)] + [shared]
    outs = llm.generate(second, params)
    for prompt, out in zip(second, outs):
        assert out.num_cached_tokens >= 28, out.num_cached_tokens
        check_against_reference(hf_model, prompt, out.outputs[0])
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_on_cpu_stays_close_to_float32_reference(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), dtype="bfloat16", block_size=4, max_num_batched_tokens=24,
              kv_cache_memory_bytes=4 << 20)
    prompts = [list(range(5, 30)), list(range(40, 47))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1))
    for prompt, out in zip(prompts, outs):
        ref = reference_logprobs(hf_model, prompt + out.outputs[0].token_ids)
        for step, lp in enumerate(out.outputs[0].logprobs):
            assert abs(ref[len(prompt) - 1 + step, lp.token_id].item() - lp.logprob) < 0.05
