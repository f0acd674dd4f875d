"""GGUF's 5-bit and K-quant blocks as the block forms our kernels run (codes, one fp16 scale and min per 32).

llama.cpp's Q4_K_M / Q5_K_M files (the GGUFs most people download) hold Q4_K / Q5_K / Q6_K matrices, and Q5_0 /
Q5_1 / Q8_0 where a matrix's inputs are not a multiple of 256 (SmolLM2's 576). Each becomes a canonical
QuantizedWeight of 32-input blocks (layouts from ggml-common.h `block_q5_0`, `block_q5_1`, `block_q4_K`,
`block_q5_K`, `block_q6_K`, and ggml-quants.c `dequantize_row_*`, read, not copied):

  Q5_0  d, 5-bit q                     w = d * (q - 16)    -> codes q - 16 in [-16, 15], scale d: exact
  Q5_1  d, m, 5-bit q                  w = d * q + m       -> codes q, scale d, min m: exact
  Q4_K  d, dmin, 6-bit (sc, m) per 32  w = d*sc * q - dmin*m -> Q4_1: codes q, scale fp16(d*sc), min fp16(-dmin*m)
  Q5_K  as Q4_K with 5-bit q           -> Q5_1 the same way
  Q6_K  d, int8 sc per 16, 6-bit q     w = d*sc * (q - 32) -> Q8_0 by ggml's round-to-nearest of those values

Q4_K / Q5_K's two-level scales are flattened into one fp16 per 32 (relative rounding <= 2^-11 of a block's scale
and min, next to a 4-bit step's 1/15 of its range). Q6_K's scale per 16 inputs has no exact form in blocks of 32,
so its values are quantized again to int8 per 32 (an added error of at most half an int8 step, absmax / 254 of a
block). The 5-bit codes run on the int8 tiles (1 byte a weight where the file has 5.5-6); 4-bit on the nibble
tiles. Everything is vectorized over all blocks.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from glmserve.quant.gguf_blocks import BLOCK, fp16_field, quantize_blocks, unpack_nibbles
from glmserve.quant.schemes import gguf_spec
from glmserve.quant.weight import QuantizedWeight

SUPER = 256  # inputs per K-quant superblock (ggml's QK_K)
SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
Q5_BYTES = {"Q5_0": 22, "Q5_1": 24}
RUNS_AS = {"Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q4_K": "Q4_1", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # file type -> form


def converts(gguf_type: str) -> bool:
    """True for the block types this module turns into a native block form."""
    return gguf_type in RUNS_AS


def convert_blocks(raw: np.ndarray, gguf_type: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K tensor's raw bytes ([out, in] in Hugging Face order) as the
    canonical QuantizedWeight of its native form (RUNS_AS): see the module docstring for each mapping."""
    out, inp = shape
    group = SUPER if gguf_type in SUPER_BYTES else BLOCK
    if inp % group:
        raise ValueError(f"{gguf_type}: in_features {inp} is not a multiple of {group}")
    block_bytes = (SUPER_BYTES | Q5_BYTES)[gguf_type]
    raw = np.asarray(raw).view(np.uint8)
    if raw.size != out * (inp // group) * block_bytes:
        raise ValueError(f"{gguf_type} {shape}: {raw.size} bytes, expected {out * (inp // group) * block_bytes}")
    blocks = raw.reshape(out, inp // group, block_bytes)
    spec = gguf_spec(RUNS_AS[gguf_type])
    if gguf_type == "Q6_K":
        values = gguf_dequantize(raw, GGMLQuantizationType.Q6_K).reshape(out, inp)
        return quantize_blocks(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)), spec)
    if gguf_type in Q5_BYTES:
        has_min = gguf_type == "Q5_1"
        header = 4 if has_min else 2
        codes = _five_bit(unpack_nibbles(blocks[..., header + 4:]), blocks[..., header:header + 4])
        if not has_min:
            codes = codes.view(np.int8) - np.int8(16)
        return QuantizedWeight(spec, _codes(codes, shape), fp16_field(blocks, 0),
                               mins=fp16_field(blocks, 2) if has_min else None)
    d = fp16_field(blocks, 0).to(torch.float32)[..., None]  # [out, supers, 1]
    dmin = fp16_field(blocks, 2).to(torch.float32)[..., None]
    sc, m = _scales_and_mins(blocks[..., 4:16])  # [out, supers, 8] each
    codes = _k_nibbles(blocks[..., -128:])
    if gguf_type == "Q5_K":
        codes |= _k_high_bits(blocks[..., 16:48])
    scales = (d * torch.from_numpy(sc).to(torch.float32)).to(torch.float16).reshape(out, -1)
    mins = (-dmin * torch.from_numpy(m).to(torch.float32)).to(torch.float16).reshape(out, -1)
    return QuantizedWeight(spec, _codes(codes, shape), scales, mins=mins)


def _codes(codes: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(codes).view(np.int8).reshape(shape))


def _five_bit(low: np.ndarray, high_words: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: the low nibbles [..., 32] (element j of a block) with bit j of the block's 32-bit `qh` as
    bit 4 -> q in [0, 31] uint8."""
    bits = np.unpackbits(high_words, axis=-1, bitorder="little")  # [..., 32]: bit j of the little-endian word
    return low | (bits << np.uint8(4))


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit (scale, min) pairs per superblock (ggml-quants.c
    get_scale_min_k4): pairs 0-3 in the low 6 bits of bytes 0-3 / 4-7; pairs 4-7 take their low 4 bits from
    bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits from the top of bytes 0-3 / 4-7."""
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([first & 0x3F, (third & 0x0F) | ((first >> 6) << 4)], axis=-1)
    m = np.concatenate([second & 0x3F, (third >> 4) | ((second >> 6) << 4)], axis=-1)
    return sc, m


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes per superblock -> [..., 256] values 0..15: 32-byte chunk c holds sub-block 2c in
    its low nibbles and sub-block 2c + 1 in its high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return ((chunks >> np.array([[0], [4]], dtype=np.uint8)) & 0x0F).reshape(*qs.shape[:-1], SUPER)


def _k_high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_K's 32 bytes of fifth bits per superblock -> [..., 256] values 0 or 16: bit j of byte l is the fifth
    bit of element l of sub-block j."""
    bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8 sub-blocks, 32]
    return (bits << np.uint8(4)).reshape(*qh.shape[:-1], SUPER)
