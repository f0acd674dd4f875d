"""Every architecture against transformers' own model on a tiny random config: logprobs of the
prefill's last position and of every paged incremental decode step, with several sequences of
different lengths in one batch, chunked prefill and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch
from parity import check_two_waves, reference_logprobs
from tiny_models import CONFIGS
from transformers import AutoModelForCausalLM

from glmserve import LLM, SamplingParams


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_logits_match_transformers(arch, tiny_model_dir, kernel_backend):
    path = tiny_model_dir(arch)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # float32 KV (the CPU default is int8): compared with transformers' float32 model at float32 tolerances
    llm = LLM(model=str(path), block_size=4, max_num_batched_tokens=24, max_num_seqs=8,
              kv_cache_memory_bytes=4 << 20, kv_cache_dtype="float32")
    check_two_waves(llm, hf_model, (5, 17, 40))


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
