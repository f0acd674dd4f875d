"""Quantized KV formats (glmserve/kv/kv_format.py, `--kv-cache-dtype int8|fp8`): the rows' round-trip error,
bytes per token, the decode kernel on every backend against the PyTorch path, and the engine with int8 / fp8 KV
through prefix caching, the disk tier, sessions, running offload and block-sparse decode; a chunk or session
written in one KV format is never read in another; the MLA latent cache refuses them clearly."""

from __future__ import annotations

import pytest
import torch
from parity import assert_same_output, reference_decode

from glmserve import LLM, SamplingParams, kernels
from glmserve.config import EngineConfig
from glmserve.errors import InvalidRequestError, UnsupportedKVFormatError
from glmserve.kv.kv_format import FP8_MAX, INT8_MAX, default_kv_format, dequantize, format_of, kv_format, store
from glmserve.kv.kv_io import kv_identity
from glmserve.layers.partial_attention import paged_attention_with_lse
from glmserve.models.gguf_loader import embedded_default_gguf, load_gguf

# float32 prefill on every CPU (conftest.py): the offload test compares offloaded rows (float32 attention,
# tests/test_kv_offload.py) with a resident engine, and the formats' comparisons then do not depend on AMX
pytestmark = pytest.mark.usefixtures("float32_prefill")

QUANTIZED = ["int8", "fp8"]


# -- rows ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_error_is_within_half_a_code(name):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 64, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]  # rows of every scale
    x[3] = 0  # all-zero rows stay zero
    x[5, 1, 7] = 500.0  # an outlier only costs its own row
    fmt = kv_format(name)
    rows = fmt.quantize(x)
    assert rows.dtype == fmt.storage and rows.shape == (64, 4, 66) and format_of(rows) is fmt
    y = dequantize(rows, torch.float32)
    absmax = x.abs().amax(-1, keepdim=True)
    err = (y - x).abs()
    if name == "int8":  # uniform codes: half a step, plus the float16 scale's rounding at the top code
        bound = absmax / INT8_MAX * 0.5 + absmax * 2**-10
    else:  # E4M3: 3 mantissa bits (half an ulp is 1/16 relative), subnormal steps of scale * 2^-9
        bound = x.abs() / 16 + absmax / FP8_MAX * 2**-10 + absmax * 2**-10
    assert (err <= bound + 1e-30).all()
    assert y[3].abs().max() == 0
    assert torch.equal(y[5, 0], dequantize(fmt.quantize(x[5, 0]), torch.float32))  # per (token, head) scale
    assert torch.equal(fmt.quantize(y), rows)  # re-quantizing what a reader sees gives the same bytes


def test_bytes_per_token_are_about_half_of_bfloat16_scales_counted():
    config = load_gguf(embedded_default_gguf()).config  # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64
    from glmserve.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(config, 64)
    per_row = {name: kv_format(name).bytes_per_row(64) for name in ("float32", "bfloat16", "int8", "fp8")}
    assert per_row == {"float32": 256, "bfloat16": 128, "int8": 66, "fp8": 66}  # 64 codes + a float16 scale
    rows_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads
    for name, size in per_row.items():
        assert model.kv_bytes_per_token(name) == rows_per_token * size
    assert model.kv_bytes_per_token("int8") / model.kv_bytes_per_token(torch.bfloat16) == 66 / 128
    pool = model.bind_kv_cache(32, "fp8", torch.device("cpu"), zero_slots=16)
    assert pool.dtype == torch.uint8 and pool.shape == (30, 2, 3, 32, 66)
    assert pool.numel() * pool.element_size() == 32 * model.kv_bytes_per_token("fp8")


def test_chunk_identity_names_the_kv_format():
    ids = {f: kv_identity("m", torch.float32, f, 4, [(8, 16)]) for f in ("float32", "bfloat16", "int8", "fp8")}
    assert len(set(ids.values())) == 4
    assert ids["float32"] == kv_identity("m", torch.float32, torch.float32, 4, [(8, 16)])


def test_bad_kv_format_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="KV cache format"):
        kv_format("int4")
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    assert kv_format("fp8_e4m3") is kv_format("fp8") and kv_format(torch.bfloat16).name == "bfloat16"


def test_auto_is_int8_on_cpu_where_attention_reads_int8_rows(tiny_model_dir):
    """`--kv-cache-dtype auto` for a float32 model on CPU: int8 where the model's attention reads quantized rows and
    the C++ decode kernel is built, else bf16 (the MLA latent cache: tests/test_kv_tiers.py runs a tiny GLM-5 on
    auto); other dtypes keep theirs."""
    cpu = torch.device("cpu")
    kernel = kernels.op("paged_decode", cpu, torch.float32) is not None
    llm = LLM(model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory_bytes=1 << 20)
    assert llm.engine.kv_format.name == ("int8" if kernel else "bfloat16")
    assert llm.engine.runner.kv_cache.dtype == (torch.int8 if kernel else torch.bfloat16)
    assert default_kv_format(torch.float32, cpu, quantized_ok=False).name == "bfloat16"
    assert default_kv_format(torch.bfloat16, cpu).name == "bfloat16"


@pytest.mark.parametrize("bf16_attention", ["0", "1"])  # float32 prefill; bf16 on AMX CPUs (their default)
def test_one_prefill_attends_to_the_stored_rows_as_chunks_do(tiny_model_dir, bf16_attention, monkeypatch):
    """A prompt prefilled in one step attends to its K/V as the pool stores them (quantized, dequantized), as a chunk
    over cached context reads them: chunks of 168 + 32 tokens give the prefill's next-token logprobs bit for bit as
    one step of 200 (the rows take the same attention kernels either way: 128+ keys; the decode steps after may differ
    by the linears' rounding at 32 rows against 200)."""
    monkeypatch.setenv("GLMSERVE_BF16_ATTENTION", bf16_attention)
    prompt, first = _prompt(7, 200), SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    outs = []
    for chunk in (256, 168):
        llm = _llm(tiny_model_dir, "int8", max_num_batched_tokens=chunk, enable_prefix_caching=False)
        out = llm.generate([prompt], first)[0].outputs[0]
        outs.append((out.token_ids, out.logprobs[0].logprob, out.logprobs[0].top))
    assert outs[1] == outs[0]


@pytest.mark.parametrize("name", QUANTIZED)
def test_mla_latent_cache_refuses_quantized_kv(name):
    from transformers import GlmMoeDsaConfig

    from glmserve.models.glm_moe_dsa import GlmMoeDsaForCausalLM

    config = GlmMoeDsaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                             first_k_dense_replace=1, index_topk=4, index_n_heads=2, index_head_dim=8,
                             max_position_embeddings=128)
    model = GlmMoeDsaForCausalLM(config, 128)
    for call in (lambda: model.kv_bytes_per_token(name), lambda: model.bind_kv_cache(16, name, torch.device("cpu"))):
        with pytest.raises(UnsupportedKVFormatError, match="MLA latent cache"):
            call()
    assert model.bind_kv_cache(16, "bfloat16", torch.device("cpu")).dtype == torch.bfloat16


# -- decode attention: every kernel backend --------------------------------------------------------------------

@pytest.mark.parametrize("name", QUANTIZED)
def test_decode_attention_on_quantized_kv(name, kernel_backend):
    """The backend's decode over a quantized pool equals attention over the dequantized keys and values (the
    C++ kernels dequantize in place), and stays close to attention over the float KV."""
    gen = torch.Generator().manual_seed(1)
    b, h, hkv, d, slots_n = 4, 8, 2, 64, 96
    q = torch.randn(b, h, d, generator=gen)
    k, v = torch.randn(slots_n, hkv, d, generator=gen), torch.randn(slots_n, hkv, d, generator=gen)
    slots = torch.randint(1, slots_n, (b, 40), generator=gen)
    lengths = torch.tensor([40, 1, 17, 33])
    fmt = kv_format(name)
    cache = torch.zeros(2, hkv, slots_n, fmt.row_width(d), dtype=fmt.storage)
    store(cache[0], torch.arange(slots_n), k)
    store(cache[1], torch.arange(slots_n), v)
    out, lse = paged_attention_with_lse(q, cache, slots, lengths, d**-0.5)
    seen = dequantize(cache, torch.float32)
    want, want_lse = reference_decode(q, seen[0], seen[1], slots, lengths, d**-0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    exact, _ = reference_decode(q, k.transpose(0, 1), v.transpose(0, 1), slots, lengths, d**-0.5)
    assert (out - exact).abs().max() < (0.02 if name == "int8" else 0.1)


# -- engine (tiny random Llama) -------------------------------------------------------------------------------

BS, CHUNK = 4, 16
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(tiny_model_dir, kv: str, **kw) -> LLM:
    kw = {"max_model_len": 256, "max_num_batched_tokens": 64, **kw}
    return LLM(model=str(tiny_model_dir("llama")), dtype="float32", block_size=BS, kv_cache_dtype=kv,
               kv_chunk_tokens=CHUNK, **kw)


@pytest.mark.parametrize("name", QUANTIZED)
def test_engine_with_quantized_kv_follows_float_kv(tiny_model_dir, name, kernel_backend):
    """Chunked prefill (64-token steps), then decode against the quantized pool: the same greedy tokens as
    float KV and top logprobs close; a prefix-cache hit reuses the quantized blocks and gives the same output
    exactly (the bytes are the ones the first run wrote)."""
    ref = _llm(tiny_model_dir, "float32")
    llm = _llm(tiny_model_dir, name)
    assert llm.engine.runner.kv_cache.dtype == kv_format(name).storage
    prompts = [_prompt(1, 150), _prompt(2, 40), _prompt(3, 9)]
    outs = llm.generate(prompts, PARAMS)
    for got, want in zip(outs, ref.generate(prompts, PARAMS)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for x, y in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert abs(x.logprob - y.logprob) < (0.01 if name == "int8" else 0.05)
    again = llm.generate([prompts[0]], PARAMS)[0]
    assert again.num_cached_tokens == 148  # whole blocks of the prompt
    assert_same_output(again, outs[0], tol=1e-5)


def test_disk_tier_chunks_under_int8_and_never_across_formats(tiny_model_dir, tmp_path):
    """A prefix evicted from a small int8 pool to disk comes back (with its scales) and gives the cold int8
    output; an engine with float32 KV on the same disk directory never loads those chunks."""
    disk = str(tmp_path / "kv")
    # a block: 4 tokens of int8 KV (144 B each) and the block indexer's bounds (512 B): a pool of 36 blocks
    small = dict(kv_disk_dir=disk, kv_cache_memory_bytes=36 * (BS * 144 + 512), max_model_len=128)
    llm = _llm(tiny_model_dir, "int8", **small)
    cold = _llm(tiny_model_dir, "int8", enable_prefix_caching=False, max_model_len=128)
    a, b = _prompt(4, 100), _prompt(5, 124)
    want = cold.generate([a], PARAMS)[0]
    assert_same_output(llm.generate([a], PARAMS)[0], want, tol=1e-5)
    llm.generate([b], PARAMS)  # evicts most of a: its chunks go to disk
    tiers = llm.engine.kv.tiers
    tiers.wait()
    assert tiers.stats.saved_chunks >= 3
    second = llm.generate([a], PARAMS)[0]
    assert second.num_cached_tokens == 96 and tiers.stats.loaded_chunks >= 3 and tiers.stats.failed_loads == 0
    assert_same_output(second, want, tol=1e-5)

    other = _llm(tiny_model_dir, "float32", kv_disk_dir=disk, max_model_len=128)
    assert other.engine.kv.identity != llm.engine.kv.identity
    out = other.generate([a], PARAMS)[0]
    assert out.num_cached_tokens == 0 and other.engine.kv.tiers.stats.loaded_chunks == 0
    float_cold = _llm(tiny_model_dir, "float32", enable_prefix_caching=False, max_model_len=128)
    assert_same_output(out, float_cold.generate([a], PARAMS)[0])


def test_session_saved_under_int8_restores_in_another_engine_not_in_another_format(tiny_model_dir, tmp_path):
    store_dir = str(tmp_path / "sessions")
    first, second = (_llm(tiny_model_dir, "int8", session_store=store_dir).engine for _ in range(2))
    turn1 = _prompt(6, 50)
    out1 = _run(first, turn1, session_id="conv")
    first.kv.sessions.wait("conv")
    turn2 = turn1 + out1.outputs[0].token_ids + _prompt(7, 30)
    # the reference: the first engine's prefix cache holds the same int8 rows (turn 1's generated tokens were
    # written by decode steps; a cold prefill's float rounding may move a value across a code boundary)
    same_rows = _run(first, turn2)
    resumed = _run(second, turn2, session_id="conv")
    assert resumed.num_cached_tokens == 52 and same_rows.num_cached_tokens == 52
    assert_same_output(resumed, same_rows, tol=1e-5)
    float_engine = _llm(tiny_model_dir, "float32", session_store=store_dir).engine
    assert _run(float_engine, turn2, session_id="conv").num_cached_tokens == 0
    for engine in (first, second, float_engine):
        engine.close()


def _run(engine, prompt: list[int], session_id: str | None = None, salt: str | None = None):
    engine.add_request(f"r{len(engine.requests)}-{salt}-{session_id}-{len(prompt)}", prompt, PARAMS,
                       cache_salt=salt, session_id=session_id)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return final


def test_running_offload_with_int8_kv_matches_the_resident_pool(tiny_model_dir, tmp_path, kernel_backend):
    """Sequences longer than a ~60-token int8 pool: chunks leave the pool (as int8 rows with their scales) and
    stream back through attention; the output follows an int8 engine whose pool holds everything."""
    prompts = [_prompt(8, 200), _prompt(9, 120)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    offloading = _llm(tiny_model_dir, "int8", kv_disk_dir=str(tmp_path / "kv"), max_num_batched_tokens=16,
                      kv_cache_memory_bytes=(14 + 1) * BS * (144 + 128))  # 14 blocks of KV + block bounds
    resident = _llm(tiny_model_dir, "int8", max_num_batched_tokens=16)
    for got, want in zip(offloading.generate(prompts, params), resident.generate(prompts, params)):
        assert_same_output(got, want, tol=1e-3)  # the same int8 rows, merged by log-sum-exp chunk by chunk
    stats = offloading.engine.kv.offload.stats
    assert stats.offloaded_chunks >= 8 and stats.read_slices > 0


@pytest.mark.parametrize("name", QUANTIZED)
def test_block_sparse_bounds_bound_the_dequantized_keys(tiny_model_dir, name):
    """The block indexer's bounds are the exact min / max of the keys attention reads back (dequantized), after
    a prefill and after KV loaded straight into the pool; a budget covering the context equals dense."""
    llm = _llm(tiny_model_dir, name, sparse_block_bounds=True)
    p = _prompt(10, 120)
    dense = llm.generate([p], PARAMS)[0]
    sparse = llm.generate([p], PARAMS, sparse={"mode": "block", "top_k": 256, "sink_tokens": 4, "local_tokens": 16})[0]
    assert_same_output(sparse, dense, tol=1e-5)
    table = llm.engine.kv.blocks.hash_to_block
    blocks = torch.tensor(sorted(set(table.values()))[:20])
    for layer in llm.engine.runner.model.paged_attention_layers():
        indexer = layer.indexers["block"]
        slots = (blocks[:, None] * BS + torch.arange(BS)).reshape(-1)
        keys = dequantize(layer.kv_cache[0][:, slots], torch.float32).view(layer.num_kv_heads, len(blocks), BS, -1)
        assert torch.equal(indexer.bounds[blocks, 0], keys.amin(2).transpose(0, 1))
        assert torch.equal(indexer.bounds[blocks, 1], keys.amax(2).transpose(0, 1))
        indexer.bounds[blocks] = 0
    llm.engine.kv.io.scatter(blocks, llm.engine.kv.io.gather(blocks))  # a load: listeners refresh the bounds
    for layer in llm.engine.runner.model.paged_attention_layers():
        slots = (blocks[:, None] * BS + torch.arange(BS)).reshape(-1)
        keys = dequantize(layer.kv_cache[0][:, slots], torch.float32).view(layer.num_kv_heads, len(blocks), BS, -1)
        assert torch.equal(layer.indexers["block"].bounds[blocks, 1], keys.amax(2).transpose(0, 1))


# -- the embedded model (SmolLM2-135M GGUF) -------------------------------------------------------------------

SMOL_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "用一句话介绍你自己。",
                "List three prime numbers.", "Explain what a hash table is in two sentences."]
SMOL_TOKENS = 32
AGREE_AT_LEAST = 16  # measured (32 tokens): int8 [32, 32, 0 (a near-tie), 32, 32], fp8 [32, 21, 13, 29, 31]
NEAR_TIE = 0.5  # a divergence before AGREE_AT_LEAST must be where float KV's top-2 logprobs are this close


@pytest.mark.parametrize("name", QUANTIZED)
def test_smollm2_greedy_with_quantized_kv_agrees_with_float_kv(smollm2, name):
    # float weights like the `smollm2` fixture's, so that only the KV format differs
    quant = LLM(model=None, dtype="float32", quantization="none", kv_cache_dtype=name, max_num_seqs=16,
                max_num_batched_tokens=512,
                max_model_len=2048, kv_cache_memory_bytes=64 << 20)
    prompts = [smollm2.engine.apply_chat_template([{"role": "user", "content": p}]) for p in SMOL_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=SMOL_TOKENS, logprobs=2, ignore_eos=True)
    agreed = []
    for got, want in zip(quant.generate(prompts, params), smollm2.generate(prompts, params)):
        a, b = got.outputs[0], want.outputs[0]
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        agreed.append(first)
        if first < AGREE_AT_LEAST:
            top = b.logprobs[first].top
            assert top[0][1] - top[1][1] < NEAR_TIE, f"{name} diverged at token {first} of {b.token_ids}"
    print(f"{name}: leading tokens equal to float KV per prompt: {agreed}")
    assert sum(agreed) >= len(prompts) * AGREE_AT_LEAST
