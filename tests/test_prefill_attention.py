"""Our causal prefill attention in bf16 (kernels op `prefill_attention`, csrc/prefill_attention.cpp), on each engine
this CPU runs (AMX tiles, AVX512-BF16's vdpbf16ps, float32 FMAs), against a float32 SDPA with an explicit causal
mask at the queries' offset, on the same bf16-rounded inputs; the layer's use of it (layers/attention.py) against
torch's bf16 SDPA, which it replaces; and the variants without AVX-512 (avx2, scalar), which report it unavailable
so that the layer keeps SDPA. The kernel tests skip on CPUs with neither AMX-BF16 nor AVX512-BF16, each engine's
where the CPU lacks it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glmserve import kernels
from glmserve.kernels import build
from glmserve.layers.attention import (
    AMX_ATTENTION_ENV,
    BF16_MIN_TOKENS,
    AttentionMetadata,
    GroupMetadata,
    PagedAttention,
    bf16_prefill_kernel,
)
from tests.prefill_layer import DIM, HEADS, KV_HEADS, NULL, layer_output

CPU = torch.device("cpu")


def available() -> bool:
    probe = kernels.op("prefill_attention_available", CPU, torch.bfloat16)
    return probe is not None and probe()


def engines() -> list[str]:
    probe = kernels.op("prefill_attention_engines", CPU, torch.bfloat16)
    return [] if probe is None else probe()


needs_kernel = pytest.mark.skipif(not available(), reason="neither AMX-BF16 nor AVX512-BF16 (or no avx512 build)")
ENGINES = ["amx", "avx512_fma", "avx512_bf16"]


def engine_or_skip(engine: str) -> str:
    if engine not in engines():
        pytest.skip(f"this CPU (or build) does not run the {engine} engine")
    return engine


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 SDPA of q [T, Hq, D] over k, v [S, Hk, D] (the same bf16 values), query i at position S - T + i."""
    t, s, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    mask = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]
    qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf.repeat_interleave(group, 0), vf.repeat_interleave(group, 0),
                                         attn_mask=mask, scale=q.shape[2] ** -0.5)
    return out.transpose(0, 1)


def inputs(t: int, s: int, hq: int, hk: int, d: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=gen).bfloat16()
    k = torch.randn(s, hk, d, generator=gen).bfloat16()
    v = torch.randn(s, hk, d, generator=gen).bfloat16()
    return q, k, v


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa-9-3", "mha-4-4"])
@pytest.mark.parametrize("t", [1, 15, 16, 17, 100, 512])
@pytest.mark.parametrize("cached", [0, 37, 300])
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_matches_float32_reference(engine, heads, t, cached, d):
    engine_or_skip(engine)
    hq, hk = heads
    q, k, v = inputs(t, t + cached, hq, hk, d)
    kernel = kernels.op("prefill_attention", CPU, torch.bfloat16)
    lens, keys = torch.tensor([t]), torch.tensor([t + cached])
    ref = reference(q, k, v)
    out32 = kernel(q, k[None], v[None], lens, keys, d**-0.5, False, engine)
    out16 = kernel(q, k[None], v[None], lens, keys, d**-0.5, True, engine)
    assert out32.dtype == torch.float32 and out16.dtype == torch.bfloat16 and out32.shape == ref.shape
    # inputs are exact in bf16 on both sides; the kernel rounds the softmax weights P to bf16 for P x V (2^-9
    # relative each, ~1e-3 on the output, as torch's bf16 flash kernel does), and out16 the output once more
    assert relative(out32, ref) < 3e-3
    assert relative(out16, ref) < 5e-3
    assert (out32 - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("engine", ENGINES)
def test_rows_of_one_batch_match_each_row_alone(engine):
    """Two rows (a fresh prompt and a chunk over cached keys) in one call, keys padded to a common length in
    strided (head-major, as the layer gathers them) tensors: each row as the reference for it alone."""
    engine_or_skip(engine)
    kernel = kernels.op("prefill_attention", CPU, torch.bfloat16)
    rows = [(70, 70), (33, 140)]  # (queries, keys)
    parts = [inputs(t, s, 9, 3, 64, seed=i) for i, (t, s) in enumerate(rows)]
    length = max(s for _, s in rows) + 5
    k = torch.zeros(3, len(rows), length, 64, dtype=torch.bfloat16)  # [Hk, B, L, D] (junk past each row's keys)
    v = torch.full((3, len(rows), length, 64), 7.0, dtype=torch.bfloat16)
    for b, (_, kb, vb) in enumerate(parts):
        k[:, b, :kb.shape[0]] = kb.transpose(0, 1)
        v[:, b, :vb.shape[0]] = vb.transpose(0, 1)
    q = torch.cat([p[0] for p in parts])
    out = kernel(q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), torch.tensor([t for t, _ in rows]),
                 torch.tensor([s for _, s in rows]), 0.125, False, engine)
    assert relative(out[:70], reference(*parts[0])) < 3e-3
    assert relative(out[70:], reference(*parts[1])) < 3e-3


@pytest.mark.parametrize("engine", ENGINES)
def test_threads_split_the_work_without_changing_the_result(engine):
    """Work items (KV head, 32 queries) go to at::parallel_for's threads; each is computed alone, so any split
    gives the same bits."""
    engine_or_skip(engine)
    kernel = kernels.op("prefill_attention", CPU, torch.bfloat16)
    q, k, v = inputs(300, 300, 9, 3, 64)
    lens = torch.tensor([300])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, k[None], v[None], lens, lens, 0.125, False, engine)
        torch.set_num_threads(3)
        assert torch.equal(kernel(q, k[None], v[None], lens, lens, 0.125, False, engine), one)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@needs_kernel
@pytest.mark.parametrize("engine", ENGINES)
def test_float32_inputs_are_rounded_as_a_cast_would(engine):
    """float32 q, k, v (as the layer hands them over: q a strided view of the projection's output) give the floats of
    the same inputs cast to bf16 first, the kernel rounding them as torch's cast does (to nearest even; denormals
    kept), for fresh prompts and chunks over cached keys, with k, v float32 or bf16."""
    kernel = kernels.op("prefill_attention", CPU, torch.bfloat16)
    engine = engine_or_skip(engine)
    gen = torch.Generator().manual_seed(5)
    for q_lens, kv_lens, length in (([129], [129], 129), ([37, 211, 5], [100, 211, 69], 256)):
        rows, t = len(q_lens), sum(q_lens)
        qkv = torch.randn(t, 9 + 6, 64, generator=gen) * 3
        q = qkv[:, :9]
        q[0, 0, :3] = torch.tensor([1e-40, -3e-39, 7.7e3])  # denormals, a large value
        k, v = (torch.randn(rows, length, 3, 64, generator=gen) for _ in range(2))
        lens = (torch.tensor(q_lens), torch.tensor(kv_lens), 0.125, False, engine)
        want = kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), *lens)
        for kk, vv in ((k, v), (k.bfloat16(), v.bfloat16())):
            assert torch.equal(kernel(q, kk, vv, *lens), want), (q_lens, kk.dtype)


def test_bad_input_is_a_clear_error():
    kernel = kernels.op("prefill_attention", CPU, torch.bfloat16)
    q, k, v = inputs(8, 8, 9, 3, 64)
    lens = torch.tensor([8])
    with pytest.raises(RuntimeError, match="q_lens sum to 7"):
        kernel(q, k[None], v[None], torch.tensor([7]), lens, 0.125, False)
    with pytest.raises(RuntimeError, match="queries <= keys"):
        kernel(q, k[None], v[None], lens, torch.tensor([9]), 0.125, False)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernel(q.half(), k[None], v[None], lens, lens, 0.125, False)
    with pytest.raises(RuntimeError, match="k and v of one dtype"):
        kernel(q, k[None].float(), v[None], lens, lens, 0.125, False)
    wide = inputs(8, 8, 9, 3, 128)
    for d in (32, 96):
        q_d, k_d, v_d = (x[..., :d] for x in wide)
        with pytest.raises(RuntimeError, match="64 or 128"):
            kernel(q_d, k_d[None], v_d[None], lens, lens, 0.125, False)
    with pytest.raises(RuntimeError, match="not a multiple"):
        kernel(q[:, :8], k[None], v[None], lens, lens, 0.125, False)
    # the engine is checked after the build and CPU: where neither runs the kernel (AVX2 only), that is the error
    expected = "engine 'tpu' does not run here" if available() else "needs the avx512 build"
    with pytest.raises(RuntimeError, match=expected):
        kernel(q, k[None], v[None], lens, lens, 0.125, False, "tpu")


def test_engines_follow_the_cpu():
    """AMX only where Linux grants the tiles (the CPU has AMX-BF16), the two vector engines wherever AVX512-BF16 is in
    the avx512 build's CPU (every AMX CPU has it too), VectorFma's first on Intel CPUs and VectorBf16's elsewhere."""
    found = engines()
    vector = ["avx512_fma", "avx512_bf16"]
    if "GenuineIntel" not in open("/proc/cpuinfo").read():
        vector.reverse()
    assert ("avx512_bf16" in found) == ("avx512_fma" in found) == kernels.avx512_bf16()
    assert found in ([], vector, ["amx", *vector]) and ("amx" not in found or kernels.avx512_bf16())
    assert available() == bool(found)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_variants_without_amx_report_it_unavailable(isa):
    """The layer asks `prefill_attention_available` and keeps SDPA where it says no: the avx2 and scalar builds
    (AMD EPYC without AVX-512, GLMSERVE_CPU_ISA=avx2) always do, and their op refuses to run."""
    if isa not in kernels.available_isas():
        pytest.skip(f"this CPU does not run the {isa} variant")
    module = build.load("prefill_attention", isa)
    if module is None:
        pytest.skip(f"the {isa} variant could not be built here")
    assert module.prefill_attention_available() is False and module.prefill_attention_engines() == []
    q, k, v = inputs(4, 4, 2, 2, 64)
    with pytest.raises(RuntimeError, match="AMX"):
        module.prefill_attention(q, k[None], v[None], torch.tensor([4]), torch.tensor([4]), 0.125, False)


def test_the_layer_takes_the_kernel_only_where_it_runs(monkeypatch):
    assert all(bf16_prefill_kernel(d) is None for d in (32, 48, 96, 192))
    monkeypatch.setenv(AMX_ATTENTION_ENV, "0")
    assert bf16_prefill_kernel(64) is None
    monkeypatch.delenv(AMX_ATTENTION_ENV)
    assert (bf16_prefill_kernel(64) is not None) == available()
    monkeypatch.setenv("GLMSERVE_CPU_ISA", "avx2")  # as on a CPU without AVX-512
    if "avx2" in kernels.available_isas() and build.load("prefill_attention", "avx2") is not None:
        assert bf16_prefill_kernel(64) is None


@needs_kernel
@pytest.mark.parametrize("context", [0, 300], ids=["fresh-causal", "cached-context"])
def test_layer_on_the_kernel_matches_bf16_sdpa(monkeypatch, context):
    monkeypatch.setattr(kernels, "amx_bf16", lambda: True)
    t = BF16_MIN_TOKENS + 40
    ours = layer_output(monkeypatch, True, context, t)
    sdpa = layer_output(monkeypatch, False, context, t)
    assert ours.dtype == torch.float32 and ours.shape == sdpa.shape == (t, HEADS * DIM)
    rel = ((ours - sdpa).norm() / sdpa.norm()).item()
    assert 0 < rel < 5e-3  # both round P and the output to bf16, in different orders; 0 would mean one path


def bf16_stream_step(t: int, pool_dtype: torch.dtype, inputs_dtype: torch.dtype, decode: bool = False):
    """One fresh prefill of `t` tokens through a layer with a bf16 (or float32) pool and a block indexer, from q, k, v
    whose values are exact in bf16, given in `inputs_dtype`: (takes_bf16, output, pool, bounds). `decode`: a mixed
    step, one decode row first (its slot after the prompt's) that reads the prompt's keys and its own."""
    from glmserve.sparse.block import BlockIndexer

    gen = torch.Generator().manual_seed(11)
    rows = t + decode
    attn = PagedAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    attn.kv_cache = torch.zeros(2, KV_HEADS, NULL + rows, DIM, dtype=pool_dtype)
    attn.indexers["block"] = BlockIndexer(KV_HEADS, DIM, (NULL + rows) // 16 + 1, 16, DIM**-0.5, pool_dtype, CPU)
    q, k, v = (x.bfloat16().to(inputs_dtype) for x in torch.randn(3, rows, HEADS, DIM, generator=gen))
    k, v = k[:, :KV_HEADS], v[:, :KV_HEADS]  # strided views, as of a fused qkv output
    g = GroupMetadata(kv_slots=torch.empty(1, 0, dtype=torch.long), key_mask=None, num_tokens=t, fresh_causal=True)
    prompt = torch.arange(NULL, NULL + t)
    d = GroupMetadata(kv_slots=torch.arange(NULL, NULL + rows)[None], key_mask=None, num_tokens=1,
                      context_lens=torch.tensor([rows])) if decode else None
    slots = torch.cat([torch.tensor([NULL + t]), prompt]) if decode else prompt
    meta = AttentionMetadata(slot_mapping=slots, decode=d, prefill=g)
    takes = attn.takes_bf16(meta)
    return takes, attn(q, k, v, meta, torch.bfloat16), attn.kv_cache, attn.indexers["block"].bounds


@needs_kernel
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "mixed"])
def test_bf16_qkv_stream_changes_nothing_where_the_layer_takes_it(decode: bool, monkeypatch):
    """`takes_bf16` (models/llama.py keeps the qkv projection's bf16 output): on a bf16 pool with our kernel, q, k,
    v in bf16 give bit for bit the output, pool and block bounds that the same values in float32 give, a mixed step's
    decode row too (its queries widened back for the decode kernel); it says no for a float32 pool, short groups,
    GLMSERVE_AMX_ATTENTION=0 and a step of decode rows alone."""
    t = BF16_MIN_TOKENS + 40
    takes, *want = bf16_stream_step(t, torch.bfloat16, torch.float32, decode)
    assert takes
    _, *got = bf16_stream_step(t, torch.bfloat16, torch.bfloat16, decode)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not bf16_stream_step(t, torch.float32, torch.float32, decode)[0]
    assert not bf16_stream_step(BF16_MIN_TOKENS - 1, torch.bfloat16, torch.float32, decode)[0]
    monkeypatch.setenv(AMX_ATTENTION_ENV, "0")
    assert not bf16_stream_step(t, torch.bfloat16, torch.float32, decode)[0]
    monkeypatch.delenv(AMX_ATTENTION_ENV)
    attn = PagedAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    attn.kv_cache = torch.zeros(2, KV_HEADS, 64, DIM, dtype=torch.bfloat16)
    rows = GroupMetadata(kv_slots=torch.zeros(1, 1, dtype=torch.long), key_mask=None, num_tokens=1)
    assert not attn.takes_bf16(AttentionMetadata(torch.arange(1), decode=rows, prefill=None))
