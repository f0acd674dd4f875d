"""Qwen2: the Llama block with a bias on q/k/v (reference: transformers' models/qwen2)."""

from torch import nn
from transformers import PretrainedConfig

from glmserve.models.llama import DecoderOnlyLM, LlamaDecoderLayer


class Qwen2ForCausalLM(DecoderOnlyLM):
    def make_layer(self, config: PretrainedConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(config, self.rotary, qkv_bias=True, o_bias=False, qk_norm=False)
