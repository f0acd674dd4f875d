"""Llama family (Llama 2/3, SmolLM2, Mistral-style dense models) on the paged KV cache.

Reference: transformers' models/llama/modeling_llama.py. q|k|v and gate|up are fused into
one matmul each; the flat batch is [tokens, hidden] with no padding. Qwen2 (qkv bias) and
Qwen3 (per-head q/k RMSNorm) reuse these blocks with their flags.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from glmserve import kernels
from glmserve.kv.kv_format import KVFormat, kv_format
from glmserve.layers.attention import AttentionMetadata, PagedAttention
from glmserve.layers.embedding import unset_embedding
from glmserve.layers.linear import MergedLinear, bf16_between, dense_swiglu_matmul, swiglu_matmul
from glmserve.layers.norm import RMSNorm
from glmserve.layers.paged_metadata import StepRows, paged_metadata
from glmserve.layers.rotary import RotaryEmbedding
from glmserve.models.llama_decode import decode_step, run_decode
from glmserve.models.weights import CheckpointLayout, LoadsCheckpoint
from glmserve.sparse.indexer import attached_modes

if TYPE_CHECKING:  # a type only: importing transformers costs ~2.5 s at server start
    from transformers import PretrainedConfig


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                stream_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: the normed hidden states [T, hidden]; q/k/v, rope and the KV write run in `stream_dtype` (the
        residual stream's; None: x's), so that x may come narrower (bf16 on AMX prefill, where qkv_proj's GEMM is
        bf16). Returns [T, hidden] in that dtype, or bf16 where o_proj's GEMM is bf16."""
        t, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if qkv.dtype != torch.bfloat16 or self.q_norm is not None or not self.attn.takes_bf16(meta):
            qkv = qkv.to(stream_dtype or x.dtype)  # else kept bf16: the AMX prefill reads q, k, v in bf16
        v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
        qk = qkv[:, :(heads + kv_heads) * d].view(t, heads + kv_heads, d)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        q, k = self.rotary.apply_(qk, *cos_sin).split([heads, kv_heads], dim=1)  # one rotation for q and k heads
        return self.o_proj(self.attn(q, k, v, meta, _gemm_dtype(qkv, self.o_proj)))  # bf16 for o_proj's AMX GEMM


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] in x's dtype; computed in bf16 when both projections run a bf16 GEMM
        (AMX prefill: the wide gate-up output is then never widened to float32)."""
        h = x.to(_gemm_dtype(x, self.gate_up_proj, self.down_proj))
        gated = self._gated(h)
        if gated is not None:
            return self.down_proj(gated(h)).to(x.dtype)  # the gate-up product never written out
        return self.down_proj(silu_and_mul(self.gate_up_proj(h))).to(x.dtype)

    def _gated(self, h: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """gate-up and SwiGLU as one call for the rows h where the backend has one: the int8 tiles' for float32 rows
        below their limit, the bf16 GEMM's for bf16 rows from where it starts; None otherwise."""
        if h.dim() != 2 or not h.is_contiguous() or h.device.type != "cpu":
            return None
        if h.dtype == torch.float32:
            fused = swiglu_matmul(self.gate_up_proj)
            return fused[0] if fused is not None and h.shape[0] < fused[1] else None
        fused = dense_swiglu_matmul(self.gate_up_proj) if h.dtype == torch.bfloat16 else None
        return fused[0] if fused is not None and h.shape[0] >= fused[1] else None


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of a fused [T, 2I] gate-up output: one C++ pass on CPU (kernels `silu_and_mul`,
    float32 inside, rounded once), PyTorch ops otherwise."""
    kernel = kernels.op("silu_and_mul", gate_up.device, gate_up.dtype)
    if kernel is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
        return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, o_bias, qk_norm)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> torch.Tensor:
        """x: the residual stream [T, hidden] (the model's own tensor), += delta (the previous layer's output, not
        yet added; None: nothing) and this layer's attention output in place; returns this layer's MLP output, not
        yet added (DecoderOnlyLM.forward hands it to the next layer, as the fused decode path does). Each norm hands
        its output in the dtype the next projection's GEMM takes (bf16 on AMX prefill); the residual adds are fused
        into the norms after them where the kernels run (RMSNorm.add_norm: the MLP's bf16 output is added in the
        next norm's pass, not widened and added on its own)."""
        h = self.input_layernorm.add_norm(x, delta, _gemm_dtype(x, self.self_attn.qkv_proj))
        attn = self.self_attn(h, cos_sin, meta, x.dtype)
        h = self.post_attention_layernorm.add_norm(
            x, attn, _gemm_dtype(x, self.mlp.gate_up_proj, self.mlp.down_proj))
        return self.mlp(h)


def _gemm_dtype(x: torch.Tensor, *linears: nn.Module) -> torch.dtype:
    """bf16 where float32 activations `x` may enter `linears` as bf16 (layers/linear.py `bf16_between`), else x's."""
    return torch.bfloat16 if bf16_between(x, *linears) else x.dtype


class DecoderOnlyLM(LoadsCheckpoint, nn.Module):
    """Embedding, a stack of decoder layers, final norm and LM head; subclasses pick the layer."""

    checkpoint_layout = CheckpointLayout(fused={
        "q_proj.{kind}": ("qkv_proj.{kind}", 0),
        "k_proj.{kind}": ("qkv_proj.{kind}", 1),
        "v_proj.{kind}": ("qkv_proj.{kind}", 2),
        "gate_proj.{kind}": ("gate_up_proj.{kind}", 0),
        "up_proj.{kind}": ("gate_up_proj.{kind}", 1),
    })
    interleaved_rope = False
    supports_kv_offload = True  # PagedAttention layers: chunks can leave the pool (glmserve/kv/offload.py)
    reads_quantized_kv = True  # ... and read int8 / fp8 rows (glmserve/kv/kv_format.py)

    def __init__(self, config: PretrainedConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.rotary = RotaryEmbedding(config, self.head_dim, max_positions, self.interleaved_rope)
        self.embed_tokens = unset_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([self.make_layer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # tied by load_weights

    def make_layer(self, config: PretrainedConfig, index: int) -> nn.Module:
        raise NotImplementedError

    def kv_bytes_per_token(self, dtype: torch.dtype | str | KVFormat) -> int:
        """Pool bytes per token in KV format `dtype` (glmserve/kv/kv_format.py; quantized: scales counted)."""
        return 2 * self.num_layers * self.num_kv_heads * kv_format(dtype).bytes_per_row(self.head_dim)

    def bind_kv_cache(self, num_slots: int, dtype: torch.dtype | str | KVFormat, device: torch.device,
                      zero_slots: int = 0) -> torch.Tensor:
        """Allocates the KV pool ([layers, 2, kv_heads, slots, width]: width = head_dim, or head_dim codes + the
        row's scale in a quantized KV format) and hands each layer its slice.

        torch.empty: pages are only touched (and counted in RSS) once KV is written there. The first
        `zero_slots` slots (the null block that padding points at) are zeroed.
        """
        fmt = kv_format(dtype)
        pool = torch.empty((self.num_layers, 2, self.num_kv_heads, num_slots, fmt.row_width(self.head_dim)),
                           dtype=fmt.storage, device=device)
        pool[:, :, :, :zero_slots].zero_()
        for i, layer in enumerate(self.layers):
            layer.self_attn.attn.kv_cache = pool[i]
            layer.self_attn.attn.layer_index = i
        return pool

    def paged_attention_layers(self) -> list[PagedAttention]:
        """Each decoder layer's PagedAttention, in layer order: where sparse scorers attach
        (glmserve/sparse/indexer.py `ScoredLayer`)."""
        return [layer.self_attn.attn for layer in self.layers]

    def sparse_modes(self) -> tuple[str, ...]:
        """Sparse attention modes this model serves now: dense, and each mode whose scorer every layer has."""
        return ("dense", *attached_modes(self.paged_attention_layers()))

    def attention_metadata(self, step: StepRows) -> AttentionMetadata:
        """The step's groups for paged attention (layers/paged_metadata.py)."""
        return paged_metadata(step)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_index: torch.Tensor) -> torch.Tensor:
        """Flat batch in, logits of the rows in `logits_index` out ([S, vocab], float32)."""
        x = self.embed_tokens(input_ids)
        step = decode_step(self, x, positions, meta)  # decode rows only: the layers' straight-line C++ calls
        if step is None or not run_decode(self, x, step):
            cos_sin = self.rotary.cos_sin(positions)
            delta = None  # each layer updates x in place and returns its last residual term, not yet added
            for layer in self.layers:
                delta = layer(x, cos_sin, meta, delta)
            x = x[logits_index].add_(delta[logits_index])  # only the rows that become logits
        else:
            x = x[logits_index]
        return self.lm_head(self.norm(x)).float()


class LlamaForCausalLM(DecoderOnlyLM):
    def make_layer(self, config: PretrainedConfig, index: int) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaDecoderLayer(config, self.rotary, qkv_bias=bias, o_bias=bias, qk_norm=False)
