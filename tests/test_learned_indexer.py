"""Learned indexer (glmserve/sparse/learned.py, glmserve/training/indexer_distill.py): distillation on a tiny
random Llama, the teacher against transformers' attention weights, the file format, the paged pool of index keys in the
real engine (prefix-cache hits, chunked prefill), selection in "learned" mode, and `glmserve train-indexer`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import CORPUS

from glmserve.cli import main
from glmserve.config import EngineConfig
from glmserve.engine.llm_engine import LLMEngine
from glmserve.engine.sampling import SamplingParams
from glmserve.errors import IndexerMismatchError, InvalidRequestError
from glmserve.layers.attention import GroupMetadata
from glmserve.models.loader import load_model
from glmserve.sparse import learned
from glmserve.sparse.indexer import Indexer
from glmserve.sparse.learned import (
    DISTANCE_BUCKETS,
    INDEX_KEY_DTYPE,
    IndexerSpec,
    LearnedIndexer,
    LearnedIndexerWeights,
    ModelIdentity,
    default_indexer_path,
    distance_bucket,
    find_learned_indexer,
)
from glmserve.training.indexer_distill import DistillConfig, distill, kl_per_layer, teacher_window

pytestmark = pytest.mark.usefixtures("float32_prefill")  # exact comparisons: float32 prefill on every CPU

CPU = torch.device("cpu")
SMALL = DistillConfig(window=96, steps=40, dim=8, heads=2, lr=1e-2, queries_per_window=32, queries_per_step=32,
                      max_windows=5, heldout_windows=1, budget=16)


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama")), None, CPU, torch.float32)


@pytest.fixture(scope="module")
def token_stream(llama):
    text = " ".join(CORPUS[i % 4] + f" {i}" for i in range(160))
    return llama.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def trained(llama, token_stream, tiny_model_dir, tmp_path_factory):
    """Distilled on the tiny Llama and saved; (weights, report, path)."""
    weights, report = distill(llama.model, token_stream, SMALL)
    path = tmp_path_factory.mktemp("indexer") / "tiny.safetensors"
    weights.save(path)
    return weights, report, path


def test_teacher_target_is_head_mean_of_transformers_attention(llama, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(2, 320, (40,), generator=torch.Generator().manual_seed(1))
    query_pos = torch.tensor([5, 17, 39])
    window = teacher_window(llama.model, ids, query_pos)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")), attn_implementation="eager")
    with torch.no_grad():
        attn = ref(ids[None], output_attentions=True).attentions  # per layer [1, H, T, T]
    expected = torch.stack([a[0].mean(0)[query_pos] for a in attn])
    torch.testing.assert_close(window.target, expected, atol=1e-5, rtol=1e-4)
    assert torch.all(window.target[:, 0, 6:] == 0)  # nothing past the query


def test_distance_buckets():
    d = torch.arange(0, 200_000)
    b = distance_bucket(d)
    assert torch.equal(b[:8], d[:8]) and b[8] == 8
    assert torch.all(b[1:] >= b[:-1]) and int(b.max()) == DISTANCE_BUCKETS - 1
    assert int(b[23_000]) < DISTANCE_BUCKETS - 1 <= int(b[23_200])  # half octaves: 8 * 2^((31 - 8) / 2) = 23,170
    assert torch.equal(distance_bucket(torch.tensor([-3])), torch.tensor([0]))


def _paged_rows(context_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator) -> GroupMetadata:
    """A decode group whose rows hold shuffled physical blocks (0, the null block, pads the tables)."""
    per_row = [-(-n // block_size) for n in context_lens]
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    starts = torch.tensor([0, *per_row]).cumsum(0)
    tables = torch.zeros((len(per_row), max(per_row)), dtype=torch.long)
    for row, (start, count) in enumerate(zip(starts.tolist(), per_row)):
        tables[row, :count] = perm[start:start + count]
    ctx = torch.tensor(context_lens)
    pos = torch.arange(int(ctx.max()))
    slots = torch.where(pos[None, :] < ctx[:, None], tables[:, pos // block_size] * block_size + pos % block_size, 0)
    return GroupMetadata(kv_slots=slots, key_mask=None, num_tokens=len(per_row), context_lens=ctx, block_tables=tables)


def _scorer(dim: int, heads: int, num_slots: int, key_dtype: torch.dtype, gen: torch.Generator) -> LearnedIndexer:
    weights = LearnedIndexerWeights(IndexerSpec(ModelIdentity("x", 1, 9, 3, 64, "f"), dim, heads))
    with torch.no_grad():
        weights.ww.copy_(torch.randn(weights.ww.shape, generator=gen) * weights.ww.shape[1] ** -0.5)  # w ~ N(0, 1)
        for p in (weights.distance_bias, weights.sink_bias):
            p.copy_(torch.randn(p.shape, generator=gen))
    keys = torch.randn((num_slots, dim), generator=gen).to(key_dtype)
    keys[:16] = 0  # the null block
    return LearnedIndexer(weights.requires_grad_(False), 0, keys, block_size=16)


@pytest.mark.parametrize("dim,heads,key_dtype", [(32, 4, torch.float32), (8, 2, torch.float32),
                                                  (32, 4, torch.bfloat16)])
def test_cpu_kernel_scores_equal_torch_path(dim, heads, key_dtype, cpu_isa, monkeypatch):
    """learned_scores (csrc/sparse.cpp) reads the index keys in place through shuffled block tables; rows of
    contexts around the exact/log and the last distance buckets, the sink positions and a partial last block."""
    gen = torch.Generator().manual_seed(11)
    contexts = [1, 4, 8, 9, 16, 17, 181, 2_000, 24_001]
    num_blocks = sum(-(-n // 16) for n in contexts) + 7
    indexer = _scorer(dim, heads, num_blocks * 16, key_dtype, gen)
    group = _paged_rows(contexts, 16, num_blocks, gen)
    q = torch.randn((len(contexts), 9, 64), generator=gen)
    fast = indexer.unit_scores(q, group)
    monkeypatch.setenv("GLMSERVE_TORCH_ONLY", "1")
    reference = indexer.unit_scores(q, group)
    assert fast.shape == reference.shape == group.kv_slots.shape
    past = torch.arange(group.kv_slots.shape[1])[None, :] >= group.context_lens[:, None]
    assert torch.all(fast[past] == float("-inf")) and torch.all(torch.isfinite(fast[~past]))
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


def test_cpu_kernel_distance_buckets_are_exact(cpu_isa):
    """With no content score and bias = bucket index, the kernel's integer buckets equal distance_bucket for
    every distance below 100,000 (the half-octave edges included)."""
    gen = torch.Generator().manual_seed(3)
    indexer = _scorer(32, 4, 100_016, torch.float32, gen)
    with torch.no_grad():
        indexer.weights.ww.zero_()
        indexer.weights.sink_bias.zero_()
        indexer.weights.distance_bias.copy_(torch.arange(DISTANCE_BUCKETS, dtype=torch.float32))
    group = _paged_rows([100_000], 16, 6_251, gen)
    scores = indexer.unit_scores(torch.randn((1, 9, 64), generator=gen), group)[0]
    assert torch.equal(scores.flip(0).long(), distance_bucket(torch.arange(100_000)))


def test_distillation_lowers_kl_and_beats_random(trained):
    _, report, _ = trained
    assert report.train_kl < 0.7 * report.train_kl_before
    assert report.heldout_kl < 0.9 * report.heldout_kl_before  # a random tiny model attends almost uniformly
    assert report.loss_history[-1] < report.loss_history[0]
    assert report.recall["indexer"] > report.recall["random"]
    assert report.recall["oracle"] >= report.recall["indexer"]


def test_kl_is_zero_only_for_the_target_itself(llama, trained):
    weights, _, _ = trained
    ids = torch.randint(2, 320, (48,), generator=torch.Generator().manual_seed(2))
    window = teacher_window(llama.model, ids, torch.arange(24, 48))
    kl = kl_per_layer(weights, window)
    assert torch.all(kl > 0)
    # brute force for one query of layer 0: KL(target || softmax(scores over its past tokens))
    keys = weights.index_keys(window.k[0], 0)
    qi, w = weights.index_queries(window.q[0, 3:4], 0)
    scores = weights.scores(qi, w, keys[:28]) + weights.position_bias(torch.tensor([[27]]), torch.arange(28), 0)
    logp = torch.log_softmax(scores[0], -1)
    target = window.target[0, 3, :28]
    brute = (target * (target.log() - logp)).sum()
    single = window.subset(torch.tensor([3]))
    torch.testing.assert_close(kl_per_layer(weights, single)[0], brute, atol=1e-5, rtol=1e-4)


def test_save_load_round_trip_gives_identical_scores(llama, trained):
    weights, _, path = trained
    loaded = LearnedIndexerWeights.load(path, expected=ModelIdentity.of(llama.model))
    assert loaded.spec == weights.spec
    assert path.stat().st_mode & 0o777 == 0o644 and not list(path.parent.glob(".tmp-*"))
    for (name, a), (_, b) in zip(weights.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
    ids = torch.randint(2, 320, (64,), generator=torch.Generator().manual_seed(3))
    window = teacher_window(llama.model, ids, torch.arange(32, 64))
    for layer in range(weights.spec.identity.num_layers):
        a = weights.scores(*weights.index_queries(window.q[layer], layer), weights.index_keys(window.k[layer], layer))
        b = loaded.scores(*loaded.index_queries(window.q[layer], layer), loaded.index_keys(window.k[layer], layer))
        assert torch.equal(a, b)


def test_mismatched_or_broken_files_are_rejected(trained, tiny_model_dir, tmp_path):
    _, _, path = trained
    qwen = load_model(str(tiny_model_dir("qwen2")), None, CPU, torch.float32)  # same attention shapes
    with pytest.raises(IndexerMismatchError, match="trained for another model.*architecture.*fingerprint"):
        LearnedIndexerWeights.load(path, expected=ModelIdentity.of(qwen.model))
    as_bf16 = load_model(str(tiny_model_dir("llama")), None, CPU, torch.bfloat16)
    assert ModelIdentity.of(as_bf16.model) == LearnedIndexerWeights.load(path).spec.identity  # dtype-independent
    not_ours = tmp_path / "plain.safetensors"
    save_file({"wq": torch.zeros(2)}, str(not_ours))
    with pytest.raises(IndexerMismatchError, match="not a glmserve learned-indexer file"):
        LearnedIndexerWeights.load(not_ours)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(IndexerMismatchError, match="cannot read"):
        LearnedIndexerWeights.load(garbage)
    with pytest.raises(IndexerMismatchError, match="trained for another model"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir("qwen2")), learned_indexer=str(path),
                               kv_cache_memory_bytes=4 << 20))
    with pytest.raises(InvalidRequestError, match="not a file"):
        EngineConfig(learned_indexer=str(tmp_path / "missing.safetensors"))


def test_default_path_is_beside_the_model_and_auto_found(llama, trained, tiny_model_dir, tmp_path, monkeypatch):
    weights, _, _ = trained
    model_dir = tiny_model_dir("llama")
    fingerprint = weights.spec.identity.fingerprint
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("GLMSERVE_CACHE_DIR", raising=False)
    cached = tmp_path / ".cache" / "glmserve" / "indexers" / f"{fingerprint}.safetensors"
    assert default_indexer_path(None, fingerprint) == cached  # the embedded model (its GGUF is pip's)
    assert default_indexer_path(model_dir, fingerprint) == model_dir / "glmserve-indexer.safetensors"
    gguf = tmp_path / "m.gguf"
    assert default_indexer_path(gguf, fingerprint) == tmp_path / "m.gguf.glmserve-indexer.safetensors"
    assert find_learned_indexer(None, str(model_dir), llama.model) is None  # nothing trained there yet
    weights.save(model_dir / "glmserve-indexer.safetensors")
    try:
        found = find_learned_indexer(None, str(model_dir), llama.model)
        assert found is not None and found.spec == weights.spec
        assert find_learned_indexer("none", str(model_dir), llama.model) is None
        # the engine loads that directory: the indexer file is not taken for a weights file, and is found
        engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_bytes=4 << 20))
        assert "learned" in engine.sparse_modes
    finally:
        (model_dir / "glmserve-indexer.safetensors").unlink()


def test_fingerprint_only_where_a_default_file_may_exist(llama, trained, tmp_path, monkeypatch):
    """Server start: the fingerprint (every layer's q/k/v dequantized) is skipped when no default file can match."""
    weights, _, _ = trained
    monkeypatch.setenv("GLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    real, calls = learned.weights_fingerprint, []
    monkeypatch.setattr(learned, "weights_fingerprint", lambda model: calls.append(model) or real(model))
    assert find_learned_indexer(None, None, llama.model) is None and calls == []  # the embedded model, empty cache
    cached = default_indexer_path(None, weights.spec.identity.fingerprint)
    cached.parent.mkdir(parents=True)
    weights.save(cached)
    found = find_learned_indexer(None, None, llama.model)
    assert calls == [llama.model] and found is not None and found.spec == weights.spec


class RecordingIndexer:
    """Observes one layer's scorer: every decode call's (query, kv_slots, context_lens, scores)."""

    def __init__(self, inner: LearnedIndexer):
        self.inner = inner
        self.unit_size = inner.unit_size
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.written: list[torch.Tensor] = []

    def on_kv_written(self, slot_mapping, k, cache) -> None:
        self.written.append(slot_mapping.clone())
        self.inner.on_kv_written(slot_mapping, k, cache)

    def unit_scores(self, q, group) -> torch.Tensor:
        scores = self.inner.unit_scores(q, group)
        self.calls.append((q.clone(), group.kv_slots.clone(), group.context_lens.clone(), scores.clone()))
        return scores


def _engine(model_dir: Path, indexer: Path, kv_cache_dtype: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), learned_indexer=str(indexer), kv_cache_memory_bytes=4 << 20,
                                  max_num_batched_tokens=48, max_num_seqs=4, dtype="float32",
                                  kv_cache_dtype=kv_cache_dtype))


def _run(engine: LLMEngine, prompts: dict[str, list[int]], sparse: dict, max_tokens: int = 6) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params, sparse=sparse)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_decode_scores_equal_brute_force_after_prefix_hits(llama, trained, tiny_model_dir):
    weights, _, path = trained
    engine = _engine(tiny_model_dir("llama"), path, "float32")  # its cached keys meet the float32 teacher's
    assert "learned" in engine.sparse_modes
    layers = [layer.self_attn.attn for layer in engine.runner.model.layers]
    assert all(isinstance(a.indexers["learned"], Indexer) and a.indexers["learned"].unit_size == 1 for a in layers)
    recorders = [RecordingIndexer(a.indexers["learned"]) for a in layers]
    for a, r in zip(layers, recorders):
        a.indexers["learned"] = r
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(2, 320, (70,), generator=gen).tolist()
    sparse = {"mode": "learned", "top_k": 24, "sink_tokens": 2, "local_tokens": 8}
    first = _run(engine, {"a": shared + [5, 6, 7]}, sparse)
    prompts = {"b": shared + [9, 10, 11, 12, 13], "c": shared + list(range(20, 31))}  # distinct lengths
    for r in recorders:
        r.calls.clear()
    second = _run(engine, prompts, sparse)
    # 4 shared blocks hit, less the last 32 prompt tokens that the question pins recompute (pinning.py)
    assert second["b"].num_cached_tokens == 75 - 32 and second["c"].num_cached_tokens == 81 - 32
    assert first["a"].num_cached_tokens == 0
    # reference: every row's index keys recomputed from its keys in the KV cache (gathered by its slots), and
    # those keys checked against the dense teacher over the prompt, which does not depend on the paged pool
    # (generated positions differ from the teacher: their earlier layers attended sparsely)
    teacher = {}
    for out in second.values():
        prompt = torch.tensor(out.prompt_token_ids)
        teacher[len(prompt)] = teacher_window(llama.model, prompt, torch.tensor([len(prompt) - 1])).k
    kv = engine.runner.kv_cache  # [layers, 2, Hkv, slots, D]
    checked = 0
    for layer, r in enumerate(recorders):
        for q, slots, ctx, scores in r.calls:
            for row in range(q.shape[0]):
                c = int(ctx[row])
                cached_k = kv[layer, 0][:, slots[row, :c]].transpose(0, 1)  # [c, Hkv, D]
                prompt_len = max(n for n in teacher if n < c)
                torch.testing.assert_close(cached_k[:prompt_len], teacher[prompt_len][layer], atol=1e-5, rtol=1e-4)
                qi, w = weights.index_queries(q[row:row + 1].unsqueeze(0), layer)
                keys = weights.index_keys(cached_k, layer).to(INDEX_KEY_DTYPE).float()  # as the pool keeps them
                expected = weights.scores(qi, w, keys)[0, 0]
                expected += weights.position_bias(torch.tensor([[c - 1]]), torch.arange(c), layer)[0]
                torch.testing.assert_close(scores[row, :c], expected, atol=1e-5, rtol=1e-4)
                assert torch.all(scores[row, c:] == float("-inf"))
                checked += 1
    assert checked == len(layers) * (2 * 5)  # 2 sequences x 5 decode steps (the 1st token comes from prefill)


def test_index_keys_follow_kv_loaded_into_the_pool(trained, tiny_model_dir):
    """KV restored by the tiers or the session store (KVBlockIO.scatter) gets its index keys recomputed."""
    _, _, path = trained
    engine = _engine(tiny_model_dir("llama"), path)
    attn = engine.runner.model.layers[0].self_attn.attn
    recorder = RecordingIndexer(attn.indexers["learned"])
    attn.indexers["learned"] = recorder
    prompt = torch.randint(2, 320, (64,), generator=torch.Generator().manual_seed(7)).tolist()
    _run(engine, {"r": prompt}, {"mode": "dense"}, max_tokens=1)
    used = torch.cat(recorder.written).div(16, rounding_mode="floor").unique()
    assert len(used) == 4
    keys = engine.index_keys.keys
    before = keys.clone()
    targets = torch.arange(engine.kv.blocks.num_usable_blocks - 3, engine.kv.blocks.num_usable_blocks + 1)
    engine.kv.io.scatter(targets, engine.kv.io.gather(used))
    slots_of = lambda blocks: (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)  # noqa: E731
    torch.testing.assert_close(keys[:, slots_of(targets)], before[:, slots_of(used)], atol=1e-6, rtol=1e-5)
    assert not torch.equal(before[:, slots_of(targets)], before[:, slots_of(used)])


def test_learned_mode_covering_budget_equals_dense(trained, tiny_model_dir):
    _, _, path = trained
    engine = _engine(tiny_model_dir("llama"), path)
    prompt = torch.randint(2, 320, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    dense = _run(engine, {"d": prompt}, {"mode": "dense"}, max_tokens=8)["d"].outputs[0]
    learned = _run(engine, {"l": prompt}, {"mode": "learned", "top_k": 128, "sink_tokens": 0, "local_tokens": 0},
                   max_tokens=8)["l"].outputs[0]
    assert learned.token_ids == dense.token_ids
    for a, b in zip(learned.logprobs, dense.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_small_budget_attends_the_learned_top_tokens(trained, tiny_model_dir):
    _, _, path = trained
    engine = _engine(tiny_model_dir("llama"), path)
    attn = engine.runner.model.layers[1].self_attn.attn
    recorder = RecordingIndexer(attn.indexers["learned"])
    attn.indexers["learned"] = recorder
    prompt = torch.randint(2, 320, (90,), generator=torch.Generator().manual_seed(6)).tolist()
    sparse = {"mode": "learned", "top_k": 20, "sink_tokens": 2, "local_tokens": 6}
    _run(engine, {"s": prompt}, sparse, max_tokens=4)
    assert len(recorder.calls) == 3
    from glmserve.sparse.selection import SparseRows
    from glmserve.sparse_settings import SparseAttentionParams

    rows = SparseRows.from_params([SparseAttentionParams(**sparse)], CPU)
    for q, slots, ctx, scores in list(recorder.calls):
        c = int(ctx[0])
        bs = engine.config.block_size  # the block tables, read back off the slots of each block's first position
        group = GroupMetadata(kv_slots=slots, key_mask=None, num_tokens=1, context_lens=ctx,
                              block_tables=slots[:, ::bs] // bs, sparse=rows)
        chosen_slots, lengths = attn.select(q, group)
        assert int(lengths[0]) == 20
        kept = set(range(2)) | set(range(c - 6, c))
        middle = scores[0, :c].clone()
        middle[list(kept)] = float("-inf")
        # ties (equal position bias, relu at 0) go to the earlier position, as selection documents
        top = set(middle.sort(descending=True, stable=True).indices[:20 - len(kept)].tolist())
        expected = sorted(kept | top)
        assert chosen_slots[0, :20].tolist() == slots[0, expected].tolist()


def test_train_indexer_cli(tiny_model_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(CORPUS) * 3)
    out = tmp_path / "cli-indexer.safetensors"
    cmd = [sys.executable, "-m", "glmserve.cli", "train-indexer", "--model", str(tiny_model_dir("llama")),
           "--text", str(text), "--out", str(out), "--steps", "5", "--window", "64", "--dim", "8",
           "--max-windows", "3", "--heldout-windows", "1", "--budget", "16", "--num-threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"saved {out}" in done.stdout and "held-out KL" in done.stdout
    weights = LearnedIndexerWeights.load(out)
    assert weights.spec.index_dim == 8 and weights.spec.identity.architecture == "LlamaForCausalLM"
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        report = json.loads(f.metadata()["report"])
    assert report["steps"] == 5 and report["window"] == 64



@pytest.mark.parametrize("args, message", [
    (["--window", "4"], "window must be >= 8"),
    (["--text", "/nonexistent/text.txt"], "cannot read training text"),
    (["--window", "4096"], "longer than the model's context"),
])
def test_train_indexer_cli_errors(tiny_model_dir, tmp_path, capsys, args, message):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(CORPUS))
    with pytest.raises(SystemExit) as exit_info:
        main(["train-indexer", "--model", str(tiny_model_dir("llama")), "--text", str(text), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
