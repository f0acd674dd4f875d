"""A linear layer's weight in canonical form: integer (or float8/float4) codes plus scales, laid out
[out_features, in_features] with groups along in_features. The reference backend computes from it, checkpoints
are read into and written from it, and every other backend repacks it once at load (then it is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmserve.quant.spec import QuantSpec


@dataclass
class QuantizedWeight:
    """w[o, i] = (value(codes[o, i]) - zeros[o, g]) * scales[o, g] / global_scale + mins[o, g], g = the group
    (or channel / block) of (o, i) under `spec`; absent parts drop out (reference.dequantize is the formula).

    codes: int8 [out, in]: int8 values, or int4 values unpacked one per byte (signed [-8, 7] when symmetric,
      [0, 15] otherwise; uint8 [0, 255] for asymmetric int8); float8_e4m3fn [out, in] for fp8;
      uint8 E2M1 codes (0..15) for NVFP4.
    scales: float32 / float16 / float8_e4m3fn (NVFP4) [out, groups] (channel: [out, 1]; tensor: [1, 1];
      block: [ceil(out / rows), ceil(in / cols)]).
    zeros: integer zero points like scales (asymmetric compressed-tensors), else None.
    mins: float additive offsets like scales (GGUF Q4_1's per-block minimum), else None.
    global_scale: fp32 scalar divisor of the scales (NVFP4, as compressed-tensors stores it), else None."""

    spec: QuantSpec
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]
