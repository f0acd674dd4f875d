"""Sampling options, stop conditions, logprobs, n > 1 and incremental detokenization."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from glmserve import LLM, SamplingParams
from glmserve.engine.detokenizer import IncrementalDetokenizer
from glmserve.errors import InvalidRequestError


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    # float32 KV: the penalties' test compares logits with transformers' float32 ones (the CPU default's int8 KV
    # rounding is measured by bench/bench_quality.py)
    return LLM(model=str(tiny_model_dir("qwen2")), block_size=4, kv_cache_memory_bytes=4 << 20,
               kv_cache_dtype="float32")


PROMPT = list(range(5, 45))
LOGIT_TOL = 1e-3  # our logits vs transformers' (float32)


def _tokens(llm, **kw) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(ignore_eos=True, **kw))[0].outputs[0].token_ids


def test_seed_reproducible_and_seeds_differ(tiny):
    a = _tokens(tiny, temperature=1.0, seed=7, max_tokens=20)
    b = _tokens(tiny, temperature=1.0, seed=7, max_tokens=20)
    c = _tokens(tiny, temperature=1.0, seed=8, max_tokens=20)
    assert a == b and a != c


def test_truncation_to_one_token_is_greedy(tiny):
    greedy = _tokens(tiny, temperature=0, max_tokens=12)
    assert _tokens(tiny, temperature=1.5, top_k=1, max_tokens=12, seed=1) == greedy
    assert _tokens(tiny, temperature=1.5, min_p=1.0, max_tokens=12, seed=2) == greedy
    assert _tokens(tiny, temperature=1.5, top_p=1e-6, max_tokens=12, seed=3) == greedy


def _penalized(logits: torch.Tensor, context: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """Reference penalties: repetition over prompt + output (the HF rule: positive logits divided, negative
    ones multiplied), presence and frequency over the output (OpenAI's rule)."""
    logits = logits.clone()
    seen = torch.tensor(sorted(set(context)))
    rep = params.repetition_penalty
    logits[seen] = torch.where(logits[seen] > 0, logits[seen] / rep, logits[seen] * rep)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.numel()).float()
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


@pytest.mark.parametrize("penalties", [dict(frequency_penalty=2.0, presence_penalty=2.0),
                                       dict(repetition_penalty=1.8)], ids=["presence+frequency", "repetition"])
def test_penalized_greedy_tokens_match_a_reference(tiny, tiny_model_dir, penalties):
    """Every greedy token is the argmax of transformers' logits for the same context, penalized by the
    reference rules; at some steps the penalties change that argmax, so an engine ignoring them fails."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **penalties)
    tokens = tiny.generate([PROMPT], params)[0].outputs[0].token_ids
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT + tokens])).logits[0].float()
    decided = 0
    for step, token in enumerate(tokens):
        raw = logits[len(PROMPT) - 1 + step]
        want = _penalized(raw, PROMPT + tokens[:step], tokens[:step], params)
        assert want[token] >= want.max() - LOGIT_TOL, (step, token, want.argmax().item())
        decided += bool(want[raw.argmax()] < want.max() - LOGIT_TOL)
    assert decided > 0


def test_logprobs_top_n_and_greedy_choice(tiny):
    out = tiny.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 5
    for token, lp in zip(out.outputs[0].token_ids, lps):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0][0] == token and lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_n_samples_share_the_prompt_blocks(tiny):
    engine = tiny.engine
    prompt = list(range(50, 90))  # 40 tokens = 10 full blocks of 4
    hits_before = engine.kv.blocks.prefix_cache_hits
    out = tiny.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # samples 2 and 3 reuse the 39 cached prompt tokens of sample 1
    assert engine.kv.blocks.prefix_cache_hits - hits_before == 2 * 39
    assert out.num_cached_tokens == 0


def test_stop_token_ids_and_max_tokens(tiny):
    greedy = _tokens(tiny, temperature=0, max_tokens=10)
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    out = tiny.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at],
                                                 ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    out = tiny.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_stop_string_is_trimmed(smollm2):
    messages = [{"role": "user", "content": "Write a short story about a cat."}]
    params = SamplingParams(temperature=0, max_tokens=40)
    whole = smollm2.chat(messages, params)[0].outputs[0]
    full = whole.text
    assert len(full) > 40, full
    stop = full[20:26]
    out = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0].outputs[0]
    assert out.text == full[: full.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    # each token's text end: what the tokens up to it decode to; the stop string's cut ends every token in it
    tok = smollm2.tokenizer
    assert [full[:e] for e in whole.text_ends] == [tok.decode(whole.token_ids[:i + 1]) for i in range(40)]
    assert out.text_ends == [min(e, len(out.text)) for e in whole.text_ends[:len(out.token_ids)]]


def test_incremental_detokenizer_handles_multibyte_text(smollm2):
    tok = smollm2.tokenizer
    text = "长上下文推理需要稀疏注意力，🙂 emoji and 中文 mixed."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=[])
    seen = []
    for t in ids:
        detok.append(t)
        seen.append(detok.text)
    assert detok.text == tok.decode(ids)
    assert all("\ufffd" not in s for s in seen)
    assert all(a == b[: len(a)] for a, b in zip(seen, seen[1:]))  # append-only


def test_stop_string_held_back_while_streaming(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("Hello world, stop here please", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["stop here"])
    visible = []
    matched = None
    for t in ids:
        matched = detok.append(t) or matched
        visible.append(detok.visible_text(finished=matched is not None))
        if matched:
            break
    assert matched == "stop here" and detok.text == "Hello world, "
    assert all("stop" not in v for v in visible)


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(temperature=2.5), dict(top_p=0.0), dict(n=0), dict(prompt_logprobs=-1),
    dict(max_tokens=-3), dict(logprobs=21), dict(presence_penalty=3.0), dict(repetition_penalty=0.0),
])
def test_invalid_sampling_params_raise(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)
