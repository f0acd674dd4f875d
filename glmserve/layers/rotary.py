"""Rotary position embeddings: neox style (Llama, Qwen) and interleaved pairs (GLM), full or partial.

`inverse_frequencies` is the one rope-frequency function of every model (MLA's rope slice too): the
plain rule computed as transformers computes it, and transformers' ROPE_INIT_FUNCTIONS for scaled
variants (llama3, yarn, linear), so rope scaling matches the reference exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from glmserve import kernels

if TYPE_CHECKING:  # a type only: importing transformers costs ~2.5 s at server start
    from transformers import PretrainedConfig


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def default_inverse_frequencies(theta: float, rotary_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unscaled rope: theta ** (-2i / rotary_dim) for each pair i (float32, as transformers computes it)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=dtype) / rotary_dim))


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float, int]:
    """Returns (inv_freq, attention scaling, rotary dim) for heads of `head_dim` (MLA: its rope slice)."""
    params = rope_parameters(config)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return default_inverse_frequencies(params["rope_theta"], rotary_dim), 1.0, rotary_dim
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # scaled ropes only: not at every start

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling), rotary_dim


class RopeTables:
    """Precomputed cos/sin tables indexed by position; `cos_sin(positions)` runs once per step."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def to(self, device: torch.device, dtype: torch.dtype) -> RopeTables:
        self.cos_table = self.cos_table.to(device=device, dtype=dtype)
        self.sin_table = self.sin_table.to(device=device, dtype=dtype)
        return self

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, table width] (broadcast over heads)."""
        return self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)


class RotaryEmbedding(RopeTables):
    """Tables over the rotary dims (pairs duplicated as the layout wants; neox style keeps the sin table with
    its first half negated, see `_rotate`); `apply` in every layer."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int, interleaved: bool = False):
        with torch.device("cpu"):  # real tables even when the model is built on the meta device
            self._build(config, head_dim, max_positions, interleaved)

    def _build(self, config: PretrainedConfig, head_dim: int, max_positions: int, interleaved: bool) -> None:
        inv_freq, scaling, self.rotary_dim = inverse_frequencies(config, head_dim)
        self.interleaved = interleaved
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat([freqs, freqs], dim=-1)
        self.cos_table = emb.cos() * scaling
        sin = emb.sin() * scaling
        if not interleaved:  # rotate-half's sign folded into the table: [-x2, x1] * sin == [x2, x1] * signed sin
            half = self.rotary_dim // 2
            sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self.sin_table = sin

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Neox: the halves swapped (one roll; the sign is in the sin table); interleaved: pairs (-x2, x1)."""
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((-x2, x1), dim=-1).flatten(-2)
        return x.roll(self.rotary_dim // 2, dims=-1)

    def apply_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply` in place on x (returned): one C++ pass for neox rope on float32 or bf16 CPU rows (kernels
        `rope_neox_`, in float32), `apply`'s result copied back otherwise."""
        kernel = None if self.interleaved else kernels.op("rope_neox_", x.device, x.dtype)
        if kernel is not None and x.dim() == 3 and x.stride(-1) == 1 and cos.dtype == torch.float32:
            kernel(x, cos.reshape(x.shape[0], -1).contiguous(), sin.reshape(x.shape[0], -1).contiguous())
            return x
        return x.copy_(self.apply(x, cos, sin))

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] (q and k heads may come as one tensor: the same rotation per head)."""
        if self.rotary_dim == x.shape[-1]:
            return x * cos + self._rotate(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat([rot * cos + self._rotate(rot) * sin, rest], dim=-1)
