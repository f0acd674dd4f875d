"""A linear layer's weight in canonical form: integer (or float8/float4) codes plus scales, laid out
[out_features, in_features] with groups along in_features. The reference backend computes from it, checkpoints
are read into and written from it, and every other backend repacks it once at load (then it is dropped).
"""

from __future__ import annotations

from collections.abc import Callable
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

    def to(self, device: torch.device) -> QuantizedWeight:
        """The same weight with every tensor on `device`."""
        scalar = None if self.global_scale is None else self.global_scale.to(device)
        return self._per_row(lambda t: t.to(device), scalar)

    def take_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """The weight of output rows `rows` [n] (in that order), for per-row scales (channel, group): an
        embedding lookup reads only the rows it gathers."""
        return self._per_row(lambda t: t[rows], self.global_scale)

    def _per_row(self, fn: Callable[[torch.Tensor], torch.Tensor], global_scale: torch.Tensor | None
                 ) -> QuantizedWeight:
        """A weight of `fn` applied to each [out, ...] tensor (codes, scales and, where present, zeros and mins)."""
        def apply(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return QuantizedWeight(self.spec, fn(self.codes), fn(self.scales), apply(self.zeros), apply(self.mins),
                               global_scale)

    def _stack(self, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """`concat_rows` of parts (this one first) that passed its checks; a subclass that keeps another form of
        its weight (quant/gguf_blocks.py GGUFBlockWeight) stacks that instead."""
        def cat(name: str) -> torch.Tensor | None:
            tensors = [getattr(p, name) for p in parts]
            return None if tensors[0] is None else torch.cat(tensors, dim=0)

        return QuantizedWeight(self.spec, cat("codes"), cat("scales"), cat("zeros"), cat("mins"), self.global_scale)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros, self.mins,
                                                           self.global_scale) if t is not None)

    @property
    def float_columns(self) -> torch.Tensor | None:
        """Input columns kept in float beside the codes (WeightWithFloatColumns); None for a plain weight."""
        return None


@dataclass
class OutlierColumns:
    """Input columns of a linear layer kept in float beside its quantized weight (the seeds' activation_threshold,
    LLM.int8()'s decomposition): the codes are zero there and y = dequant(W) x + weight x[..., columns]."""

    columns: torch.Tensor  # int64 [k], sorted
    weight: torch.Tensor  # float [out, k]


@dataclass
class WeightWithFloatColumns(QuantizedWeight):
    """A quantized weight and its float outlier columns, as the engine loads a compressed-tensors module that keeps
    some (compressed_tensors.py's extension): a backend repacks the codes, the layer adds the float columns' part."""

    outliers: OutlierColumns | None = None

    @classmethod
    def of(cls, weight: QuantizedWeight, outliers: OutlierColumns) -> WeightWithFloatColumns:
        return cls(weight.spec, weight.codes, weight.scales, weight.zeros, weight.mins, weight.global_scale, outliers)

    @property
    def float_columns(self) -> torch.Tensor | None:
        return self.outliers.columns

    def _per_row(self, fn: Callable[[torch.Tensor], torch.Tensor], global_scale: torch.Tensor | None
                 ) -> WeightWithFloatColumns:
        weight = fn(self.outliers.weight)
        return self.of(super()._per_row(fn, global_scale), OutlierColumns(self.outliers.columns.to(weight.device),
                                                                          weight))

    def _stack(self, parts: list[QuantizedWeight]) -> WeightWithFloatColumns:
        weight = torch.cat([p.outliers.weight for p in parts], dim=0)  # type: ignore[attr-defined]
        return self.of(super()._stack(parts), OutlierColumns(self.outliers.columns, weight))

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.numel() * t.element_size() for t in (self.outliers.columns, self.outliers.weight))


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts of one spec (and one global scale) stacked along the output rows, as a fused q|k|v or gate|up.
    Per-block weights need each part's rows to be whole blocks."""
    _check_stackable(parts)
    return parts[0]._stack(parts)


def _check_stackable(parts: list[QuantizedWeight]) -> None:
    """Raises ValueError where `concat_rows` cannot stack the parts."""
    spec = parts[0].spec
    if any(p.spec != spec for p in parts):
        raise ValueError(f"cannot stack weights of different formats: {[p.spec for p in parts]}")
    if spec.strategy == "tensor" or (spec.strategy == "block" and any(p.shape[0] % spec.block_structure[0]
                                                                       for p in parts)):
        raise ValueError(f"{spec.strategy} scales do not stack by rows")
    g = parts[0].global_scale
    if g is not None and any(p.global_scale is None or not torch.equal(p.global_scale, g) for p in parts):
        raise ValueError("cannot stack weights with different global scales")
    c = parts[0].float_columns
    if any((p.float_columns is None) != (c is None) or (c is not None and not torch.equal(p.float_columns, c))
           for p in parts):
        raise ValueError("cannot stack weights with different float columns")


def stackable(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    """Whether `concat_rows` takes the two (checked, nothing stacked)."""
    try:
        _check_stackable([a, b])
    except ValueError:
        return False
    return True
