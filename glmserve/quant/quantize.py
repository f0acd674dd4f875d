"""Round-to-nearest quantization of a float weight [out, in] into a canonical QuantizedWeight, for every
compressed-tensors format we run (int8/int4 by tensor, channel, group or block, symmetric or with zero
points; float8 E4M3; NVFP4). Scales follow compressed-tensors' calculate_qparams
(compressed_tensors/quantization/utils/helpers.py): symmetric int: amax / qmax; asymmetric: (max - min) /
(2^bits - 1) with an integer zero point; float8: amax / 448; NVFP4: a global scale 448 * 6 / amax and a
float8 scale per 16 inputs. Asymmetric int weights with a float minimum (spec.float_min: w = s * q + m, float16
s and m, GGUF Q4_1's form) take s = (max - min) / (2^bits - 1) and m = min, as llama.cpp's quantize_row_q4_1_ref
does (ggml-quants.c), without the integer zero point's constraint that 0 be on the grid. Calibrated methods
(GPTQ, AWQ, the scale search) build on the same functions; `shrink` scales each group's range (int: min and max;
float8: amax) by a factor before the scale is set (scale_search.py)."""

from __future__ import annotations

import torch

from glmserve.quant.gguf_blocks import quantize_blocks
from glmserve.quant.reference import E2M1_VALUES
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
FP4_MAX = 6.0
FP16_TINY = 2.0 ** -24  # the smallest positive float16


def grouped(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """w [out, in] as [out, groups, group_len] (channel: one group per row; tensor: one group; block:
    [row_blocks, col_blocks, rows * cols]) so that scales are reductions over the last dim."""
    out, inp = w.shape
    if spec.strategy == "tensor":
        return w.reshape(1, 1, -1)
    if spec.strategy == "channel":
        return w.reshape(out, 1, inp)
    if spec.strategy in ("group", "tensor_group"):
        g = spec.group_size
        if inp % g:
            raise ValueError(f"in_features {inp} is not a multiple of the group size {g}")
        return w.reshape(out, inp // g, g)
    if spec.strategy == "block":
        r, c = spec.block_structure
        pad_r, pad_c = -out % r, -inp % c
        p = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
        return p.reshape((out + pad_r) // r, r, (inp + pad_c) // c, c).permute(0, 2, 1, 3).flatten(2)
    raise ValueError(f"strategy {spec.strategy!r} does not describe a weight")


def ungrouped(g: torch.Tensor, spec: QuantSpec, shape: tuple[int, int]) -> torch.Tensor:
    """The inverse of `grouped`."""
    out, inp = shape
    if spec.strategy == "block":
        r, c = spec.block_structure
        rb, cb = g.shape[:2]
        return g.reshape(rb, cb, r, c).permute(0, 2, 1, 3).reshape(rb * r, cb * c)[:out, :inp]
    return g.reshape(out, inp)


def quantize(w: torch.Tensor, spec: QuantSpec, shrink: torch.Tensor | float | None = None) -> QuantizedWeight:
    """Round-to-nearest `w` [out, in] under `spec` (a weight spec: not dynamic); GGUF block formats as
    llama.cpp rounds them (glmserve/quant/gguf_blocks.py). `shrink` (int and float8 formats): a factor per group,
    broadcastable to grouped(w, spec)[..., :1], applied to the range the scale is set from (below 1: values beyond
    it are clipped; float8 above 1: no clipping, the E4M3 grid shifted against the weights)."""
    if spec.gguf_type is not None or (spec.type == "float" and spec.num_bits == 4):
        if shrink is not None:
            raise ValueError(f"a range factor applies to integer and float8 weights, not {spec}")
        return quantize_blocks(w, spec) if spec.gguf_type is not None else _quantize_nvfp4(w.detach().float(), spec)
    w = w.detach().to(torch.float32)
    if spec.type == "float" and spec.num_bits == 8:
        return _quantize_fp8(w, spec, 1.0 if shrink is None else shrink)
    return _quantize_int(w, spec, 1.0 if shrink is None else shrink)


def _squeeze(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(-1)


def _quantize_int(w: torch.Tensor, spec: QuantSpec, shrink: torch.Tensor | float) -> QuantizedWeight:
    g = grouped(w, spec)
    if spec.float_min:
        return _quantize_float_min(w, g, spec, shrink)
    if spec.symmetric:
        qmax = 2 ** (spec.num_bits - 1) - 1
        scale = (g.abs().amax(dim=-1, keepdim=True) * shrink / qmax).clamp_min(1e-12)
        codes = torch.round(g / scale).clamp(-qmax - 1, qmax)
        zeros = None
    else:
        levels = 2 ** spec.num_bits - 1
        lo = g.amin(dim=-1, keepdim=True).clamp(max=0) * shrink
        hi = g.amax(dim=-1, keepdim=True).clamp(min=0) * shrink
        scale = ((hi - lo) / levels).clamp_min(1e-12)
        zero = torch.round(-lo / scale).clamp(0, levels)
        codes = torch.round(g / scale + zero).clamp(0, levels)
        zeros = _squeeze(zero).to(torch.int8 if spec.num_bits < 8 else torch.int16)
    return QuantizedWeight(spec, ungrouped(codes, spec, w.shape).to(torch.int8 if spec.symmetric or spec.num_bits < 8
                                                                      else torch.uint8),
                           _squeeze(scale), zeros=zeros)


def _quantize_float_min(w: torch.Tensor, g: torch.Tensor, spec: QuantSpec,
                        shrink: torch.Tensor | float) -> QuantizedWeight:
    """w = s * q + m per group, q in [0, 2^bits - 1], float16 s = (max - min) / (2^bits - 1) and m = min of the
    range scaled by `shrink` (as the integer zero point's: both ends towards 0, GPTQ's quant.py find_params).
    A weight already on such a grid (a GGUF Q4_1 tensor dequantized) is reproduced exactly."""
    levels = 2 ** spec.num_bits - 1
    lo = (g.amin(dim=-1, keepdim=True) * shrink).to(torch.float16)
    hi = g.amax(dim=-1, keepdim=True) * shrink
    scale = ((hi - lo.float()) / levels).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.full_like(scale, FP16_TINY))  # a constant group: any scale
    codes = min_codes(g, scale.float(), lo.float(), levels)
    return QuantizedWeight(spec, ungrouped(codes, spec, w.shape).to(torch.int8), _squeeze(scale), mins=_squeeze(lo))


def min_codes(w: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, levels: int) -> torch.Tensor:
    """The nearest codes q in [0, levels] of w = scale * q + minimum (float codes, broadcast shapes)."""
    return torch.round((w - minimum) / scale).clamp(0, levels)


def _quantize_fp8(w: torch.Tensor, spec: QuantSpec, shrink: torch.Tensor | float) -> QuantizedWeight:
    g = grouped(w, spec)
    scale = (g.abs().amax(dim=-1, keepdim=True) * shrink / FP8_MAX).clamp_min(1e-12)
    codes = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(spec, ungrouped(codes.float(), spec, w.shape).to(torch.float8_e4m3fn), _squeeze(scale))


def _quantize_nvfp4(w: torch.Tensor, spec: QuantSpec) -> QuantizedWeight:
    g = grouped(w, spec)  # [out, in / 16, 16]
    global_scale = (FP8_MAX * FP4_MAX / w.abs().amax().clamp_min(1e-12)).reshape(())
    block_scale = (g.abs().amax(dim=-1, keepdim=True) / FP4_MAX * global_scale).clamp(max=FP8_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    effective = (block_scale.float() / global_scale).clamp_min(1e-12)
    values = torch.tensor(E2M1_VALUES[:8])
    scaled = g / effective
    nearest = (scaled.abs().unsqueeze(-1) - values).abs().argmin(dim=-1)  # magnitude code 0..7
    codes = (nearest + 8 * (scaled < 0)).to(torch.uint8)
    return QuantizedWeight(spec, ungrouped(codes, spec, w.shape), _squeeze(block_scale), global_scale=global_scale)
