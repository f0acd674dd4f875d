"""Qwen2: the Llama block with a bias on q/k/v (reference: transformers' models/qwen2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from glmserve.models.llama import DecoderOnlyLM, LlamaDecoderLayer

if TYPE_CHECKING:  # a type only: importing transformers costs ~2.5 s at server start
    from transformers import PretrainedConfig


class Qwen2ForCausalLM(DecoderOnlyLM):
    def make_layer(self, config: PretrainedConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(config, self.rotary, qkv_bias=True, o_bias=False, qk_norm=False)
