"""Structured output in the engine with the features it must work with: prefix caching (a cached prompt and the
prompt blocks n > 1 samples share), stop strings, and sparse decode attention whose small budget drops most of the
context. A tiny random-weight Llama with its own byte-level tokenizer: the grammar, not the model, decides what is
valid, so every output must match."""

from __future__ import annotations

import re

import pytest
import torch

from glmserve import LLM, SamplingParams
from glmserve.engine.structured import GuidedSpec

WORD = r"[a-z]{2,5}( [a-z]{2,5}){1,3}\."


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(model=str(tiny_model_dir("llama")), block_size=4, max_model_len=512, max_num_batched_tokens=512,
               kv_cache_memory_bytes=8 << 20)


def _prompt(n: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _params(**kw) -> SamplingParams:
    return SamplingParams(guided=GuidedSpec("regex", WORD), max_tokens=60, temperature=1.0, seed=5, **kw)


def test_grammar_with_a_cached_prompt_and_shared_sample_blocks(llm: LLM) -> None:
    prompt = _prompt(41)
    first = llm.generate([prompt], _params(n=3))[0]
    again = llm.generate([prompt], _params(n=3))[0]
    assert again.num_cached_tokens >= 36  # the 10 full blocks of the prompt came from the cache
    for out in (first, again):
        for c in out.outputs:
            assert c.finish_reason == "stop" and re.fullmatch(WORD, c.text), c.text
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]  # same seeds, same answers


def test_grammar_with_a_stop_string(llm: LLM) -> None:
    prompt = _prompt(30)
    whole = llm.generate([prompt], _params())[0].outputs[0].text
    cut = llm.generate([prompt], _params(stop=[" "]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == " " and whole.startswith(cut.text + " ")
    assert cut.text_ends[-1] == len(cut.text) and len(cut.text_ends) == len(cut.token_ids)


def test_grammar_with_sparse_decode(llm: LLM) -> None:
    prompt = _prompt(300)
    sparse = {"mode": "block", "top_k": 32, "sink_tokens": 4, "local_tokens": 8}  # about a tenth of the context
    outs = llm.generate([prompt, prompt[:200]], _params(n=2), sparse=sparse)
    for c in (c for out in outs for c in out.outputs):
        assert c.finish_reason == "stop" and re.fullmatch(WORD, c.text), c.text
