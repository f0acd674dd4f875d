"""Named quantization schemes: what `--quantization SCHEME` (and `glmserve quantize --scheme`) means.

A scheme is a weight QuantSpec plus the activation QuantSpec the matmul quantizes its input with (None:
weight-only, activations stay in the model dtype). The names follow the usual ones (vLLM / llm-compressor
presets: W8A8, W4A16, FP8, FP8_BLOCK, NVFP4) and llama.cpp's block formats. `none` is no quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmserve.errors import InvalidRequestError
from glmserve.quant.spec import QuantSpec


@dataclass(frozen=True)
class Scheme:
    """weight None: the float path (scheme `none`)."""

    name: str
    weight: QuantSpec | None
    activations: QuantSpec | None = None


def _int(bits: int, group: int | None = None, symmetric: bool = True, zero_point: str = "int") -> QuantSpec:
    if group is None:
        return QuantSpec(num_bits=bits, symmetric=symmetric, strategy="channel", zero_point=zero_point)
    return QuantSpec(num_bits=bits, symmetric=symmetric, strategy="group", group_size=group, zero_point=zero_point)


def gguf_spec(gguf_type: str) -> QuantSpec:
    """The canonical spec of a GGUF block format we run natively (glmserve/quant/gguf_blocks.py layouts):
    Q8_0 int8 codes and Q4_0 codes in [-8, 7] with an fp16 scale per 32; Q4_1 codes 0..15 with an fp16
    scale and an fp16 minimum (`mins`) per 32; Q5_0 codes in [-16, 15] and Q5_1 codes 0..31 (with a minimum)
    likewise; Q6_K codes in [-32, 31] and Q3_K codes in [-4, 3] with an fp16 scale per 16, Q2_K codes 0..3 with an
    fp16 scale and minimum per 16 (read only: glmserve/quant/gguf_mapped.py, which also maps the other K-quants onto
    these)."""
    specs = {"Q8_0": QuantSpec(num_bits=8, strategy="group", group_size=32, gguf_type="Q8_0"),
             "Q4_0": QuantSpec(num_bits=4, strategy="group", group_size=32, gguf_type="Q4_0"),
             "Q4_1": QuantSpec(num_bits=4, symmetric=False, strategy="group", group_size=32, gguf_type="Q4_1"),
             "Q5_0": QuantSpec(num_bits=5, strategy="group", group_size=32, gguf_type="Q5_0"),
             "Q5_1": QuantSpec(num_bits=5, symmetric=False, strategy="group", group_size=32, gguf_type="Q5_1"),
             "Q6_K": QuantSpec(num_bits=6, strategy="group", group_size=16, gguf_type="Q6_K"),
             "Q3_K": QuantSpec(num_bits=4, strategy="group", group_size=16, gguf_type="Q3_K"),
             "Q2_K": QuantSpec(num_bits=2, symmetric=False, strategy="group", group_size=16, gguf_type="Q2_K")}
    if gguf_type not in specs:
        raise InvalidRequestError(f"GGUF type {gguf_type!r} does not run natively; native: {', '.join(specs)}")
    return specs[gguf_type]


INT8_TOKENS = QuantSpec(num_bits=8, strategy="token", dynamic=True)
FP8_TOKENS = QuantSpec(num_bits=8, type="float", strategy="token", dynamic=True)
FP8_CHANNEL = QuantSpec(num_bits=8, type="float", strategy="channel")
# DeepSeek-V3's fine-grained FP8 (arXiv 2412.19437, section 3.3.2; compressed-tensors' FP8_BLOCK preset): weights
# per 128x128 block, activations per token per 128 inputs (1x128 tiles, the last one shorter where 128 does not
# divide the inputs: reference.fake_quantize_activations)
FP8_BLOCK = QuantSpec(num_bits=8, type="float", strategy="block", block_structure=(128, 128))
FP8_GROUP128 = QuantSpec(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True)
# finer E4M3 activation tiles (1 x 32: the block of the OCP Microscaling formats' MXFP8, here with float32 scales;
# 1 x 16): E4M3 rounds each tile's largest value exactly (its scale maps it to 448), and SmolLM2's activation error
# sits in the largest values, so smaller tiles cut it (bench/RESULTS.md, quantization quality)
FP8_GROUP32 = QuantSpec(num_bits=8, type="float", strategy="group", group_size=32, dynamic=True)
FP8_GROUP16 = QuantSpec(num_bits=8, type="float", strategy="group", group_size=16, dynamic=True)

SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("none", None),
    Scheme("int8", _int(8)),
    # int8 with a scale per 64 / 32 inputs (W8A16 group): SmolLM2's down_proj inputs carry massive activation
    # channels that make one scale per 1,536-wide row too coarse (bench/RESULTS.md, quantization quality)
    Scheme("int8-g64", _int(8, 64)),
    Scheme("int8-g32", _int(8, 32)),
    Scheme("w8a8", _int(8), INT8_TOKENS),
    Scheme("w4a16", _int(4, 32)),
    Scheme("w4a16-asym", _int(4, 32, symmetric=False)),
    # a float16 minimum per group instead of the integer zero point (w = s * q + m: GGUF Q4_1's form, here as a
    # compressed-tensors folder with a float32 zero point that vLLM does not read; spec.py, compressed_tensors.py)
    Scheme("w4a16-fmin", _int(4, 32, symmetric=False, zero_point="float")),
    Scheme("w4a16-g64", _int(4, 64)),
    Scheme("w4a16-asym-g64", _int(4, 64, symmetric=False)),
    Scheme("fp8", FP8_CHANNEL, FP8_TOKENS),
    Scheme("fp8-a16", FP8_CHANNEL),  # FP8 weights only (W8A16-FP8), activations in the model dtype
    # 128x128 weight blocks with activations per token, and with DeepSeek-V3's 1x128 activation tiles
    Scheme("fp8-block", FP8_BLOCK, FP8_TOKENS),
    Scheme("fp8-block-g128", FP8_BLOCK, FP8_GROUP128),
    # per-channel E4M3 weights with E4M3 activations per 1 x 32 / 1 x 16 tile
    Scheme("fp8-g32", FP8_CHANNEL, FP8_GROUP32),
    Scheme("fp8-g16", FP8_CHANNEL, FP8_GROUP16),
    # NVFP4 weights (E2M1 values, E4M3 scale per 16, fp32 global scale), activations in the model dtype
    Scheme("nvfp4", QuantSpec(num_bits=4, type="float", strategy="tensor_group", group_size=16)),
    Scheme("q8_0", gguf_spec("Q8_0")),
    Scheme("q4_0", gguf_spec("Q4_0")),
    Scheme("q4_1", gguf_spec("Q4_1")),
)}


def scheme(name: str) -> Scheme:
    """The scheme named `name` (case-insensitive); an unknown name is an InvalidRequestError listing them."""
    found = SCHEMES.get(name.lower())
    if found is None:
        raise InvalidRequestError(f"unknown quantization scheme {name!r}; known: {', '.join(SCHEMES)}")
    return found
