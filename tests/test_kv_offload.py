"""Sequences longer than the KV pool: old chunks leave the pool and read back through attention
(glmserve/kv/offload.py), checked against transformers' reference on the whole context."""

from __future__ import annotations

import pytest
import torch
from parity import assert_same_output, check_against_reference
from transformers import AutoModelForCausalLM

from glmserve import LLM, SamplingParams
from glmserve.errors import InvalidRequestError
from glmserve.layers.partial_attention import attention_with_lse, merge_attention
from glmserve.sparse.block import block_bounds_bytes
from glmserve.sparse.pinning import QuestionObservation

# the offloaded rows' attention runs in float32 (layers/attention.py): the resident engines they are compared with
# too, on AMX CPUs as well (there a chunk over 128+ cached keys takes bf16)
pytestmark = pytest.mark.usefixtures("float32_prefill")

BS, CHUNK, STEP = 4, 16, 16  # block size, chunk tokens, prefill tokens per step
KV = "float32"  # not the CPU default int8: pool sizes below count float32 rows, and outputs meet transformers' float32
POOL_BLOCKS = 14  # 56 tokens: the first chunk, a chunk filling up, a step's tokens and a block (52) fit


def _pool_bytes(model_dir, blocks: int, kv: str = KV) -> int:
    """A KV budget of `blocks` usable blocks (K/V and block-indexer bounds, in KV format `kv`) plus the null
    block."""
    probe = LLM(model=str(model_dir), dtype="float32", kv_cache_dtype=kv, block_size=BS, max_model_len=64).engine
    bounds = block_bounds_bytes(probe.runner.model.paged_attention_layers(), probe.runner.kv_cache.dtype)
    return (blocks + 1) * (probe.kv.io.bytes_per_block + bounds)


def _engine(model_dir, tmp_path, **kw) -> LLM:
    """An engine on a pool of POOL_BLOCKS blocks offloading to tmp_path (unless `kw` says otherwise)."""
    kw.setdefault("kv_cache_dtype", KV)
    kw.setdefault("kv_cache_memory_bytes", _pool_bytes(model_dir, POOL_BLOCKS, kw["kv_cache_dtype"]))
    kw.setdefault("max_model_len", 400)
    return LLM(model=str(model_dir), dtype="float32", block_size=BS, kv_chunk_tokens=CHUNK,
               max_num_batched_tokens=STEP, kv_disk_dir=str(tmp_path / "kv"), **kw)


@pytest.fixture(scope="module")
def hf_llama(tiny_model_dir):
    path = tiny_model_dir("llama")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(lengths, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 300, (n,), generator=gen).tolist() for n in lengths]


def test_sequences_longer_than_the_pool_match_the_reference(hf_llama, tmp_path, kernel_backend):
    """Three prompts of 150-260 tokens on a pool of ~60 tokens, decoded together: every prefill chunk and
    decode step attends to chunks streamed back from disk; top-5 logprobs of 24 steps match transformers."""
    path, hf_model = hf_llama
    llm = _engine(path, tmp_path)
    engine = llm.engine
    assert engine.kv.blocks.num_usable_blocks == POOL_BLOCKS
    prompts = _prompts((260, 150, 9))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        check_against_reference(hf_model, prompt, out.outputs[0])
    offload = engine.kv.offload
    assert offload.stats.offloaded_chunks >= (260 + 24) // CHUNK - 3
    assert offload.stats.read_slices > 0
    # nothing left behind: no spans, no bytes outside the pool, every block back
    assert not offload.spans and offload.disk_used == 0 and offload.stats.offloaded_bytes == 0
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_chunks_are_dropped_on_abort_and_prefix_of_a_streamed_prompt_is_reused(hf_llama, tmp_path):
    path, hf_model = hf_llama
    llm = _engine(path, tmp_path)
    engine = llm.engine
    prompt = _prompts((220,), seed=5)[0]
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    while not engine.kv.offload.spans:
        engine.step()
    engine.abort_request("long")
    assert not engine.kv.offload.spans and engine.kv.offload.disk_used == 0
    # the first chunk stayed resident and cached: the same prompt hits it
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    out = llm.generate([prompt], params)[0]
    assert out.num_cached_tokens >= CHUNK
    check_against_reference(hf_model, prompt, out.outputs[0])


@pytest.mark.timeout(120)
def test_prefix_loaded_back_as_large_as_the_pool_does_not_block_admission(hf_llama, tmp_path):
    """A 48-token prompt spilled to the disk tier, then a 250-token prompt extending it: its prefix comes back
    from disk and fills most of the pool; admission trims the hits instead of waiting forever for room."""
    path, hf_model = hf_llama
    llm = _engine(path, tmp_path)
    short, other, tail = _prompts((48, 52, 202), seed=9)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    llm.generate([short], params)
    llm.generate([other], params)  # evicts the short prompt's chunks: they go to the disk tier
    llm.engine.kv.tiers.wait()
    out = llm.generate([short + tail], params)[0]
    assert llm.engine.kv.tiers.stats.loaded_chunks >= 2 and out.num_cached_tokens >= CHUNK
    check_against_reference(hf_model, short + tail, out.outputs[0])


def test_pool_too_small_or_no_room_for_chunks_is_a_clear_error(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    with pytest.raises(InvalidRequestError, match="kv_disk_dir"):
        LLM(model=str(path), dtype="float32", kv_cache_dtype=KV, block_size=BS, max_model_len=400,
            kv_cache_memory_bytes=20_000)
    with pytest.raises(InvalidRequestError, match="offloading KV chunks needs at least"):
        _engine(path, tmp_path, kv_cache_memory_bytes=20_000)
    # a pool that holds max_model_len needs no offload, however small: no minimum applies
    small = _engine(path, tmp_path, max_model_len=40, kv_cache_memory_bytes=_pool_bytes(path, 11))
    assert small.engine.kv.blocks.num_usable_blocks * BS < 2 * CHUNK + STEP + BS and small.engine.kv.offload is None
    from test_glm_moe_dsa import make_model

    with pytest.raises(InvalidRequestError, match="kv_disk_dir"):  # MLA attention does not offload
        LLM(model=str(make_model("glm_moe_dsa", tmp_path / "glm5")), dtype="float32", kv_cache_dtype=KV, block_size=BS,
            max_model_len=400, kv_cache_memory_bytes=20_000, kv_disk_dir=str(tmp_path / "kv"))


@pytest.mark.parametrize("device", ["cpu", "generic"])
def test_partial_attention_merge_equals_attention_over_all_keys(device):
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.float64  # float64 takes the generic (tiled) path
    q, k, v = (torch.randn(shape, generator=gen, dtype=dtype) for shape in ((2, 6, 300, 16), (2, 2, 500, 16),
                                                                               (2, 2, 500, 16)))
    mask = torch.rand((2, 1, 300, 200), generator=gen) > 0.3
    mask[..., 0] = True
    out_a, lse_a = attention_with_lse(q, k[:, :, :200], v[:, :, :200], 0.25, mask)
    out_b, lse_b = attention_with_lse(q, k[:, :, 200:], v[:, :, 200:], 0.25)
    out, _ = merge_attention(out_a, lse_a, out_b, lse_b)
    full = torch.cat([mask, torch.ones((2, 1, 300, 300), dtype=torch.bool)], dim=-1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=0.25, enable_gqa=True)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize(("where", "top_k", "observe"), [("disk", 24, 0), ("host", 24, 0), ("disk", 56, 32)])
def test_block_sparse_streaming_reads_only_chunks_with_selected_blocks(hf_llama, tmp_path, monkeypatch, where,
                                                                       top_k, observe):
    """Block-sparse decode of a sequence whose KV streams: its offloaded blocks are scored from the bounds kept
    with each chunk, the question pins are chosen over the whole context (offloaded keys read back), the
    selection equals the one an engine holding the whole context makes (same tokens and logprobs), and chunks
    without a selected block are not read."""
    path, _ = hf_llama
    sparse = {"mode": "block", "top_k": top_k, "sink_tokens": 4, "local_tokens": 8, "observe_tokens": observe}
    observed = []  # each engine's votes over the whole context and the pins they chose
    assign = QuestionObservation.assign
    monkeypatch.setattr(QuestionObservation, "assign",
                        lambda self: (assign(self), observed.append((self.votes, self.sequences[0].sparse_pins))))
    prompt = _prompts((300,), seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    whole = LLM(model=str(path), dtype="float32", kv_cache_dtype=KV, block_size=BS, max_model_len=400,
                max_num_batched_tokens=STEP)
    want = whole.generate([prompt], params, sparse=sparse)[0]
    llm = _engine(path, tmp_path, kv_host_memory_bytes=(1 << 30) if where == "host" else 0)
    got = llm.generate([prompt], params, sparse=sparse)[0]
    assert_same_output(got, want)
    if observe:  # the offloaded keys were read back: the same votes everywhere, the same block of 16 pinned
        (whole_votes, whole_pins), (votes, pins) = observed
        assert torch.allclose(votes, whole_votes, atol=1e-5)
        assert pins.tolist() == whole_pins.tolist() and len(pins) == 16 // BS
    offload = llm.engine.kv.offload
    assert offload.stats.skipped_slices > 0 and offload.stats.read_slices > 0
    assert offload.host_used == 0 and offload.disk_used == 0  # dropped when the request finished
    assert (tmp_path / "kv" / "running").exists() == (where == "disk")  # host: no chunk went to disk


def test_http_prompt_longer_than_the_pool_and_stream_metrics(tmp_path):
    """A real server whose pool holds 480 tokens answers an 800-token prompt (the embedded SmolLM2); /metrics
    shows the chunks that went out and the slices read back, and nothing held once it is done."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from server_process import STARTUP_TIMEOUT_S, glmserve_process, wait_for

    kv_token_bytes = 30 * 2 * 3 * (64 + 2)  # SmolLM2-135M, int8 KV (the CPU default): codes + a 2-byte scale
    args = ["--max-model-len", "2048", "--kv-chunk-tokens", "64", "--max-num-batched-tokens", "256",
            "--kv-cache-memory-bytes", str(480 * kv_token_bytes), "--no-sparse-block-bounds",
            "--kv-disk-dir", str(tmp_path / "kv"), "--num-threads", "1", "--session-store", "off"]
    prompt = torch.randint(100, 40000, (800,), generator=torch.Generator().manual_seed(0)).tolist()
    with glmserve_process(args, tmp_path / "server.log") as process, \
            httpx.Client(base_url=process.base_url, timeout=300) as http:
        wait_for(lambda: http.get("/v1/health").status_code == 200, STARTUP_TIMEOUT_S, "readiness", process.log)
        response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == 800
        text = http.get("/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["glmserve_kv_stream_offloaded_chunks_total"] >= (800 - 480) // 64
    assert samples["glmserve_kv_stream_read_slices_total"] > 0
    assert samples["glmserve_kv_stream_bytes"] == 0  # the finished request's chunks are gone


def test_running_offload_with_bf16_kv_matches_the_resident_pool(hf_llama, tmp_path, kernel_backend):
    """bf16 KV: a sequence longer than the pool streams its offloaded bf16 chunks back through attention and
    follows a bf16 engine whose pool holds everything."""
    path, _ = hf_llama
    prompt = _prompts((300,), seed=11)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    resident = LLM(model=str(path), dtype="float32", kv_cache_dtype="bfloat16", block_size=BS, max_model_len=400,
                   max_num_batched_tokens=STEP)
    llm = _engine(path, tmp_path, kv_cache_dtype="bfloat16")
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    assert_same_output(llm.generate([prompt], params)[0], resident.generate([prompt], params)[0], tol=1e-3)
    stats = llm.engine.kv.offload.stats
    assert stats.offloaded_chunks > 0 and stats.read_slices > 0
