"""One tensor's quantization format. The fields mirror compressed-tensors' `QuantizationArgs`
(compressed_tensors/quantization/quant_args.py) so that a checkpoint's `quantization_config` maps onto
them and back without loss; `gguf_type` names a llama.cpp block format where the tensor came from (or goes
to) a GGUF file, whose exact layout the compressed-tensors fields only describe approximately (Q4_1's
per-block minimum is not an integer zero point).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Strategy = Literal["tensor", "channel", "group", "block", "token", "tensor_group"]
NumberType = Literal["int", "float"]
ZeroPoint = Literal["int", "float"]


@dataclass(frozen=True)
class QuantSpec:
    """num_bits / type: int8, int4, float8 (E4M3), float4 (E2M1, NVFP4's values).
    strategy: tensor (one scale), channel (one per output row), group (`group_size` inputs per scale,
    per row), block (`block_structure` [rows, cols] tiles, FP8 128x128), token (activations: one scale per
    row of the input), tensor_group (NVFP4: a float8 scale per `group_size` (16) plus one fp32 global).
    symmetric: no zero point. dynamic: scales computed at run time (activations).
    zero_point (asymmetric int weights): "int", compressed-tensors' integer zero point z, w = s * (q - z); or
    "float", a float16 minimum m per group, w = s * q + m with float16 s (GGUF Q4_1's and HQQ's form, which an
    integer z can only approximate: -m / s is rarely an integer). A checkpoint stores the float form as a float32
    zero point (compressed-tensors' `zp_dtype`), see compressed_tensors.py."""

    num_bits: int
    type: NumberType = "int"
    symmetric: bool = True
    strategy: Strategy = "channel"
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    dynamic: bool = False
    gguf_type: str | None = None  # "Q8_0", "Q4_0", "Q4_1", ...: the tensor's GGUF block format, if any
    zero_point: ZeroPoint = "int"

    def __post_init__(self) -> None:
        if self.zero_point == "float" and (self.symmetric or self.type != "int" or self.gguf_type is not None):
            raise ValueError("a float minimum (zero_point 'float') goes with asymmetric int weights")

    @property
    def float_min(self) -> bool:
        """Whether the weight carries a float minimum per group (w = s * q + m) instead of an integer zero point."""
        return self.zero_point == "float"
