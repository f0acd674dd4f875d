"""GLM-4 (`Glm4ForCausalLM`): Llama-like with extra post-attention / post-MLP norms, q/k/v bias,
and rotary on half of each head in interleaved pairs (reference: transformers' models/glm4).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from glmserve.layers.attention import AttentionMetadata
from glmserve.layers.norm import RMSNorm
from glmserve.layers.rotary import RotaryEmbedding
from glmserve.models.llama import DecoderOnlyLM, GatedMLP, LlamaAttention

if TYPE_CHECKING:  # a type only: importing transformers costs ~2.5 s at server start
    from transformers import PretrainedConfig


class Glm4DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding):
        super().__init__()
        bias = bool(getattr(config, "attention_bias", True))
        self.self_attn = LlamaAttention(config, rotary, qkv_bias=bias, o_bias=False, qk_norm=False)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos_sin, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaDecoderLayer.forward: x += delta and the attention's normed output in place; returns the MLP's
        normed output, not yet added."""
        if delta is not None:
            x.add_(delta)
        x.add_(self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, meta).to(x.dtype)))
        return self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))


class Glm4ForCausalLM(DecoderOnlyLM):
    interleaved_rope = True

    def make_layer(self, config: PretrainedConfig, index: int) -> nn.Module:
        return Glm4DecoderLayer(config, self.rotary)
