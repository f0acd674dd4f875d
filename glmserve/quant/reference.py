"""The oracle: dequantize a canonical QuantizedWeight to float and multiply with a plain matmul. Every other
backend is tested against it; it also runs any format on any device (slowly: it dequantizes per call)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmserve.quant.backend import register
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight

# E2M1 (NVFP4's values): code bits s e e m; codes 8..15 are the negatives of 0..7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def code_values(weight: QuantizedWeight) -> torch.Tensor:
    """The codes as float32 numbers (before zero points and scales)."""
    codes, spec = weight.codes, weight.spec
    if spec.type == "float" and spec.num_bits == 4:
        return torch.tensor(E2M1_VALUES, device=codes.device)[codes.long()]
    return codes.to(torch.float32)


def expand_to(per_group: torch.Tensor, spec: QuantSpec, shape: tuple[int, int]) -> torch.Tensor:
    """Scales / zeros / mins [out, groups] (as `spec` groups them) broadcast to the weight's [out, in]."""
    out, inp = shape
    t = per_group.to(torch.float32)
    if spec.strategy in ("tensor", "channel"):
        return t.expand(out, inp)
    if spec.strategy in ("group", "tensor_group"):
        return t.repeat_interleave(spec.group_size, dim=1)[:, :inp]
    if spec.strategy == "block":
        rows, cols = spec.block_structure
        return t.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)[:out, :inp]
    raise ValueError(f"strategy {spec.strategy!r} does not describe a weight")


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] float: (value(codes) - zeros) * scales / global_scale + mins."""
    spec, shape = weight.spec, weight.shape
    w = code_values(weight)
    if weight.zeros is not None:
        w = w - expand_to(weight.zeros, spec, shape)
    scales = weight.scales.to(torch.float32)
    if weight.global_scale is not None:
        scales = scales / weight.global_scale.to(torch.float32)
    w = w * expand_to(scales, spec, shape)
    if weight.mins is not None:
        w = w + expand_to(weight.mins, spec, shape)
    return w.to(dtype)


def dequantize_rows(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` [n] of the weight in float [n, in]: only these rows are dequantized (an embedding lookup)
    where scales are per row (channel, group); per tensor or block, the whole matrix is (slow: inspection)."""
    if weight.spec.strategy in ("tensor", "block"):
        return dequantize(weight, dtype)[ids]
    return dequantize(weight.take_rows(ids), dtype)  # GGUF blocks: only these rows' blocks are unpacked


class ReferenceBackend:
    """Keeps the canonical form; each call dequantizes it and runs F.linear in the activations' dtype.
    Activation quantization (W8A8's dynamic int8 tokens) is emulated: quantize, dequantize, then matmul."""

    name = "reference"

    def supports(self, weight: QuantSpec, activations: QuantSpec | None, device: torch.device) -> bool:
        return True

    def prepare(self, weight: QuantizedWeight, activations: QuantSpec | None, device: torch.device):
        return weight, activations

    def apply(self, prepared, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight, activations = prepared
        if activations is not None:
            x = fake_quantize_activations(x, activations)
        return F.linear(x, dequantize(weight, x.dtype), bias)

    def dequantize_rows(self, prepared, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(prepared[0], ids, dtype)


def fake_quantize_activations(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Dynamic symmetric activation quantization, quantized and dequantized again: int8 or float8 E4M3 per token,
    or per group of `group_size` inputs of each token (DeepSeek-V3's 1x128 activation tiles, arXiv 2412.19437
    section 3.3.2). Inputs that are not a multiple of the group size end in one shorter group (SmolLM2's 576 =
    4 x 128 + 64): zero padding, which leaves each group's absmax unchanged, and cut again after."""
    rows = x.float()
    if spec.strategy == "group":
        inp = x.shape[-1]
        rows = F.pad(rows, (0, -inp % spec.group_size)).unflatten(-1, (-1, spec.group_size))
    amax = rows.abs().amax(dim=-1, keepdim=True)
    if spec.type == "float":
        fmax = torch.finfo(torch.float8_e4m3fn).max
        scale = (amax / fmax).clamp_min(1e-12)
        q = (rows / scale).to(torch.float8_e4m3fn).float()
    else:
        qmax = 2 ** (spec.num_bits - 1) - 1
        scale = (amax / qmax).clamp_min(1e-12)
        q = torch.round(rows / scale).clamp(-qmax - 1, qmax)
    q = q * scale
    if spec.strategy == "group":
        q = q.flatten(-2)[..., :x.shape[-1]]
    return q.reshape(x.shape).to(x.dtype)


def fake_quantize_inputs(x: torch.Tensor, spec: QuantSpec, kept: torch.Tensor | None) -> torch.Tensor:
    """fake_quantize_activations, with the input channels `kept` in float (outlier columns, whose weights are float
    too: LLM.int8()'s decomposition) left out of the rounding and of its scale."""
    if kept is None:
        return fake_quantize_activations(x, spec)
    rest = torch.ones(x.shape[-1], dtype=torch.bool)
    rest[kept] = False
    out = x.clone()
    out[..., rest] = fake_quantize_activations(x[..., rest], spec)
    return out


register(ReferenceBackend(), priority=0)
