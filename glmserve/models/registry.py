"""Maps a Hugging Face architecture name to our model class."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from glmserve.errors import UnsupportedModelError

if TYPE_CHECKING:  # a type only: importing transformers costs ~2.5 s at server start
    from transformers import PretrainedConfig

_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "glmserve.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "glmserve.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "glmserve.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "glmserve.models.qwen3:Qwen3ForCausalLM",
    "Glm4ForCausalLM": "glmserve.models.glm4:Glm4ForCausalLM",
    "GlmMoeDsaForCausalLM": "glmserve.models.glm_moe_dsa:GlmMoeDsaForCausalLM",
    "DeepseekV32ForCausalLM": "glmserve.models.glm_moe_dsa:DeepseekV32ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class(config: PretrainedConfig) -> type:
    for arch in getattr(config, "architectures", None) or []:
        if arch in _ARCHITECTURES:
            module, _, cls = _ARCHITECTURES[arch].partition(":")
            return getattr(importlib.import_module(module), cls)
    raise UnsupportedModelError(
        f"unsupported architecture {getattr(config, 'architectures', None)}; "
        f"supported: {', '.join(supported_architectures())}"
    )
