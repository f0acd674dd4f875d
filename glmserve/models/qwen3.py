"""Qwen3: the Llama block with per-head RMSNorm on q and k (reference: transformers' models/qwen3)."""

from torch import nn
from transformers import PretrainedConfig

from glmserve.models.llama import DecoderOnlyLM, LlamaDecoderLayer


class Qwen3ForCausalLM(DecoderOnlyLM):
    def make_layer(self, config: PretrainedConfig, index: int) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaDecoderLayer(config, self.rotary, qkv_bias=bias, o_bias=bias, qk_norm=True)
