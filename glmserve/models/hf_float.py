"""A checkpoint's float weights as a transformers model with one nn.Linear per Hugging Face parameter name
(q_proj, k_proj, ... unfused): what calibration hooks and `glmserve quantize` export need, and the float
reference the quantized checkpoints are compared with. The embedded default GGUF, a .gguf file (dequantized) or
an HF folder with safetensors."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from glmserve.errors import UnsupportedModelError
from glmserve.models.gguf_loader import embedded_default_gguf, load_gguf
from glmserve.models.loader import safetensors_weights
from glmserve.models.registry import model_class

DEFAULT = "default"


@dataclass
class FloatCheckpoint:
    model: torch.nn.Module  # transformers' *ForCausalLM, eval mode, float32
    tokenizer: PreTrainedTokenizerBase
    source: Path
    # what the source stores its float tensors in (a folder: its most common float dtype; a GGUF: bfloat16, see
    # source_float_dtype), the dtype `glmserve quantize --dtype auto` writes the tensors it keeps in float
    float_dtype: torch.dtype = torch.float32


def load_float(path: str | None) -> FloatCheckpoint:
    location = embedded_default_gguf() if path in (None, DEFAULT) else Path(path)
    if location.is_file() and location.suffix == ".gguf":
        ckpt = load_gguf(location)
        config, tensors, tokenizer = ckpt.config, dict(ckpt.tensors()), ckpt.tokenizer()
    elif location.is_dir() and (location / "config.json").exists():
        config = AutoConfig.from_pretrained(str(location))
        if getattr(config, "quantization_config", None) is not None:
            raise UnsupportedModelError(f"{location} is already quantized; quantize its float checkpoint")
        tensors, tokenizer = dict(safetensors_weights(location)), AutoTokenizer.from_pretrained(str(location))
    else:
        raise UnsupportedModelError(f"{location} is neither 'default', a .gguf file nor a model directory")
    model_class(config)  # one of the architectures glmserve runs
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise UnsupportedModelError(f"{location}: weights do not match {type(model).__name__} "
                                    f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    if tied:
        model.tie_weights()
    return FloatCheckpoint(model.eval(), tokenizer, location, source_float_dtype(location, tensors))


def source_float_dtype(location: Path, tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype a checkpoint keeps its float tensors in: a folder's most common float dtype (bf16 for most HF
    models); bfloat16 for a GGUF file, whose float tensors here are its F32 norms and its blocks dequantized to float32
    (the embedding of the embedded SmolLM2 is Q8_0): bf16's 8 significant bits hold such a block's values closer than
    its own step (an int8 code of a float16 scale), at half of float32's bytes, and on CPU a quantized model's bf16
    lm_head runs from half the bytes (layers/half_linear.py)."""
    if location.suffix == ".gguf":
        return torch.bfloat16
    counts = Counter(t.dtype for t in tensors.values() if t.is_floating_point())
    return counts.most_common(1)[0][0] if counts else torch.float32
