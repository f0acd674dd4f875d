"""The weight / activation specs the quantize tests exercise, one per compressed-tensors scheme we write."""

from __future__ import annotations

from glmserve.quant.spec import QuantSpec

INT8_TOKEN = QuantSpec(8, "int", True, "token", dynamic=True)
FP8_TOKEN = QuantSpec(8, "float", True, "token", dynamic=True)

SCHEMES: dict[str, tuple[QuantSpec, QuantSpec | None]] = {
    "int8": (QuantSpec(8, "int", True, "channel"), None),
    "int8-g64": (QuantSpec(8, "int", True, "group", group_size=64), None),
    "w8a8": (QuantSpec(8, "int", True, "channel"), INT8_TOKEN),
    "w4a16": (QuantSpec(4, "int", True, "group", group_size=32), None),
    "w4a16-asym": (QuantSpec(4, "int", False, "group", group_size=32), None),
    "w4a16-fmin": (QuantSpec(4, "int", False, "group", group_size=32, zero_point="float"), None),
    "w4a16-channel": (QuantSpec(4, "int", True, "channel"), None),
    "int8-asym-w8a8": (QuantSpec(8, "int", False, "channel"), INT8_TOKEN),
    "int8-tensor": (QuantSpec(8, "int", True, "tensor"), INT8_TOKEN),
    "fp8": (QuantSpec(8, "float", True, "channel"), FP8_TOKEN),
    "fp8-weight-only": (QuantSpec(8, "float", True, "channel"), None),
    "fp8-block": (QuantSpec(8, "float", True, "block", block_structure=(128, 128)), None),
    "fp8-block-g128": (QuantSpec(8, "float", True, "block", block_structure=(128, 128)),
                       QuantSpec(8, "float", True, "group", group_size=128, dynamic=True)),
    "nvfp4": (QuantSpec(4, "float", True, "tensor_group", group_size=16), None),
}
