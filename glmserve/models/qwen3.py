"""Qwen3: the Llama block with per-head RMSNorm on q and k (reference: transformers' models/qwen3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from glmserve.models.llama import DecoderOnlyLM, LlamaDecoderLayer

if TYPE_CHECKING:  # a type only: importing transformers costs ~2.5 s at server start
    from transformers import PretrainedConfig


class Qwen3ForCausalLM(DecoderOnlyLM):
    def make_layer(self, config: PretrainedConfig, index: int) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaDecoderLayer(config, self.rotary, qkv_bias=bias, o_bias=bias, qk_norm=True)
