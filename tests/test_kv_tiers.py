"""KV chunks in tiers: the disk chunk store on real files (atomic writes, checksums, LRU budget, restart,
disk full), batched KV block I/O for both pool layouts (Llama head-major, MLA latent + indexer keys), stable
block hashes, and the engine: a prefix evicted from a tiny device pool to disk is loaded back, counted as
cached, and gives the same tokens and logprobs as a cold run; a corrupted chunk file is recomputed and
removed."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest
import torch
from parity import assert_same_output
from transformers import GlmMoeDsaConfig, LlamaConfig

from glmserve.kv.blocks import block_hash
from glmserve.kv.chunk_store import TEMP_SUFFIX, DiskChunkStore
from glmserve.kv.kv_io import KVBlockIO, kv_identity
from glmserve.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from glmserve.models.llama import LlamaForCausalLM

# -- disk chunk store ----------------------------------------------------------------------------------------


def _files(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_put_get_delete_and_restart(tmp_path):
    store = DiskChunkStore(tmp_path, budget=1 << 20)
    assert store.put("a", b"alpha" * 100) and store.put("b/with:odd key ✓", b"beta")
    assert store.get("a") == b"alpha" * 100 and store.get("b/with:odd key ✓") == b"beta"
    assert "a" in store and store.get("missing") is None
    assert store.put("a", b"replaced") and store.get("a") == b"replaced"
    used = store.nbytes
    assert used == sum(os.path.getsize(tmp_path / n) for n in _files(tmp_path))
    again = DiskChunkStore(tmp_path, budget=1 << 20)  # a restart: the index is rebuilt from the files
    assert sorted(again.keys()) == sorted(["a", "b/with:odd key ✓"]) and again.nbytes == used
    assert again.get("a") == b"replaced"
    again.delete("a")
    assert "a" not in again and again.get("a") is None and len(_files(tmp_path)) == 1


def test_lru_eviction_under_budget(tmp_path):
    store = DiskChunkStore(tmp_path, budget=3 * (1000 + 64))
    for key in "abc":
        assert store.put(key, bytes(1000))
    assert store.get("a") is not None  # a is now the most recently used
    assert store.put("d", bytes(1000))
    assert sorted(store.keys()) == ["a", "c", "d"] and store.nbytes <= store.budget
    assert not store.put("huge", bytes(4000))  # never fits: nothing evicted for it, nothing written
    assert sorted(store.keys()) == ["a", "c", "d"] and len(_files(tmp_path)) == 3
    restarted = DiskChunkStore(tmp_path, budget=2 * (1000 + 64))  # smaller budget: the oldest goes
    assert restarted.keys() == ["a", "d"] and len(_files(tmp_path)) == 2


def test_corrupt_truncated_and_temp_files_are_never_returned(tmp_path):
    store = DiskChunkStore(tmp_path, budget=1 << 20)
    for key in ("flip", "cut", "good"):
        store.put(key, os.urandom(4096))
    flip, cut = store._path("flip"), store._path("cut")
    raw = bytearray(flip.read_bytes())
    raw[-100] ^= 0xFF
    flip.write_bytes(bytes(raw))
    cut.write_bytes(cut.read_bytes()[:-1])
    assert store.get("flip") is None and store.get("cut") is None  # checksum / length caught it
    assert not flip.exists() and not cut.exists() and store.keys() == ["good"]
    # a writer killed mid-write leaves only a temp file: a restart removes it, and it is never an entry
    leftover = tmp_path / ("x" * 40 + ".chunk.123.456" + TEMP_SUFFIX)
    leftover.write_bytes(b"half-written")
    (tmp_path / ("y" * 40 + ".chunk")).write_bytes(b"not a chunk")
    restarted = DiskChunkStore(tmp_path, budget=1 << 20)
    assert restarted.keys() == ["good"] and _files(tmp_path) == [store._path("good").name]


def test_killed_writer_leaves_old_entry_or_nothing(tmp_path):
    """A real process killed (SIGKILL) while writing big entries in a loop: every entry that a new store
    finds is whole and verified."""
    code = (
        "import sys; from glmserve.kv.chunk_store import DiskChunkStore\n"
        "s = DiskChunkStore(sys.argv[1], 1 << 30)\n"
        "i = 0\n"
        "while True:\n"
        "    s.put(f'k{i % 3}', bytes([i % 251]) * (8 << 20)); i += 1; print(i, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    for _ in range(4):
        proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = DiskChunkStore(tmp_path, budget=1 << 30)
    assert store.keys() and not [n for n in _files(tmp_path) if n.endswith(TEMP_SUFFIX)]
    for key in store.keys():
        data = store.get(key)
        assert data is not None and len(data) == 8 << 20 and data == data[:1] * len(data)


def test_disk_full_leaves_nothing_half_written(tmp_path):
    """The OS refuses the write (file size limit, EFBIG: the same path as ENOSPC): put is False, no temp
    file and no entry are left, and the store keeps working once space is back."""
    store = DiskChunkStore(tmp_path, budget=1 << 30)
    assert store.put("small", b"x" * 100)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))
    try:
        assert not store.put("big", bytes(1 << 20))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert store.keys() == ["small"] and _files(tmp_path) == [store._path("small").name]
    assert store.put("big", bytes(1 << 20)) and store.get("big") == bytes(1 << 20)


# -- block hashes and KV block I/O ---------------------------------------------------------------------------


def test_block_hash_is_stable_across_processes():
    code = "from glmserve.kv.blocks import block_hash; print(block_hash(block_hash(None, [1, 2], 's'), [3, 4], 's'))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert outs == {f"{block_hash(block_hash(None, [1, 2], 's'), [3, 4], 's')}\n"}
    assert block_hash(None, [1, 2], None) != block_hash(None, [1, 2], "") != block_hash(None, [2, 1], "")
    assert 0 <= block_hash(None, [1], None) < 1 << 128


def _llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config, 128)


def _dsa() -> GlmMoeDsaForCausalLM:
    config = GlmMoeDsaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                             first_k_dense_replace=1, index_topk=4, index_n_heads=2, index_head_dim=8,
                             max_position_embeddings=128, indexer_types=["full", "shared", "full"])
    return GlmMoeDsaForCausalLM(config, 128)


@pytest.mark.parametrize("make", [_llama, _dsa], ids=["llama", "glm_moe_dsa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_io_roundtrip_any_layout(make, dtype):
    model, bs, num_blocks = make(), 4, 12
    pool = model.bind_kv_cache(num_blocks * bs, dtype, torch.device("cpu"), zero_slots=bs)
    pool.copy_(torch.randn(pool.shape).to(dtype))
    io = KVBlockIO(model, pool, bs, num_blocks * bs)
    assert io.bytes_per_block == bs * model.kv_bytes_per_token(dtype)
    loaded = []
    io.add_load_listener(lambda blocks: loaded.append(blocks.tolist()))
    before = pool.clone()
    src, dst = torch.tensor([3, 1, 7]), torch.tensor([9, 10])
    data = io.from_bytes(io.to_bytes(io.gather(src)))
    io.scatter(dst, data, first=1)  # blocks 1 and 7 of the run into 9 and 10
    assert loaded == [[9, 10]]
    views, old = io.views, KVBlockIO(model, before, bs, num_blocks * bs).views
    for v, o in zip(views, old):
        blk = v.view(v.shape[0], num_blocks, bs, v.shape[2])
        ref = o.view(o.shape[0], num_blocks, bs, o.shape[2])
        assert torch.equal(blk[:, 9], ref[:, 1]) and torch.equal(blk[:, 10], ref[:, 7])
        untouched = [b for b in range(num_blocks) if b not in (9, 10)]
        assert torch.equal(blk[:, untouched], ref[:, untouched])
    io.scatter(dst[:0], data, first=3)  # nothing left to load: no copy, no listener call
    assert loaded == [[9, 10]]
    assert io.from_bytes(b"\0" * (io.bytes_per_block + 1)) is None
    ids = {kv_identity("m", torch.float32, dtype, bs, io.layout), kv_identity("m", torch.float32, dtype, 8, io.layout),
           kv_identity("other", torch.float32, dtype, bs, io.layout)}
    assert len(ids) == 3


# -- engine: the prefix cache spans device, host and disk --------------------------------------------------

BS, CHUNK = 4, 16  # 4 blocks per chunk
# the tiny llama's KV per token in bf16 (pinned in _setup; int8 tiers: tests/test_kv_quant.py), the tiny GLM-5's: 304
TOKEN_BYTES = 256


def _chunk_hashes(tokens: list[int]) -> list[int]:
    hashes, parent = [], None
    for start in range(0, len(tokens) - BS + 1, BS):
        parent = block_hash(parent, tokens[start:start + BS], None)
        hashes.append(parent)
    return hashes[CHUNK // BS - 1::CHUNK // BS]


def _device_prefix_blocks(llm, tokens: list[int]) -> int:
    parent, n = None, 0
    for start in range(0, len(tokens) - BS + 1, BS):
        parent = block_hash(parent, tokens[start:start + BS], None)
        if parent not in llm.engine.kv.blocks.hash_to_block:
            break
        n += 1
    return n


def _setup(tiny_model_dir, model_dir=None, **tiers):
    """An engine with a tiny device pool and the given tiers, the cold reference output of prompt a, and
    prompt b that evicts most of a."""
    from glmserve import LLM, SamplingParams

    common = dict(model=str(model_dir or tiny_model_dir("llama")), dtype="float32", kv_cache_dtype="bfloat16",
                  block_size=BS, max_model_len=128, max_num_batched_tokens=64)
    # TOKEN_BYTES of KV per token: a pool of ~36-45 blocks (with or without block-indexer
    # bounds), so the second prompt evicts most of the first
    llm = LLM(**common, kv_cache_memory_bytes=36 * 5 * TOKEN_BYTES, kv_chunk_tokens=CHUNK, **tiers)
    cold = LLM(**common, enable_prefix_caching=False)
    rng = torch.Generator().manual_seed(0)
    a = torch.randint(2, 300, (100,), generator=rng).tolist()
    b = torch.randint(2, 300, (124,), generator=rng).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    return llm, cold.generate([a], params)[0], a, b, params


@pytest.mark.parametrize(("host_chunks", "disk"), [(0, True), (2, True), (7, False)], ids=["disk", "host+disk", "host"])
def test_evicted_prefix_comes_back_from_lower_tiers(tiny_model_dir, tmp_path, host_chunks, disk):
    """host: 7 chunks of room; loading the prefix's 6 back spills the other prompt's chunks, which push the
    prefix's own out of the host tier while it loads (held copies keep them usable)."""
    llm, ref, a, b, params = _setup(tiny_model_dir, kv_disk_dir=str(tmp_path / "kv") if disk else None,
                                    kv_host_memory_bytes=host_chunks * CHUNK * TOKEN_BYTES)
    tiers = llm.engine.kv.tiers

    first = llm.generate([a], params)[0]
    assert first.num_cached_tokens == 0
    assert_same_output(first, ref)
    llm.generate([b], params)  # evicts the tail of a first: its chunks go down
    tiers.wait()  # the disk writer thread
    assert tiers.stats.saved_chunks >= 3 and _device_prefix_blocks(llm, a) < 24
    if disk:
        assert len(list((tmp_path / "kv").iterdir())) == tiers.stats.saved_chunks - host_chunks

    second = llm.generate([a], params)[0]
    assert second.num_cached_tokens == 96  # 6 whole chunks: device hits + chunks loaded back
    assert tiers.stats.loaded_chunks >= 3 and tiers.stats.failed_loads == 0
    assert_same_output(second, ref)
    if not disk:
        return

    # corrupt the first chunk the next run needs from disk: it is recomputed and its file removed
    llm.generate([b], params)
    tiers.wait()
    if host_chunks:
        tiers.host.chunks.clear()
        tiers.host.index = type(tiers.host.index)()
    on_device = _device_prefix_blocks(llm, a)
    needed = _chunk_hashes(a)[on_device // (CHUNK // BS)]
    chunk_file = tiers.disk._path(tiers.key(needed))
    raw = bytearray(chunk_file.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    chunk_file.write_bytes(bytes(raw))
    third = llm.generate([a], params)[0]
    assert third.num_cached_tokens == on_device * BS and tiers.stats.failed_loads == 1
    assert not chunk_file.exists()
    assert_same_output(third, ref)


def test_full_disk_tier_still_answers(tiny_model_dir, tmp_path):
    """A disk budget smaller than one chunk: every write is refused, nothing is left in the directory, and
    the requests answer as a cold run does (the evicted prefix is recomputed)."""
    llm, ref, a, b, params = _setup(tiny_model_dir, kv_disk_dir=str(tmp_path), kv_disk_bytes=CHUNK * TOKEN_BYTES)
    tiers = llm.engine.kv.tiers
    assert_same_output(llm.generate([a], params)[0], ref)
    llm.generate([b], params)
    tiers.wait()
    assert tiers.stats.saved_chunks >= 3 and list(tmp_path.iterdir()) == []
    on_device = _device_prefix_blocks(llm, a)
    again = llm.generate([a], params)[0]
    assert again.num_cached_tokens == on_device * BS < 96 and tiers.stats.loaded_chunks == 0
    assert_same_output(again, ref)


def test_tier_options_from_cli_and_bad_values(tmp_path):
    from glmserve.cli import build_parser, engine_config_from_args
    from glmserve.config import EngineConfig
    from glmserve.errors import InvalidRequestError
    from glmserve.kv.tiers import build_tiers

    args = build_parser().parse_args(["generate", "--kv-disk-dir", str(tmp_path), "--kv-disk-bytes", "1000000",
                                      "--kv-host-memory-bytes", "0", "--kv-chunk-tokens", "64", "hi"])
    config = engine_config_from_args(args)
    assert (config.kv_disk_dir, config.kv_disk_bytes, config.kv_host_memory_bytes, config.kv_chunk_tokens) == (
        str(tmp_path), 1000000, 0, 64)
    with pytest.raises(InvalidRequestError, match="kv_chunk_tokens"):
        EngineConfig(kv_chunk_tokens=24)  # not a multiple of block_size 16
    with pytest.raises(InvalidRequestError, match="kv_disk_bytes"):
        EngineConfig(kv_disk_bytes=0)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    model = _llama()
    io = KVBlockIO(model, model.bind_kv_cache(64, torch.float32, torch.device("cpu")), 4, 64)
    with pytest.raises(InvalidRequestError, match="kv_disk_dir"):
        build_tiers(io, "id", 16, 0, str(a_file / "sub"), 1 << 20)
    assert build_tiers(io, "id", 16, 0, None, 1 << 20) is None  # no tier asked for (CPU: no host tier)


def test_mla_prefix_comes_back_from_disk(tiny_model_dir, tmp_path):
    """GLM-5 (MLA latent rows + DSA indexer keys in one flat pool): the same round trip through the disk."""
    from test_glm_moe_dsa import make_model

    model_dir = make_model("glm_moe_dsa", tmp_path / "model")
    llm, ref, a, b, params = _setup(tiny_model_dir, model_dir, kv_disk_dir=str(tmp_path / "kv"))
    tiers = llm.engine.kv.tiers
    llm.generate([a], params)
    llm.generate([b], params)
    tiers.wait()
    again = llm.generate([a], params)[0]
    assert again.num_cached_tokens == 96 and tiers.stats.loaded_chunks >= 3
    assert_same_output(again, ref)
