"""The C++ decode attention (kernels/csrc/paged_decode.cpp) on every instruction-set variant this CPU runs
(fixture cpu_isa: the avx512 build's 16-lane SIMD path, the avx2 build's 8-lane one, the scalar loop) against
plain float64 softmax attention over the stored (dequantized) keys and values: every KV format, head sizes that
take the SIMD path and ones that fall back to the scalar loop, query-head groups of 1, 3, 4, 5 (a tile of 4 and
one of 1 on AVX-512) and 8 (two tiles of heads), context lengths around the lane count (the reduction's partial
last chunk) and around the parts of 1,024 keys that long rows run in, and the exp's underflow."""

from __future__ import annotations

import pytest
import torch
from parity import reference_decode

from glmserve import kernels
from glmserve.kv.kv_format import dequantize, kv_format, store

FORMATS = ["float32", "bfloat16", "float16", "int8", "fp8"]


def _case(fmt_name: str, heads: int, kv_heads: int, dim: int, lengths: list[int], seed: int, q_scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    b, slots_n = len(lengths), max(200, max(lengths) + 1)
    q = torch.randn(b, heads, dim, generator=gen) * q_scale
    k, v = torch.randn(slots_n, kv_heads, dim, generator=gen), torch.randn(slots_n, kv_heads, dim, generator=gen)
    width = max(lengths)
    slots = torch.stack([torch.randperm(slots_n - 1, generator=gen)[:width] + 1 for _ in range(b)])
    fmt = kv_format(fmt_name)
    cache = torch.zeros(2, kv_heads, slots_n, fmt.row_width(dim), dtype=fmt.storage)
    store(cache[0], torch.arange(slots_n), k)
    store(cache[1], torch.arange(slots_n), v)
    return q, cache, slots, torch.tensor(lengths)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,kv_heads,dim",
                         [(9, 3, 64), (4, 4, 128), (8, 2, 48), (16, 2, 64), (10, 2, 32), (6, 2, 20)])
def test_decode_matches_float64_attention(cpu_isa, fmt, heads, kv_heads, dim):
    q, cache, slots, lengths = _case(fmt, heads, kv_heads, dim, [1, 7, 8, 15, 16, 17, 33, 151], seed=dim + heads)
    scale = dim**-0.5
    out, lse = kernels.op("paged_decode_lse", q.device, q.dtype)(q, cache[0], cache[1], slots, lengths, scale)
    plain = kernels.op("paged_decode", q.device, q.dtype)(q, cache[0], cache[1], slots, lengths, scale)
    seen = dequantize(cache, torch.float32)
    want, want_lse = reference_decode(q, seen[0], seen[1], slots, lengths, scale)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, want_lse, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(plain, out, rtol=0, atol=0)


def test_peaked_scores_underflow_to_zero_weight(cpu_isa):
    """Queries 40x larger: most keys' exp(score - max) underflows (below e^-87 it is 0), the output stays the
    reference's."""
    q, cache, slots, lengths = _case("float32", 9, 3, 64, [40, 64, 100], seed=5, q_scale=40.0)
    out, lse = kernels.op("paged_decode_lse", q.device, q.dtype)(q, cache[0], cache[1], slots, lengths, 0.125)
    want, want_lse = reference_decode(q, cache[0], cache[1], slots, lengths, 0.125)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, want_lse, rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("dim", [64, 20])  # 20: int8 rows' scalar tail
def test_store_kv_writes_what_the_torch_store_writes(cpu_isa, fmt, dim):
    """The fused KV write (kernels `store_kv`) against `store`'s cast (or quantize) + index_copy_, bit for bit: k and v
    as views of a fused qkv output (strided rows), values at bf16 rounding ties, int8 rows at rounding ties, of zeros
    and with subnormal and large scales, float32 and bf16 k/v, and a slot outside the cache refused (float16 pools
    take `store`); with `roundtrip` (int8 pools) the same bytes and k, v as KVFormat.roundtrip reads them back, bit
    for bit."""
    gen = torch.Generator().manual_seed(3)
    t, kv_heads, slots_n = 11, 3, 40
    qkv = torch.randn(t, (9 + 2 * kv_heads) * dim, generator=gen)
    qkv[:, ::7] = 1.0 + 2.0 ** -8 * torch.randint(0, 4, qkv[:, ::7].shape, generator=gen)  # bf16 ties and neighbours
    k = qkv[:, 9 * dim:(9 + kv_heads) * dim].view(t, kv_heads, dim)
    v = qkv[:, (9 + kv_heads) * dim:].view(t, kv_heads, dim)
    k[0, 0] = torch.arange(dim) - dim / 2 + 0.5  # int8 ties: the scale is (dim / 2 - 0.5) / 127, codes at x.5 after
    k[0, 0, 0] = 127.0  # ... this sets the scale to 1.0: every other value a tie
    k[1, 0] = 0.0  # the smallest scale
    k[2, 1] *= 1e-6  # a float16 subnormal scale
    v[3, 2] *= 1e4
    slots = torch.randperm(slots_n, generator=gen)[:t]
    fmt_ = kv_format(fmt)
    got, want = (torch.zeros(2, kv_heads, slots_n, fmt_.row_width(dim), dtype=fmt_.storage) for _ in range(2))
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(fmt_.storage, fmt_.storage)  # bit for bit
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)  # a bf16 prefill's k, v (attention.py `takes_bf16`)
    for x, y in ((k, v), (kb, vb)):
        got.zero_()
        want.zero_()
        seen = kernels.op("store_kv", k.device, x.dtype)(got[0], got[1], slots, x, y, fmt == "int8")
        store(want[0], slots, x)
        store(want[1], slots, y)
        assert torch.equal(got.view(bits), want.view(bits))
        if fmt == "int8":
            for a, b in zip(seen, (fmt_.roundtrip(x), fmt_.roundtrip(y))):
                assert a.dtype == x.dtype and torch.equal(a, b)
        else:
            assert seen == []
            with pytest.raises(RuntimeError, match="roundtrip is for int8"):
                kernels.op("store_kv", k.device, x.dtype)(got[0], got[1], slots, x, y, True)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.op("store_kv", k.device, k.dtype)(got[0], got[1], slots, k, vb)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.op("store_kv", k.device, k.dtype)(got[0], got[1], slots + slots_n, k, v)
    half = torch.zeros(2, kv_heads, slots_n, dim, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or int8 caches"):
        kernels.op("store_kv", k.device, k.dtype)(half[0], half[1], slots, k, v)


@pytest.mark.parametrize("dim", [64, 20])
def test_int8_row_ops_give_the_torch_floats(cpu_isa, dim):
    """kernels `int8_dequantize` / `int8_roundtrip` (kv_format's dequantize and roundtrip of int8 rows on CPU) against
    code x scale in float32 rounded once, and quantize-then-that, bit for bit: float32 and bf16 in and out, zero rows,
    subnormal and large scales."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(70, dim, generator=gen) * 10 ** torch.empty(70, 1).uniform_(-7, 4, generator=gen)
    x[3] = 0.0
    fmt = kv_format("int8")

    def widened(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (rows[:, :dim].float() * rows[:, dim:].view(torch.float16).float()).to(dtype)

    for source in (x, x.to(torch.bfloat16)):
        rows = fmt.quantize(source)
        for dtype in (torch.float32, torch.bfloat16):
            got = kernels.op("int8_dequantize", x.device, torch.float32)(rows, dtype == torch.bfloat16)
            assert got.dtype == dtype and torch.equal(got, widened(rows, dtype))
            got = kernels.op("int8_roundtrip", x.device, torch.float32)(source, dtype == torch.bfloat16)
            assert got.dtype == dtype and torch.equal(got, widened(rows, source.dtype).to(dtype))
    with pytest.raises(RuntimeError, match="contiguous int8"):
        kernels.op("int8_dequantize", x.device, torch.float32)(x, False)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (6, 2, 20)])  # the SIMD tiles, the scalar loop
def test_long_rows_run_in_parts_merged_by_log_sum_exp(cpu_isa, fmt, heads, kv_heads, dim):
    """Rows of more than 1,024 keys (kPartKeys) run as parts of 1,024, merged by their log-sum-exps: the float64
    attention's outputs and log-sum-exps, at a part's edge (1,024 keys: one part; 1,025: a last part of one key),
    beside short rows, and the same floats at one thread as at two and three (the parts do not depend on them)."""
    q, cache, slots, lengths = _case(fmt, heads, kv_heads, dim, [1024, 1025, 5, 2048, 3000, 2049], seed=21)
    scale = dim**-0.5
    op = kernels.op("paged_decode_lse", q.device, q.dtype)
    seen = dequantize(cache, torch.float32)
    want, want_lse = reference_decode(q, seen[0], seen[1], slots, lengths, scale)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(op(q, cache[0], cache[1], slots, lengths, scale))
    finally:
        torch.set_num_threads(before)
    out, lse = outs[0]
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, want_lse, rtol=2e-5, atol=2e-5)
    for got in outs[1:]:
        assert all(torch.equal(g, w) for g, w in zip(got, outs[0]))
    plain = kernels.op("paged_decode", q.device, q.dtype)(q, cache[0], cache[1], slots, lengths, scale)
    assert torch.equal(plain, out)


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_threads_split_a_mixed_batch_without_changing_it(cpu_isa, threads):
    """Rows of very different lengths (as in a mixed serving batch) split over threads: the output is the
    one-thread output bit for bit, also with more threads than the 2 cores here and with empty rows."""
    q, cache, slots, lengths = _case("bfloat16", 9, 3, 64, [150, 3, 0, 120, 1, 1, 90, 150, 2, 64], seed=11)
    op = kernels.op("paged_decode_lse", q.device, q.dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = op(q, cache[0], cache[1], slots, lengths, 0.125)
        torch.set_num_threads(threads)
        got = op(q, cache[0], cache[1], slots, lengths, 0.125)
    finally:
        torch.set_num_threads(before)
    live = lengths > 0  # a row without keys has no defined output
    for g, w in zip(got, want):
        assert torch.equal(g[live], w[live])
