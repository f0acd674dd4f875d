"""A checkpoint's float weights as a transformers model with one nn.Linear per Hugging Face parameter name
(q_proj, k_proj, ... unfused): what calibration hooks and `glmserve quantize` export need, and the float
reference the quantized checkpoints are compared with. The embedded default GGUF, a .gguf file (dequantized) or
an HF folder with safetensors."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    # {tensor name: the float dtype the source stores it in} (GGUFCheckpoint.stored_float_dtypes for a GGUF): what
    # `glmserve quantize --dtype auto` writes the tensors it keeps in float as (a name not here: float32)
    float_dtypes: dict[str, torch.dtype] = field(default_factory=dict)


def load_float(path: str | None) -> FloatCheckpoint:
    location = embedded_default_gguf() if path in (None, DEFAULT) else Path(path)
    if location.is_file() and location.suffix == ".gguf":
        ckpt = load_gguf(location)
        config, tensors, tokenizer = ckpt.config, dict(ckpt.tensors()), ckpt.tokenizer()
        stored = ckpt.stored_float_dtypes()
    elif location.is_dir() and (location / "config.json").exists():
        config = AutoConfig.from_pretrained(str(location))
        if getattr(config, "quantization_config", None) is not None:
            raise UnsupportedModelError(f"{location} is already quantized; quantize its float checkpoint")
        tensors, tokenizer = dict(safetensors_weights(location)), AutoTokenizer.from_pretrained(str(location))
        stored = {name: t.dtype for name, t in tensors.items() if t.is_floating_point()}
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
    return FloatCheckpoint(model.eval(), tokenizer, location, stored)
