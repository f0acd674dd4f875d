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


@dataclass(frozen=True)
class QuantSpec:
    """num_bits / type: int8, int4, float8 (E4M3), float4 (E2M1, NVFP4's values).
    strategy: tensor (one scale), channel (one per output row), group (`group_size` inputs per scale,
    per row), block (`block_structure` [rows, cols] tiles, FP8 128x128), token (activations: one scale per
    row of the input), tensor_group (NVFP4: a float8 scale per `group_size` (16) plus one fp32 global).
    symmetric: no zero point. dynamic: scales computed at run time (activations)."""

    num_bits: int
    type: NumberType = "int"
    symmetric: bool = True
    strategy: Strategy = "channel"
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    dynamic: bool = False
    gguf_type: str | None = None  # "Q8_0", "Q4_0", "Q4_1", ...: the tensor's GGUF block format, if any
