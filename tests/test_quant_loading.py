"""Quantized models through the engine: tiny random checkpoints of every architecture quantized on load
(`quantization=SCHEME`) stay close to transformers' float model; a small GGUF with native and K-quant types
loads natively (QuantizedWeights equal to the dequantized float path) and the native engine equals the
float engine on the reference backend; the embedded SmolLM2 natively quantized agrees greedily with its
float path; compressed-tensors folders written by `glmserve quantize` run in their stored formats (equal to
the fake-quantized float model; cpu_block where it runs the format) or dequantized; unknown schemes and
unreadable quantization_configs fail clearly."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_random_blocks import k_blocks, q6_k_blocks
from parity import assert_same_output, reference_logprobs
from test_gguf_loader import write_gguf
from test_llama_decode import GREEDY, PROMPTS, fused_and_module_outputs
from test_quantize_cli import fake_quantized_model
from tiny_models import COMMON, tiny_tokenizer
from torch import nn
from transformers import AutoModelForCausalLM

from glmserve import LLM, SamplingParams, kernels
from glmserve.cli import build_parser, main
from glmserve.errors import InvalidRequestError, UnsupportedModelError
from glmserve.layers.embedding import QuantizedEmbedding
from glmserve.layers.linear import QuantizedLinear
from glmserve.models import loader
from glmserve.models.gguf_loader import load_gguf
from glmserve.models.loader import load_model
from glmserve.models.quantized import weight_bytes
from glmserve.quant.compressed_tensors import OutlierColumns, dense_weight, load_checkpoint, save_checkpoint
from glmserve.quant.cpu_backend import CpuBlockBackend
from glmserve.quant.reference import dequantize
from glmserve.quant.schemes import SCHEMES, scheme
from glmserve.quant.weight import QuantizedWeight

# largest |logprob error| vs the float reference over 6 greedy steps (measured: about 1/3 of these)
TOLERANCE = {"int8": 0.1, "w8a8": 0.1, "q8_0": 0.1, "fp8": 0.3, "fp8-block": 0.3, "fp8-block-g128": 0.3, "fp8-g32": 0.3,
             "fp8-g16": 0.3, "w4a16": 1.0, "w4a16-fmin": 1.0,
             "w4a16-asym": 1.0, "w4a16-g64": 1.0, "w4a16-asym-g64": 1.0, "q4_0": 1.0, "q4_1": 1.0, "nvfp4": 1.2}
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    """Every quantized layer on the oracle, so that these tests check loading and planning, not kernels."""
    monkeypatch.setenv("GLMSERVE_QUANT_BACKEND", "reference")


def _worst_error(llm: LLM, hf_model, prompt: list[int]) -> float:
    out = llm.generate([prompt], PARAMS)[0].outputs[0]
    ref = reference_logprobs(hf_model, prompt + out.token_ids)
    return max(abs(ref[len(prompt) - 1 + step, t].item() - v) for step, lp in enumerate(out.logprobs)
               for t, v in lp.top)


def _engine(path, **options) -> LLM:
    # float32 KV, not the CPU default int8: outputs are compared with float32 models at float32 tolerances
    return LLM(model=str(path), block_size=4, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20,
               kv_cache_dtype="float32", **options)


CASES = [("llama", name, False) for name in TOLERANCE] + [
    ("qwen2", "w8a8", False),  # q/k/v bias
    ("qwen3", "int8", False),  # q/k norms
    ("glm4", "w4a16-asym", False),  # a fused gate_up_proj in the checkpoint, bias
    ("llama3-scaled", "int8", True),  # tied head, quantized with the embedding
    ("llama3-scaled", "q8_0", True),
]


@pytest.mark.parametrize(("arch", "name", "embeddings"), CASES)
def test_quantize_on_load_stays_close_to_float(arch, name, embeddings, tiny_model_dir):
    path = tiny_model_dir(arch)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = _engine(path, quantization=name, quantize_embeddings=embeddings)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(model.layers[1].mlp.down_proj, QuantizedLinear)
    assert isinstance(model.embed_tokens, QuantizedEmbedding) == embeddings
    assert isinstance(model.lm_head, QuantizedLinear) == embeddings
    worst = _worst_error(llm, hf_model, list(range(5, 30)))
    assert 0 < worst < TOLERANCE[name], worst


def test_none_is_the_float_path(tiny_model_dir):
    llm = _engine(tiny_model_dir("llama"), quantization="none")
    assert not any(isinstance(m, QuantizedLinear) for m in llm.engine.runner.model.modules())


def test_unknown_scheme_is_a_clear_error(tiny_model_dir):
    with pytest.raises(InvalidRequestError,
                       match="unknown quantization scheme 'int5'; known: none, int8, .*w8a8, .*nvfp4"):
        _engine(tiny_model_dir("llama"), quantization="int5")
    with pytest.raises(InvalidRequestError, match="cannot gather rows"):
        _engine(tiny_model_dir("llama"), quantization="fp8-block", quantize_embeddings=True)


def test_cli_takes_the_scheme():
    for command in (["serve"], ["generate", "hi"], ["chat"], ["train-indexer", "--text", "t.txt"]):
        args = build_parser().parse_args([*command, "--quantization", "w8a8"])
        assert args.quantization == "w8a8"
    assert build_parser().parse_args(["serve"]).quantization is None
    assert set(SCHEMES) >= {"w8a8", "nvfp4", "q4_1"}


# --- a small GGUF with native and dequantized types ------------------------------------------------------

HIDDEN, FFN, LAYERS = COMMON["hidden_size"], COMMON["intermediate_size"], 2
HEADS, KV_HEADS = COMMON["num_attention_heads"], COMMON["num_key_value_heads"]
HEAD_DIM = HIDDEN // HEADS
VOCAB = COMMON["vocab_size"]
TYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0,
         "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_0, "ffn_down": Q.F16}


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """A llama GGUF (rotary rows permuted by llama.cpp's converter, tied head) with Q8_0, Q4_0, Q4_1, F16
    matrices and one Q5_0 down projection (read as 5-bit codes: glmserve/quant/gguf_mapped.py), plus a tokenizer
    directory for its vocabulary."""
    root = tmp_path_factory.mktemp("small-gguf")
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (VOCAB, HIDDEN), "attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN),
              "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    tensors, qtypes = {"output_norm.weight": np.ones(HIDDEN, np.float32)}, {}
    for b in range(LAYERS):
        tensors[f"blk.{b}.attn_norm.weight"] = np.ones(HIDDEN, np.float32)
        tensors[f"blk.{b}.ffn_norm.weight"] = np.ones(HIDDEN, np.float32)
        for kind, shape in shapes.items():
            if kind == "token_embd" and b:
                continue
            name = f"{kind}.weight" if kind == "token_embd" else f"blk.{b}.{kind}.weight"
            qtype = Q.Q5_0 if (b, kind) == (1, "ffn_down") else TYPES[kind]  # (K-quants need 256 inputs)
            w = (rng.standard_normal(shape) * 0.08).astype(np.float32)
            tensors[name] = gguf.quants.quantize(w, qtype)
            qtypes[name] = qtype
    path = write_gguf(root / "small.gguf", "llama", tensors, qtypes, embedding_length=HIDDEN,
                      feed_forward_length=FFN, head_count=HEADS, head_count_kv=KV_HEADS, block_count=LAYERS,
                      context_length=512, bos_token_id=0, eos_token_id=1)
    tiny_tokenizer(VOCAB).save_pretrained(root / "tokenizer")
    return path, root / "tokenizer"


def test_native_tensors_equal_the_dequantized_ones(small_gguf, caplog):
    ckpt = load_gguf(small_gguf[0])
    floats = dict(ckpt.tensors())
    with caplog.at_level("INFO", logger="glmserve.quant.gguf_blocks"):
        native = dict(ckpt.tensors(native=True))  # no block type is dequantized: none logged
    assert native.keys() == floats.keys()
    for name, tensor in native.items():
        as_float = dequantize(tensor) if isinstance(tensor, QuantizedWeight) else tensor
        assert torch.equal(as_float, floats[name]), name  # q/k rows unpermuted in codes and scales alike
    formats = ckpt.native_formats()
    assert formats["model.layers.0.self_attn.q_proj.weight"].weight.gguf_type == "Q4_1"
    assert formats["model.embed_tokens.weight"].weight.gguf_type == "Q8_0"
    assert "model.layers.0.mlp.down_proj.weight" not in formats  # F16: float
    assert formats["model.layers.1.mlp.down_proj.weight"].weight.gguf_type == "Q5_0"
    assert "no native kernel" not in caplog.text


def test_native_gguf_engine_equals_the_float_engine(small_gguf):
    path, tokenizer = small_gguf
    native = LLM(model=str(path), tokenizer=str(tokenizer), block_size=4, kv_cache_memory_bytes=4 << 20)
    floats = LLM(model=str(path), tokenizer=str(tokenizer), quantization="none", block_size=4,
                 kv_cache_memory_bytes=4 << 20)
    model = native.engine.runner.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.embed_tokens.weight_bytes() == 0
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.tied
    assert type(model.layers[0].mlp.down_proj) is nn.Linear  # F16: the float path
    assert isinstance(model.layers[1].mlp.down_proj, QuantizedLinear)  # Q5_0: 5-bit codes as nibbles and fifth bits
    assert weight_bytes(model) < weight_bytes(floats.engine.runner.model) / 2.5
    prompts = [list(range(3, 20)), list(range(40, 47))]
    for got, want in zip(native.generate(prompts, PARAMS), floats.generate(prompts, PARAMS)):
        assert_same_output(got, want, tol=1e-5)


def test_mixed_format_projections_run_the_fused_decode_as_the_module_path(small_gguf, cpu_isa, monkeypatch):
    """q and k in Q4_1 and v in Q8_0 make qkv_proj two segments (as a Q4_K_M file's Q4_K q, k and Q6_K v do), layer
    1's down projection is Q5_0 and layer 0's float: the fused decode step runs the segments side by side, with the
    module path's tokens and logprobs bit for bit (before, such a model decoded on the module path only). On the
    kernels, not this module's reference backend."""
    monkeypatch.delenv("GLMSERVE_QUANT_BACKEND")
    path, tokenizer = small_gguf
    llm = LLM(model=str(path), tokenizer=str(tokenizer), block_size=4, kv_cache_memory_bytes=4 << 20,
              enable_prefix_caching=False)
    assert len(llm.engine.runner.model.layers[0].self_attn.qkv_proj._segments) == 2
    fused, modules, ran = fused_and_module_outputs(llm, PROMPTS, monkeypatch)
    assert fused == modules
    assert len(ran) >= GREEDY.max_tokens - 1  # every decode-only step took the fused path


def test_mixed_format_projection_on_the_bf16_gemm_rows(small_gguf, bf16_gemm_from_two_rows, monkeypatch):
    """The two-segment qkv_proj's bound bf16 GEMM call (`dense_batch`: the segments' GEMMs side by side, as the fused
    decode step runs batches of 64+ rows on AMX) is its forward on bf16 rows bit for bit, from the rows where both
    segments take their GEMM."""
    monkeypatch.delenv("GLMSERVE_QUANT_BACKEND")
    path, tokenizer = small_gguf
    llm = LLM(model=str(path), tokenizer=str(tokenizer), block_size=4, kv_cache_memory_bytes=4 << 20)
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    call, rows = qkv.dense_batch()
    x = torch.randn(rows + 3, HIDDEN, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert rows == 2 and qkv.takes_bf16(rows + 3)
    assert torch.equal(call(x), qkv(x))


def test_each_quantized_module_is_finalized_once_its_weights_arrived(small_gguf, monkeypatch):
    """Repacking a module as soon as its last part is loaded frees its checkpoint codes while the rest still
    streams in, so the load's peak memory is not every module's canonical copy at once."""
    events: list[str] = []
    real = QuantizedLinear.finalize

    def recorded(self: QuantizedLinear) -> None:
        events.append("finalize")
        real(self)

    monkeypatch.setattr(QuantizedLinear, "finalize", recorded)
    ckpt = load_gguf(small_gguf[0])

    def tensors():
        for name, tensor in ckpt.tensors(native=True):
            events.append(name)
            yield name, tensor

    loader._build(ckpt.config, tensors(), ckpt.native_formats(), torch.device("cpu"), torch.float32, None, False)
    last_layer = max(i for i, e in enumerate(events) if e.startswith(f"model.layers.{LAYERS - 1}."))
    first_finalize = events.index("finalize")
    assert first_finalize < last_layer
    assert all(not e.startswith(f"model.layers.{LAYERS - 1}.") for e in events[:first_finalize])


def block_type_gguf(root: Path, kinds: dict[str, Q], embedding: Q) -> tuple[Path, Path]:
    """A llama GGUF whose decoder matrices `kinds` (attn_q ... ffn_down -> type) and tied embedding are of llama.cpp's
    block types, at widths K-quants allow (256 inputs), weights of a trained model's size (|w| ~ 0.03), and its
    tokenizer directory."""
    rng = np.random.default_rng(1)
    hidden, ffn, heads, kv_heads = 256, 512, 4, 2
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * 64, hidden), "attn_v": (kv_heads * 64, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}

    def blocks(rows: int, cols: int, qtype: Q) -> np.ndarray:
        n = rows * cols // 256
        if qtype in (Q.Q5_0, Q.Q5_1, Q.MXFP4, Q.TQ2_0):  # types gguf-py quantizes
            return gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.03).astype(np.float32), qtype)
        if qtype == Q.Q2_K:  # 16 bytes of (scale, min) nibbles and 64 of 2-bit codes at random, d = dmin = 0.002
            body = rng.integers(0, 256, (n, 80), dtype=np.uint8)
            return np.concatenate([body, np.full((n, 2), 0.002, np.float16).view(np.uint8)], axis=1).reshape(rows, -1)
        if qtype == Q.NVFP4:  # per 64 values 4 UE4M3 scales (0x05: 5 * 2^-9, halved: |w| up to 0.03) and 32 bytes
            # of random E2M1 indices
            scales = np.full((rows * cols // 64, 4), 0x05, dtype=np.uint8)
            codes = rng.integers(0, 256, (rows * cols // 64, 32), dtype=np.uint8)
            return np.concatenate([scales, codes], axis=1).reshape(rows, -1)
        if qtype == Q.Q6_K:
            return q6_k_blocks(rng, n, d_scale=0.1)[0].reshape(rows, -1)
        return k_blocks(rng, n, 5 if qtype == Q.Q5_K else 4, d_scale=0.02)[0].reshape(rows, -1)

    tensors = {"output_norm.weight": np.ones(hidden, np.float32), "token_embd.weight": blocks(VOCAB, hidden, embedding)}
    qtypes = {"token_embd.weight": embedding}
    for b in range(LAYERS):
        tensors[f"blk.{b}.attn_norm.weight"] = np.ones(hidden, np.float32)
        tensors[f"blk.{b}.ffn_norm.weight"] = np.ones(hidden, np.float32)
        for kind, qtype in kinds.items():
            tensors[f"blk.{b}.{kind}.weight"], qtypes[f"blk.{b}.{kind}.weight"] = blocks(*shapes[kind], qtype), qtype
    path = write_gguf(root / "k.gguf", "llama", tensors, qtypes, embedding_length=hidden, feed_forward_length=ffn,
                      head_count=heads, head_count_kv=kv_heads, block_count=LAYERS, context_length=512,
                      bos_token_id=0, eos_token_id=1)
    tiny_tokenizer(VOCAB).save_pretrained(root / "tokenizer")
    return path, root / "tokenizer"


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory):
    """K-quants, 5-bit blocks and a Q6_K tied embedding."""
    kinds = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_1, "ffn_gate": Q.Q5_0,
             "ffn_up": Q.Q4_K, "ffn_down": Q.Q5_K}
    return block_type_gguf(tmp_path_factory.mktemp("k-quant-gguf"), kinds, Q.Q6_K)


@pytest.fixture(scope="module")
def small_types_gguf(tmp_path_factory):
    """MXFP4 (t4 blocks), NVFP4 (f4 blocks, also the tied embedding), TQ2_0 (Q4_0 blocks) and Q2_K (q2 blocks)."""
    kinds = {"attn_q": Q.MXFP4, "attn_k": Q.NVFP4, "attn_v": Q.NVFP4, "attn_output": Q.TQ2_0, "ffn_gate": Q.MXFP4,
             "ffn_up": Q.NVFP4, "ffn_down": Q.Q2_K}
    return block_type_gguf(tmp_path_factory.mktemp("small-types-gguf"), kinds, Q.NVFP4)


@pytest.mark.parametrize("file", ["k_quant_gguf", "small_types_gguf"])
def test_block_type_gguf_engine_runs_from_blocks_as_the_float_engine(file, request):
    """Every matrix of the K-quant file (and of the MXFP4 / NVFP4 / TQ2_0 / Q2_K one) runs on the block kernels (none in
    float), at a quarter of the float engine's weight bytes, and generates what the float engine (gguf-py's
    dequantization) does: the same greedy tokens and top two, logprobs within what the flattened scales and the int8
    activations move (measured: at most 0.03)."""
    path, tokenizer = request.getfixturevalue(file)
    native = LLM(model=str(path), tokenizer=str(tokenizer), block_size=4, kv_cache_memory_bytes=4 << 20)
    floats = LLM(model=str(path), tokenizer=str(tokenizer), quantization="none", block_size=4,
                 kv_cache_memory_bytes=4 << 20)
    model = native.engine.runner.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.lm_head.tied
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert weight_bytes(model) < weight_bytes(floats.engine.runner.model) / 3
    prompts = [list(range(3, 20)), list(range(40, 47))]
    for got, want in zip(native.generate(prompts, PARAMS), floats.generate(prompts, PARAMS)):
        ours, theirs = got.outputs[0], want.outputs[0]
        assert ours.token_ids == theirs.token_ids
        for x, y in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < 0.06
            assert [t for t, _ in x.top[:2]] == [t for t, _ in y.top[:2]]


# --- the embedded default model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_native():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLMSERVE_QUANT_BACKEND", "reference")
        return LLM(model=None, dtype="float32", max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                   kv_cache_memory_bytes=128 << 20)


@pytest.mark.slow  # the reference backend dequantizes every matrix per step: minutes on a busy CPU
def test_embedded_model_loads_natively(smollm2_native, smollm2):
    model = smollm2_native.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and "ReferenceBackend" in qkv.extra_repr()
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.embed_tokens.head is model.lm_head
    assert not any(p.dim() == 2 for p in model.parameters())  # no float matrix is left
    float_bytes, native_bytes = weight_bytes(smollm2.engine.runner.model), weight_bytes(model)
    assert native_bytes < float_bytes / 3.5, (native_bytes, float_bytes)


@pytest.mark.slow
def test_embedded_native_agrees_greedily_with_the_float_path(smollm2_native, smollm2):
    """The native reference backend computes from the same weights as the dequantized float path."""
    engine = smollm2.engine
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}])
               for p in ("What is the capital of France?", "用一句话介绍你自己。")]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    for got, want in zip(smollm2_native.generate(prompts, params), smollm2.generate(prompts, params)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert_same_output(got, want, tol=1e-4)


def test_embedded_model_on_cpu_block_follows_the_float_path(smollm2, monkeypatch):
    """The default path (Q4_1 / Q8_0 blocks on our kernels) scores real English and Chinese text as the float path
    does: the same next token at almost every position, and perplexity within 1.5% where the 256-token prompts'
    linears run as bf16 GEMMs (AMX CPUs; measured +0.5%), within 3% where their A16 activations are rounded to
    int8 per block of 32 as llama.cpp's q8 activations are (CPUs without AMX; measured +2.1% on English on an AMD
    Zen 4). A kernel bug on the real shapes (576, 1536, the 49,152-row tied head) moves these by far more."""
    monkeypatch.delenv("GLMSERVE_QUANT_BACKEND")  # the default backend, not this module's oracle
    native = LLM(model=None, dtype="float32", max_num_seqs=4, max_num_batched_tokens=512, max_model_len=512,
                 kv_cache_memory_bytes=32 << 20)
    assert "CpuBlockBackend" in native.engine.runner.model.layers[0].self_attn.qkv_proj.extra_repr()
    root = Path(__file__).resolve().parent.parent / "bench" / "data"
    tokenizer = smollm2.engine.tokenizer
    prompts = [tokenizer((root / f"heldout_{lang}.txt").read_text(), add_special_tokens=False)["input_ids"][:256]
               for lang in ("en", "zh")]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    qkv = native.engine.runner.model.layers[0].self_attn.qkv_proj  # the prompts run as bf16 GEMMs, or int8 tiles
    bound = 1.015 if qkv.takes_bf16(min(map(len, prompts))) else 1.03
    for got, want in zip(native.generate(prompts, params), smollm2.generate(prompts, params)):
        ours, ref = got.prompt_logprobs[1:], want.prompt_logprobs[1:]
        nll = torch.tensor([[-a.logprob, -b.logprob] for a, b in zip(ours, ref)]).mean(0)
        assert math.exp(nll[0]) / math.exp(nll[1]) < bound, nll
        same_top = sum(a.top[0][0] == b.top[0][0] for a, b in zip(ours, ref)) / len(ref)
        assert same_top > 0.9, same_top


def test_glm_moe_dsa_quantizes_its_dense_linears(tmp_path):
    """MLA's projections and the dense/shared MLPs are quantized; kv_b_proj (read directly), the indexer
    (float32 as the reference) and the routed experts (3D tensors) stay float."""
    from test_glm_moe_dsa import make_model

    path = make_model("glm_moe_dsa", tmp_path / "glm")
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = _engine(path, quantization="int8")
    attn = llm.engine.runner.model.layers[0].self_attn
    assert isinstance(attn.qkv_a_proj, QuantizedLinear) and isinstance(attn.o_proj, QuantizedLinear)
    assert type(attn.kv_b_proj) is nn.Linear and type(attn.indexer.wk) is nn.Linear
    assert _worst_error(llm, hf_model, list(range(5, 30))) < TOLERANCE["int8"]


# --- compressed-tensors checkpoints written by `glmserve quantize` ------------------------------------------

CT_SCHEMES = ("int8", "w8a8", "w4a16", "w4a16-asym", "fp8")
# largest |logprob error| vs the fake-quantized float model (its weights dequantized from the checkpoint) on
# the reference backend: weight-only formats compute the same matmuls; W8A8 and FP8 also quantize activations
FAKE_TOLERANCE = {"int8": 1e-4, "w4a16": 1e-4, "w4a16-asym": 1e-4, "w8a8": 0.1, "fp8": 0.3}


@pytest.fixture(scope="module")
def ct_checkpoints(tiny_model_dir, tmp_path_factory):
    """{scheme: folder written by `glmserve quantize --scheme`} of the tiny llama, and the float model's dir."""
    src = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("ct")
    out = {}
    for name in CT_SCHEMES:
        main(["quantize", str(src), "--scheme", name, "--out", str(root / name)])
        out[name] = root / name
    return src, out


@pytest.mark.parametrize("name", CT_SCHEMES)
def test_compressed_tensors_checkpoint_runs_its_own_format(name, ct_checkpoints):
    src, dirs = ct_checkpoints
    hf_float = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    hf_fake = fake_quantized_model(src, dirs[name])
    llm = _engine(dirs[name])
    model = llm.engine.runner.model
    qkv, down = model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.down_proj
    assert isinstance(qkv, QuantizedLinear) and isinstance(down, QuantizedLinear)
    want = scheme(name)
    assert qkv.scheme.activations == want.activations  # W8A8's dynamic int8 tokens, FP8's fp8 tokens
    assert [s.prepared_rows for s in qkv._segments] == [qkv.out_features]  # q|k|v stacked into one matmul
    assert type(model.lm_head) is nn.Linear and type(model.embed_tokens) is nn.Embedding  # ignored: float
    prompt = list(range(5, 30))
    assert _worst_error(llm, hf_fake, prompt) < FAKE_TOLERANCE[name]
    assert 0 < _worst_error(llm, hf_float, prompt) < TOLERANCE[name]
    floats = _engine(dirs[name], quantization="none")  # dequantized: the fake-quantized model itself
    assert not any(isinstance(m, QuantizedLinear) for m in floats.engine.runner.model.modules())
    assert _worst_error(floats, hf_fake, prompt) < 1e-4


@pytest.mark.parametrize("name", CT_SCHEMES)
def test_compressed_tensors_checkpoint_picks_cpu_block(name, ct_checkpoints, monkeypatch):
    """Without a forced backend the registry's choice: cpu_block for the integer formats where its kernel
    builds, cpu_float_block for FP8 (cpu_block runs no float weights), reference without the kernels."""
    monkeypatch.delenv("GLMSERVE_QUANT_BACKEND")
    src, dirs = ct_checkpoints
    model = load_model(str(dirs[name]), None, torch.device("cpu"), torch.float32).model
    qkv = model.layers[0].self_attn.qkv_proj
    cpu = torch.device("cpu")
    want = scheme(name)
    integer = want.weight.type == "int"
    kernel = kernels.op("quant_linear" if integer else "float_quant_linear", cpu, torch.float32) is not None
    expected = ("cpu_block" if integer else "cpu_float_block") if kernel else "reference"
    assert [s.backend.name for s in qkv._segments] == [expected]
    assert CpuBlockBackend().supports(want.weight, want.activations, cpu) == (expected == "cpu_block")
    hf_fake = fake_quantized_model(src, dirs[name])
    ids = torch.tensor([[0, 5, 17, 42, 99, 7, 3, 250]])
    with torch.no_grad():
        ref = hf_fake(ids).logits[0]
    llm = _engine(dirs[name])
    out = llm.generate([ids[0].tolist()], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    want_lp = torch.log_softmax(ref, -1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
    assert (got - want_lp).abs().max() < 0.3  # cpu_block quantizes A16 activations per block of 32 too


def _edit_config(folder, edit):
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    edit(config["quantization_config"])
    config_file.write_text(json.dumps(config))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda qc: qc.update(quant_method="gptq"), "quant_method 'gptq' is not read"),
    (lambda qc: qc.update(format="marlin-24"), "format 'marlin-24' is not read"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].pop("num_bits"), "group 'group_0' is malformed"),
    (lambda qc: qc["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     "static input activation scales are not supported"),
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    (lambda qc: qc["config_groups"]["group_0"].update(targets=["nothing"]), "targets no quantized tensor"),
])
def test_bad_quantization_config_is_a_clear_error(edit, message, ct_checkpoints, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(ct_checkpoints[1]["w8a8"], folder)
    _edit_config(folder, edit)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(str(folder), None, torch.device("cpu"), torch.float32)


def _float_columns(segment) -> list[int]:
    """A layer segment's float input columns, added by the layer or inside its backend's kernel (cpu_float_block)."""
    if segment.columns is not None:
        return segment.columns.tolist()
    inside = getattr(segment.backend, "keeps_float_columns", None)
    return segment.prepared.columns.tolist() if inside is not None and inside(segment.prepared) else []


@pytest.mark.parametrize("name", ["int8", "w8a8", "fp8"])
def test_outlier_columns_run_natively(name, ct_checkpoints, tmp_path, monkeypatch):
    """Float outlier columns (the activation_threshold recipe: q/k/v of layer 0 share theirs, layer 1's down_proj
    has its own) load with the codes and run on the CPU kernels as the fake-quantized float model computes; with
    --quantization none they are put back into the float weight."""
    monkeypatch.delenv("GLMSERVE_QUANT_BACKEND")
    src, dirs = ct_checkpoints
    config, modules, rest = load_checkpoint(dirs[name])
    g = torch.Generator().manual_seed(3)
    for targets, columns in ((["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                               "model.layers.0.self_attn.v_proj"], torch.tensor([1, 9, 30])),
                             (["model.layers.1.mlp.down_proj"], torch.tensor([3, 40]))):
        for target in targets:
            weight = modules[target].weight
            modules[target].outliers = OutlierColumns(columns, torch.randn(weight.shape[0], len(columns),
                                                                           generator=g) * 0.3)
            weight.codes[:, columns] = 0
    qconfig = config.pop("quantization_config")
    folder = tmp_path / "outliers"
    save_checkpoint(folder, modules, rest, config, qconfig["ignore"])
    for file in dirs[name].glob("tokenizer*"):
        shutil.copy(file, folder)
    hf_fake = fake_quantized_model(src, folder)
    llm = _engine(folder)
    model = llm.engine.runner.model
    qkv, down = model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.down_proj
    assert [_float_columns(s) for s in qkv._segments] == [[1, 9, 30]]  # q|k|v still one matmul
    assert [_float_columns(s) for s in down._segments] == [[3, 40]]
    assert all(_float_columns(s) == [] for s in model.layers[1].self_attn.qkv_proj._segments)
    assert _worst_error(llm, hf_fake, list(range(5, 30))) < max(FAKE_TOLERANCE[name], 0.05)
    fused, module_path, ran = fused_and_module_outputs(llm, PROMPTS, monkeypatch)
    assert len(ran) >= GREEDY.max_tokens - 1  # the fused decode step adds the columns too
    for (tokens, logprobs), (want_tokens, want) in zip(fused, module_path, strict=True):
        # W8A8 checkpoints differ from the module path in the 7th digit with or without outlier columns
        assert tokens == want_tokens and max(abs(a - b) for a, b in zip(logprobs, want, strict=True)) < 1e-5
    floats = load_model(str(folder), None, torch.device("cpu"), torch.float32, quantization="none").model
    target = "model.layers.1.mlp.down_proj"
    assert torch.equal(floats.layers[1].mlp.down_proj.weight, dense_weight(modules[target]))


