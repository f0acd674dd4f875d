"""Our prefill attention kernels reading K/V from a KV pool by slot (`slots=`, csrc/prefill_rows.h KeyRows): a chunk
over cached context without a gathered copy of that context. Each kernel on the build that has it (`prefill_attention`:
the avx512 build on CPUs with AVX512-BF16 or AMX; `prefill_attention_f32`: the avx2 build, which AVX-512 CPUs run too)
gives bit for bit the floats of the same call on the gathered keys, for float32 and bf16 pools, and a slot outside the
pool is a clear error."""

from __future__ import annotations

import pytest
import torch

from glmserve.kernels import available_isas, build

HQ, HK, D, SLOTS = 9, 3, 64, 600


def kernel(name: str):
    """Kernel `name` as a call (q, k, v, q_lens, kv_lens, scale, slots=None); a skip where no build here has it."""
    if name == "prefill_attention":
        module = build.load(name, "avx512") if "avx512" in available_isas() else None
        if module is None or not module.prefill_attention_available():
            pytest.skip("the bf16 prefill kernel needs the avx512 build on a CPU with AVX512-BF16 or AMX")
        return lambda *args, slots=None: module.prefill_attention(*args, False, slots=slots)
    module = build.load(name, "avx2") if "avx2" in available_isas() else None
    if module is None or not module.prefill_attention_f32_available():
        pytest.skip("the float32 prefill kernel needs the avx2 build")
    return module.prefill_attention_f32


def rows(gen: torch.Generator):
    """Three rows (a short chunk over a long context, a fresh-sized row, a long chunk) with shuffled slots."""
    q_lens, kv_lens = torch.tensor([5, 17, 40]), torch.tensor([300, 17, 333])
    slots = torch.stack([torch.randperm(SLOTS, generator=gen)[:int(kv_lens.max())] for _ in range(3)])
    return torch.randn(int(q_lens.sum()), HQ, D, generator=gen), q_lens, kv_lens, slots


@pytest.mark.parametrize("name", ["prefill_attention", "prefill_attention_f32"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_pool_read_by_slot_is_the_gathered_call(name, pool_dtype):
    op = kernel(name)
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(2, HK, SLOTS, D, generator=gen).to(pool_dtype)
    q, q_lens, kv_lens, slots = rows(gen)
    keys, values = (pool[i][:, slots].permute(1, 2, 0, 3) for i in (0, 1))  # [B, L, Hk, D], as gather_kv
    want = op(q, keys, values, q_lens, kv_lens, 0.125)
    got = op(q, pool[0], pool[1], q_lens, kv_lens, 0.125, slots=slots)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["prefill_attention", "prefill_attention_f32"])
def test_bad_slots_are_a_clear_error(name):
    op = kernel(name)
    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(2, HK, SLOTS, D, generator=gen)
    q, q_lens, kv_lens, slots = rows(gen)
    outside = slots.clone()
    outside[2, 332] = SLOTS  # the last key of row 2
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(q, pool[0], pool[1], q_lens, kv_lens, 0.125, slots=outside)
    with pytest.raises(RuntimeError, match="contiguous CPU int64"):
        op(q, pool[0], pool[1], q_lens, kv_lens, 0.125, slots=slots.int())
    with pytest.raises(RuntimeError, match="pools"):
        op(q, pool[0][None], pool[1][None], q_lens, kv_lens, 0.125, slots=slots)
