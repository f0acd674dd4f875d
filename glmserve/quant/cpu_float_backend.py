"""`cpu_float_block`: our own CPU kernel (kernels/csrc/float_quant_matmul.cpp) for float quantized weights,
dequantized inside the kernel, priority 10 (above `reference`, which dequantizes the whole weight per call).

Formats: FP8 E4M3 weights by tensor, channel, group or block (compressed-tensors `float-quantized`; the `fp8`
and `fp8-block` 128x128 schemes), with float activations or the fp8 schemes' dynamic E4M3 activations (per
token inside the kernel; per 1x128 tile, `fp8-block-g128`, by the kernel's row rounding run on the tiles
first); NVFP4 (E2M1 codes, an E4M3 scale per 16 inputs, an fp32 global scale). Groups and block columns must
be multiples of 16 inputs; block rows are any.

At `prepare` the weight is repacked once (the canonical tensors are not kept): rows interleaved in tiles of
16 (as the int kernels do), in_features padded to a multiple of 16 and out_features to 16 with zero codes.
FP8 keeps its code bytes and one float32 scale per row and group (channel and tensor: one group; a 128x128
block's scale repeated on its 128 rows, 4 bytes per 128 weights), folded with the kernel's 2^120 decoding
factor; NVFP4 keeps its nibbles (two inputs a byte) and its E4M3 scale bytes, the global scale folded into
one float. So the bytes a matmul reads per weight are 1 + 4 / group for FP8 (1.03 for 128x128 blocks, ~1 per
channel) and 0.5 + 1 / 16 for NVFP4, against 4 for float32.

Float outlier columns (a WeightWithFloatColumns: input columns kept in float beside zero codes) are packed with
the codes (their float32 rows in the same tiles) and their product added inside the kernel call, the rows the codes
multiply having those columns zeroed first; not with fp8 activation tiles (`fp8-block-g128`, whose rows are rounded
before the kernel), where the layer adds them (layers/linear.py) as for other backends.

Numerics: from 17 rows on (AVX-512; 9 on AVX2 and scalar) the kernel multiplies by weights bit-identical to
reference.dequantize for FP8 (value * scale, one fp32 rounding) and within one fp32 rounding of it for NVFP4 (the
scale is value(s) * (2^120 / global) instead of s / global); below that it sums x * value over each scale group
and multiplies the group's sum by the scale once (one rounding per weight fewer or more than the reference's, as
the sums fall).
fp8 activations are fake-quantized per row exactly as the reference does. What differs from `reference` is the
order and grouping of the fp32 sums (tests/test_float_quant_kernels.py bounds it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glmserve import kernels
from glmserve.errors import InvalidRequestError
from glmserve.quant.backend import register
from glmserve.quant.reference import E2M1_VALUES
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight, WeightWithFloatColumns

ROWS = 16  # output rows per tile (the kernel's)
NO_COLUMNS = torch.empty(0, dtype=torch.long)  # a weight without float columns (the kernel's empty arguments)
PAD = 16  # in_features are padded to a multiple of this (the kernel's)
DECODE = 2.0 ** 120  # the kernel decodes an E4M3 code to value * 2^-120 (csrc/float_quant_matmul.cpp)
FP32_LIMIT = 2.0 ** 127  # folded scales stay below this


@dataclass
class PackedFloatWeight:
    """codes [tiles, kp (fp8) or kp / 2 (fp4), 16] uint8; scales [tiles, groups, 16]: float32 (fp8, times
    2^120 / post) or E4M3 bytes (fp4); factor: fp4's 2^120 / (global * post); post: the power of two the
    kernel multiplies the output by (1 unless a scale is huge); global_scale: NVFP4's, for dequantize_rows."""

    codes: torch.Tensor
    scales: torch.Tensor
    fp4: bool
    group: int
    factor: float
    post: float
    global_scale: torch.Tensor | None
    in_features: int
    out_features: int
    fp8_tokens: bool
    linear: Callable
    fp8_group: int | None = None  # activations rounded per 1 x fp8_group tile (before the kernel), else None
    round_rows: Callable | None = None
    columns: torch.Tensor = NO_COLUMNS  # [n] int64: input columns kept in float (none: empty)
    float_part: torch.Tensor = NO_COLUMNS  # [tiles, n, 16] float32: their weights, rows as the codes'

    @property
    def nbytes(self) -> int:
        """The bytes a matmul reads of this weight."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.columns, self.float_part))

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """The kernel on float32 contiguous [T, in] rows (activation tiles rounded first where the format has them)."""
        if self.fp8_group is not None:
            rows = _fp8_tiles(rows, self.fp8_group, self.round_rows)
        return self.linear(rows, self.fp8_tokens, self.codes, self.scales, self.fp4, self.group, self.factor, self.post,
                           self.out_features, self.columns, self.float_part)


def _weight_format_supported(spec: QuantSpec) -> bool:
    if spec.type != "float" or spec.dynamic or not spec.symmetric or spec.gguf_type is not None:
        return False
    if spec.num_bits == 8:
        if spec.strategy in ("tensor", "channel"):
            return True
        if spec.strategy == "group":
            return spec.group_size is not None and spec.group_size % PAD == 0
        return spec.strategy == "block" and spec.block_structure is not None and spec.block_structure[1] % PAD == 0
    return (spec.num_bits == 4 and spec.strategy == "tensor_group" and spec.group_size is not None
            and spec.group_size % PAD == 0)


def _activations_supported(activations: QuantSpec | None) -> bool:
    """Float activations, or dynamic E4M3 per token or per group of inputs (what the reference emulates for the
    fp8 schemes)."""
    return activations is None or (activations.type == "float" and activations.num_bits == 8
                                   and activations.dynamic and activations.symmetric
                                   and (activations.strategy == "token"
                                        or (activations.strategy == "group" and bool(activations.group_size))))


def _fp8_tiles(x: torch.Tensor, group: int, rows_op: Callable) -> torch.Tensor:
    """x [n, in] rounded to E4M3 per 1 x `group` tile by the kernel's per-row rounding (fp8_fake_quantize_rows)
    on the tiles as rows; the zero padding of a last, shorter tile leaves its absmax unchanged."""
    n, inp = x.shape
    tiles = F.pad(x, (0, -inp % group)).reshape(-1, group).contiguous()
    return rows_op(tiles).reshape(n, -1)[:, :inp]


def _group(spec: QuantSpec, kp: int) -> int:
    """Inputs per scale along a row (the whole padded row for tensor and channel scales)."""
    if spec.strategy in ("tensor", "channel"):
        return kp
    return spec.block_structure[1] if spec.strategy == "block" else spec.group_size


def _row_scales(weight: QuantizedWeight) -> torch.Tensor:
    """The weight's scales as float64 [out, groups]: one per output row and group of inputs."""
    spec, (out, _) = weight.spec, weight.shape
    s = weight.scales.to(torch.float64)
    if spec.strategy == "block":
        return s.repeat_interleave(spec.block_structure[0], dim=0)[:out]
    return s.expand(out, -1) if s.shape[0] == 1 else s


def tiled(t: torch.Tensor, tiles: int, width: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[out, n] -> [tiles, width, 16] (width: n unless given): rows padded to whole tiles and columns to `width` with
    zeros, each tile's 16 rows innermost, converted to `dtype` (default: t's) in the same single copy."""
    out, n = t.shape
    packed = torch.zeros(tiles, n if width is None else width, ROWS, dtype=dtype or t.dtype, device=t.device)
    rows = packed.permute(0, 2, 1)  # the same memory as [tiles, 16, width]
    full = out // ROWS
    rows[:full, :, :n].copy_(t[:full * ROWS].reshape(full, ROWS, n))
    if out % ROWS:
        rows[full, :out % ROWS, :n].copy_(t[full * ROWS:])
    return packed


def _post(largest: float) -> float:
    """The power of two that brings `largest` (a folded scale before it) below FP32_LIMIT."""
    post = 1.0
    while largest / post >= FP32_LIMIT:
        post *= 2.0 ** 8
    return post


def _e4m3_bytes(scales: torch.Tensor) -> torch.Tensor:
    """NVFP4 scales as E4M3 bytes; float scales are taken where they are E4M3 values exactly."""
    if scales.dtype != torch.float8_e4m3fn:
        as_fp8 = scales.to(torch.float8_e4m3fn)
        if not torch.equal(as_fp8.to(torch.float32), scales.to(torch.float32)):
            raise InvalidRequestError("NVFP4 scales must be E4M3 numbers")
        scales = as_fp8
    return scales.view(torch.uint8)


class CpuFloatBlockBackend:
    """Repacks once at load, then one kernel call per matmul (fp8 activation quantization included)."""

    name = "cpu_float_block"

    def supports(self, weight: QuantSpec, activations: QuantSpec | None, device: torch.device) -> bool:
        return (device.type == "cpu" and _weight_format_supported(weight) and _activations_supported(activations)
                and kernels.op("float_quant_linear", device, torch.float32) is not None)

    def prepare(self, weight: QuantizedWeight, activations: QuantSpec | None,
                device: torch.device) -> PackedFloatWeight:
        if not self.supports(weight.spec, activations, device):
            raise InvalidRequestError(f"{self.name} does not run {weight.spec} (activations {activations}) on {device}")
        spec, (out, inp) = weight.spec, weight.shape
        kp, tiles = -(-inp // PAD) * PAD, -(-out // ROWS)
        group = _group(spec, kp)
        fp4 = spec.num_bits == 4
        if fp4:
            c = F.pad(weight.codes.to(torch.uint8), (0, kp - inp))
            if int(c.max()) > 15:
                raise InvalidRequestError(f"{spec}: codes outside E2M1's 0..15")
            codes = tiled(c[:, 0::2] | (c[:, 1::2] << 4), tiles)
            scales = tiled(_e4m3_bytes(weight.scales), tiles)
            g = 1.0 if weight.global_scale is None else float(weight.global_scale)
            post = _post(DECODE / g)
            factor, global_scale = DECODE / (g * post), weight.global_scale
        else:
            if weight.codes.dtype != torch.float8_e4m3fn:
                raise InvalidRequestError(f"{spec}: codes must be float8_e4m3fn, not {weight.codes.dtype}")
            codes = tiled(weight.codes.view(torch.uint8), tiles, kp)
            row_scales = _row_scales(weight)
            post = _post(float(row_scales.abs().max()) * DECODE)
            scales = tiled(row_scales * (DECODE / post), tiles, dtype=torch.float32)
            factor, global_scale = 1.0, None
        act_tiles = activations is not None and activations.strategy == "group"
        packed = PackedFloatWeight(codes, scales, fp4, group, factor, post, global_scale, inp, out,
                                   fp8_tokens=activations is not None and not act_tiles,
                                   linear=kernels.op("float_quant_linear", device, torch.float32),
                                   fp8_group=activations.group_size if act_tiles else None,
                                   round_rows=kernels.op("fp8_fake_quantize_rows", device, torch.float32)
                                   if act_tiles else None)
        if isinstance(weight, WeightWithFloatColumns) and not act_tiles:
            packed.columns = weight.outliers.columns.to(torch.long).contiguous()
            packed.float_part = tiled(weight.outliers.weight, tiles, dtype=torch.float32)
        return packed

    def keeps_float_columns(self, prepared: PackedFloatWeight) -> bool:
        """Whether `apply` adds the weight's float columns itself (then the layer does not)."""
        return prepared.columns.numel() > 0

    def apply(self, prepared: PackedFloatWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        p = prepared
        if x.shape[-1] != p.in_features:
            raise InvalidRequestError(f"input has {x.shape[-1]} features, the weight takes {p.in_features}")
        out = p.matmul(x.reshape(-1, p.in_features).to(torch.float32))
        if bias is not None:
            out += bias.to(torch.float32)
        return out.reshape(*x.shape[:-1], p.out_features).to(x.dtype)

    def small_batch(self, prepared: PackedFloatWeight) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
        """`apply` of float32 contiguous [T, in] rows without bias as one bound kernel call (a decode step's straight
        line of calls, models/llama_decode.py), and the row count from which `apply` differs: none."""
        return prepared.matmul, sys.maxsize

    def dequantize_rows(self, prepared: PackedFloatWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight from the packed layout, equal to reference.dequantize's rows."""
        p = prepared
        tile, row = ids // ROWS, ids % ROWS
        codes, scales = p.codes[tile, :, row], p.scales[tile, :, row]  # [n, kp or kp / 2], [n, groups]
        if p.fp4:
            nibbles = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(1)
            values = torch.tensor(E2M1_VALUES, device=codes.device)[nibbles.long()]
            scale = scales.view(torch.float8_e4m3fn).to(torch.float32)
            if p.global_scale is not None:
                scale = scale / p.global_scale.to(torch.float32)
        else:
            values = codes.view(torch.float8_e4m3fn).to(torch.float32)
            scale = scales * (p.post / DECODE)  # exact: powers of two
        w = values[:, :p.in_features] * scale.repeat_interleave(p.group, dim=1)[:, :p.in_features]
        if p.columns.numel():
            w[:, p.columns] = p.float_part[tile, :, row]
        return w.to(dtype)


register(CpuFloatBlockBackend(), priority=10)
