"""Block manager and scheduler: exact prefix-cache accounting, LRU reuse, and no leaked blocks
after many random requests with aborts and preemption (outputs unchanged by preemption)."""

from __future__ import annotations

import random

import pytest

from glmserve import LLM, SamplingParams
from glmserve.engine.detokenizer import IncrementalDetokenizer
from glmserve.engine.sequence import Sequence
from glmserve.errors import PromptTooLongError
from glmserve.kv.blocks import BlockManager


class _NullTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


def _seq(tokens: list[int], salt: str | None = None) -> Sequence:
    params = SamplingParams(max_tokens=4)
    return Sequence("r", 0, tokens, params, IncrementalDetokenizer(_NullTokenizer(), tokens, []), cache_salt=salt)


def _run_prompt(bm: BlockManager, seq: Sequence) -> None:
    bm.admit(seq.kv, bm.match_prefix(seq.kv), seq.recomputed_tail)
    assert bm.allocate(seq.kv, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq.kv)


def test_prefix_hits_are_exact_and_salted():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _seq(list(range(10)))
    _run_prompt(bm, a)
    assert a.kv.num_cached_tokens == 0 and len(a.kv.block_table) == 3
    b = _seq(list(range(9)) + [99, 100])  # shares two full blocks (8 tokens)
    _run_prompt(bm, b)
    assert b.kv.num_cached_tokens == 8 and b.kv.block_table[:2] == a.kv.block_table[:2]
    assert bm.ref_counts[a.kv.block_table[0]] == 2
    c = _seq(list(range(10)), salt="tenant-2")  # a different cache salt never hits
    _run_prompt(bm, c)
    assert c.kv.num_cached_tokens == 0
    d = _seq(list(range(8)))  # whole prompt cached: the last token is still recomputed
    _run_prompt(bm, d)
    assert d.kv.num_cached_tokens == 7
    assert bm.prefix_cache_queries == 10 + 11 + 10 + 8 and bm.prefix_cache_hits == 8 + 7
    for s in (a, b, c, d):
        bm.free(s.kv)
    assert bm.num_free_blocks == 15 and all(r == 0 for r in bm.ref_counts)  # block 0 is the null block


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(num_blocks=5, block_size=4)  # 4 usable
    a = _seq(list(range(8)))
    _run_prompt(bm, a)
    bm.free(a.kv)
    e = _seq(list(range(8)))
    _run_prompt(bm, e)  # hit after free
    assert e.kv.num_cached_tokens == 7
    bm.free(e.kv)
    f = _seq(list(range(100, 116)))  # needs all 4 blocks: evicts the cached ones
    _run_prompt(bm, f)
    bm.free(f.kv)
    g = _seq(list(range(8)))
    _run_prompt(bm, g)
    assert g.kv.num_cached_tokens == 0


def test_random_requests_with_aborts_and_preemption_leak_nothing(tiny_model_dir):
    path = tiny_model_dir("llama")
    roomy = LLM(model=str(path), block_size=4, max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20)
    # 2 layers * 2 * 2 heads * 16 dims * 4 bytes = 512 B/token, plus the block indexer's key bounds
    # (2 layers * 2 * 2 heads * 16 dims * 4 bytes = 512 B/block); 40 blocks of 4 tokens
    tight = LLM(model=str(path), block_size=4, max_num_batched_tokens=32, max_num_seqs=12, max_model_len=128,
                kv_cache_memory_bytes=41 * (4 * 512 + 512))
    rng = random.Random(0)
    shared = [rng.randrange(2, 300) for _ in range(24)]
    prompts = []
    for _ in range(40):
        body = [rng.randrange(2, 300) for _ in range(rng.randrange(1, 60))]
        prompts.append(shared + body if rng.random() < 0.5 else body)
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 40), ignore_eos=True) for _ in prompts]
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]

    engine = tight.engine
    to_abort = set(rng.sample(range(len(prompts)), 8))
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = out
        steps += 1
        if steps % 5 == 0 and to_abort:
            engine.abort_request(str(to_abort.pop()))
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the tight budget should force preemption"
    assert stats.num_free_blocks == stats.num_total_blocks
    assert all(r == 0 for r in engine.kv.blocks.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    for i, out in finished.items():
        assert out.outputs[0].token_ids == expected[i], i
    assert len(finished) >= len(prompts) - 8


def test_prompt_longer_than_context_is_rejected_cleanly(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir("llama")), max_model_len=32, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(PromptTooLongError, match="32"):
        llm.engine.add_request("x", list(range(2, 40)), SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([list(range(2, 30))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 32 - 28
