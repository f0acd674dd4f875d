"""GGUF block types beyond Q8_0 / Q4_0 / Q4_1, as the block forms our kernels run (codes, an fp16 scale (and min)
per 32 inputs, or for Q6_K / Q3_K per 16), so that every llama.cpp quantization mix loads without a float copy of
its matrices.

llama.cpp's Q4_K_M / Q5_K_M / Q3_K_M / IQ4_XS ... files (the GGUFs most people download) hold K-quant and i-quant
matrices, and Q5_0 / Q5_1 / Q8_0 where a matrix's inputs are not a multiple of 256 (SmolLM2's 576). Each becomes a
canonical QuantizedWeight of 32-input blocks (layouts from ggml-common.h `block_q5_0`, `block_q5_1`, `block_q4_K`,
`block_q5_K`, `block_q6_K`, `block_iq4_nl`, `block_iq4_xs` and ggml-quants.c's `dequantize_row_*`, read, not copied):

  Q5_0    d, 5-bit q                      w = d * (q - 16)      -> codes q - 16 in [-16, 15], scale d: exact
  Q5_1    d, m, 5-bit q                   w = d * q + m         -> codes q, scale d, min m: exact
  Q4_K    d, dmin, 6-bit (sc, m) per 32   w = d*sc*q - dmin*m   -> Q4_1: codes q, scale fp16(d*sc), min fp16(-dmin*m)
  Q5_K    as Q4_K with 5-bit q                                   -> Q5_1 the same way
  Q6_K    d, int8 sc per 16, 6-bit q      w = d*sc*(q - 32)     -> Q6_K: codes q - 32, scale fp16(d*sc) per 16
  Q3_K    d, 6-bit sc per 16, 2-bit q and a high bit h            -> Q3_K: codes q - 4 (1 - h) in [-4, 3],
                                          w = d*(sc - 32)*(q - 4 (1 - h))    scale fp16(d*(sc - 32)) per 16
  IQ4_NL  d, 4-bit index into kvalues     w = d * kvalues[q]    -> Q8_0: codes kvalues[q] (int8), scale d: exact
  IQ4_XS  d, 6-bit ls per 32, as IQ4_NL   w = d*(ls-32)*kvalues[q] -> Q8_0: scale fp16(d * (ls - 32))
  MXFP4   E8M0 e, 4-bit index into the    w = 2^(e-128) * e2m1[q] -> Q8_0: codes e2m1[q], scale 2^(e-128): exact
          doubled E2M1 values e2m1              where fp16 holds 2^(e-128) (e in [104, 143]), else re-quantized
  NVFP4   UE4M3 s per 16, 4-bit index     w = s/2 * e2m1[q]     -> Q6_K: codes e2m1[q], scale s/2 per 16: exact
  TQ1_0   d, trits t in {-1, 0, 1}        w = d * t             -> Q4_0: codes t, scale d: exact
  TQ2_0   as TQ1_0, 2-bit t + 1
  Q2_K    d, dmin, 4-bit (sc, m) per 16   w = d*sc*q - dmin*m   -> Q2_K: codes q (0..3), scale fp16(d*sc) and
          2-bit q                                                   min fp16(-dmin*m) per 16
  others  (IQ1-IQ3: codebook grids)
          gguf-py's dequantization, quantized again to Q8_0 by ggml's round to nearest

Q4_K / Q5_K / IQ4_XS's two-level scales are flattened into one fp16 per 32 (relative rounding <= 2^-11 of a block's
scale and min, next to a 4-bit step's 1/15 of its range), Q6_K's, Q3_K's and Q2_K's (and its mins) into one per 16. The
re-quantized types gain at most half an int8 step, absmax / 254 of a block (a 2-bit type's own step is absmax / 2).
5-bit codes run as nibbles and a plane of fifth bits (5 bits a weight, as the file keeps them), 6-bit ones as nibbles
and their top two bits (the kernels' q6 blocks, the scale of each block's second 16 inputs kept in the block), 2-bit
ones as q6's top bits alone (Q2_K: the kernels' q2 blocks, 4 bits a weight with the scales and mins), 4-bit
ones as nibbles (Q3_K's with that second scale: s4 blocks, 5 bits a weight; TQ1_0 / TQ2_0's trits as Q4_0's, 4.5),
IQ4's and MXFP4's as nibble indices into the table kept with each block (TableCodesWeight: its canonical codes are the
table's values), NVFP4's likewise with the second scale (f4 blocks, 5 bits a weight). Everything is vectorized over
all blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from glmserve.quant.gguf_blocks import BLOCK, fp16_field, quantize_blocks, unpack_nibbles
from glmserve.quant.schemes import gguf_spec
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight

SUPER = 256  # inputs per K-quant superblock (ggml's QK_K)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
IQ4_TABLE = torch.from_numpy(IQ4_VALUES)  # (the same memory) as TableCodesWeight's table
# MXFP4's E2M1 values doubled, as ggml's kvalues_mxfp4 (its E8M0 scale is halved to match): OCP MX spec v1.0
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
MXFP4_TABLE = torch.from_numpy(MXFP4_VALUES)
# types whose codes are kept as stored (their scales as stored, or flattened: Q4_K, Q5_K, IQ4_XS) -> the form
CODES_KEPT = {"Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q4_K": "Q4_1", "Q5_K": "Q5_1", "Q6_K": "Q6_K", "Q3_K": "Q3_K",
              "IQ4_NL": "Q8_0", "IQ4_XS": "Q8_0", "MXFP4": "Q8_0", "NVFP4": "Q6_K", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0",
              "Q2_K": "Q2_K"}
REQUANTIZED = tuple(name for name in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")
                    if name in GGMLQuantizationType.__members__)  # (older gguf-py versions lack the newest)
RUNS_AS = CODES_KEPT | dict.fromkeys(REQUANTIZED, "Q8_0")  # file type -> the native block form it runs as


class TableCodesWeight(QuantizedWeight):
    """A Q8_0-form weight whose int8 codes are all values of `table` (int8 [16]; IQ4_NL / IQ4_XS: IQ4_VALUES): the
    reference runs the codes as they are, the CPU backend keeps them as nibble indices and the table
    (quant/cpu_backend.py `pack` with a table: 4.5 bits a weight instead of 8.5). It keeps its table across devices
    and row selections, and stacks into one only with weights of the same table (else as a plain Q8_0 weight)."""

    def __init__(self, spec: QuantSpec, codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor):
        super().__init__(spec, codes, scales)
        self.table = table

    def _per_row(self, fn: Callable[[torch.Tensor], torch.Tensor], global_scale: torch.Tensor | None
                 ) -> QuantizedWeight:
        return TableCodesWeight(self.spec, fn(self.codes), fn(self.scales), self.table)

    def _stack(self, parts: list[QuantizedWeight]) -> QuantizedWeight:
        plain = super()._stack(parts)
        if all(isinstance(p, TableCodesWeight) and torch.equal(p.table, self.table) for p in parts):
            return TableCodesWeight(plain.spec, plain.codes, plain.scales, self.table)
        return plain


def how_it_runs(gguf_type: str) -> str:
    """A few words for the load log: how a matrix of `gguf_type` runs (the module docstring's table)."""
    if gguf_type in REQUANTIZED:
        return "re-quantized to Q8_0"
    if gguf_type in ("Q4_K", "Q5_K", "IQ4_XS"):
        return f"as {RUNS_AS[gguf_type]} blocks, scales rounded to one fp16 per 32"
    if gguf_type in ("Q6_K", "Q3_K", "Q2_K"):
        bits = {"Q6_K": "6-bit codes, scales", "Q3_K": "4-bit codes, scales", "Q2_K": "2-bit codes, scales and mins"}
        return f"{bits[gguf_type]} rounded to one fp16 per 16"
    if gguf_type == "NVFP4":
        return "nibble indices into its table, an fp16 scale per 16"
    if gguf_type.startswith("TQ"):
        return "ternary codes as Q4_0 blocks"
    if gguf_type.startswith("Q5_"):
        return "5-bit codes as nibbles and fifth bits"
    if gguf_type == "MXFP4":
        return "nibble indices into its table; re-quantized to Q8_0 where a scale is outside fp16's range"
    return "nibble indices into its table"


def maps(gguf_type: str, in_features: int) -> bool:
    """True where this module turns a matrix of `gguf_type` with `in_features` inputs into a native block form."""
    return gguf_type in RUNS_AS and in_features % BLOCK == 0


def convert_blocks(raw: np.ndarray, gguf_type: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A matrix's raw GGUF bytes ([out, in] in Hugging Face order) of a type in RUNS_AS as the canonical
    QuantizedWeight of its native form: see the module docstring for each mapping."""
    out, inp = shape
    qtype = GGMLQuantizationType[gguf_type]
    group, block_bytes = GGML_QUANT_SIZES[qtype]
    if inp % group or inp % BLOCK:
        raise ValueError(f"{gguf_type}: in_features {inp} is not a multiple of {max(group, BLOCK)}")
    raw = np.asarray(raw).view(np.uint8)
    if raw.size != out * (inp // group) * block_bytes:
        raise ValueError(f"{gguf_type} {shape}: {raw.size} bytes, expected {out * (inp // group) * block_bytes}")
    blocks = raw.reshape(out, inp // group, block_bytes)
    spec = gguf_spec(RUNS_AS[gguf_type])
    if gguf_type == "MXFP4":  # E8M0 e, then 16 bytes of indices laid out as Q4_0's nibbles
        codes = MXFP4_VALUES[unpack_nibbles(blocks[..., 1:])]
        scales = _e8m0_half_as_fp16(blocks[..., 0], codes.reshape(out, -1, BLOCK).any(axis=-1))
        if scales is not None:
            return TableCodesWeight(spec, _codes(codes, shape), scales, MXFP4_TABLE)
    if gguf_type in REQUANTIZED or gguf_type == "MXFP4":
        values = gguf_dequantize(raw, qtype).reshape(out, inp)
        return quantize_blocks(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)), spec)
    if gguf_type == "IQ4_NL":  # fp16 d, then 16 bytes of indices laid out as Q4_0's nibbles
        return TableCodesWeight(spec, _codes(IQ4_VALUES[unpack_nibbles(blocks[..., 2:])], shape),
                                fp16_field(blocks, 0), IQ4_TABLE)
    if gguf_type == "IQ4_XS":
        return TableCodesWeight(spec, _codes(IQ4_VALUES[unpack_nibbles(_per_32(blocks[..., 8:], 16))], shape),
                                _iq4_xs_scales(blocks).reshape(out, -1), IQ4_TABLE)
    if gguf_type == "NVFP4":  # 4 UE4M3 scales, then per 16 values 8 bytes of indices laid out as Q4_0's nibbles
        indices = blocks[..., 4:].reshape(out, -1, 4, 8)
        codes = MXFP4_VALUES[np.concatenate((indices & 15, indices >> 4), axis=-1)]
        return TableCodesWeight(spec, _codes(codes, shape), _ue4m3_half_as_fp16(blocks[..., :4]).reshape(out, -1),
                                MXFP4_TABLE)
    if gguf_type == "Q2_K":  # 16 bytes of (sc, m) nibbles, 64 of 2-bit codes, then d and dmin
        sc, m = blocks[..., :16] & 0x0F, (blocks[..., :16] >> 4).astype(np.int16)
        scales, mins = _times_d(blocks, 80, sc).reshape(out, -1), _times_d(blocks, 82, -m).reshape(out, -1)
        return QuantizedWeight(spec, _codes(_two_bit_fields(blocks[..., 16:80]), shape), scales, mins=mins)
    if gguf_type in ("TQ1_0", "TQ2_0"):  # the trits, then d (each superblock's last 2 bytes)
        d = fp16_field(blocks, block_bytes - 2)  # [out, supers]
        trits = _trits(blocks) if gguf_type == "TQ1_0" else _two_bit_fields(blocks[..., :64]).view(np.int8) - np.int8(1)
        return QuantizedWeight(spec, _codes(trits, shape), d.repeat_interleave(SUPER // BLOCK, dim=-1))
    if gguf_type == "Q6_K":
        return QuantizedWeight(spec, _codes(_six_bit(blocks[..., :128], blocks[..., 128:192]), shape),
                               _q6_k_scales(blocks).reshape(out, -1))
    if gguf_type == "Q3_K":
        return QuantizedWeight(spec, _codes(_three_bit(blocks[..., 32:96], blocks[..., :32]), shape),
                               _q3_k_scales(blocks).reshape(out, -1))
    if gguf_type in ("Q5_0", "Q5_1"):
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


def _per_32(qs: np.ndarray, bytes_per_32: int) -> np.ndarray:
    """A superblock's [..., 8 * bytes_per_32] quants as [..., 8, bytes_per_32]: one row per 32 inputs."""
    return qs.reshape(*qs.shape[:-1], SUPER // BLOCK, bytes_per_32)


def _iq4_xs_scales(blocks: np.ndarray) -> torch.Tensor:
    """IQ4_XS's per-32 scales d * (ls - 32) as fp16 [..., 8]: ls's low 4 bits are the nibbles of bytes 4-7 (sub-block
    2i low, 2i + 1 high), its top 2 bits bits 2i..2i+1 of the 16-bit word at bytes 2-3."""
    low = (blocks[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)) & 0x0F  # [..., 4, 2]
    high = (blocks[..., 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # [..., 8]
    ls = low.reshape(*low.shape[:-2], 8).astype(np.int16) | (high.astype(np.int16) << 4)
    return _times_d(blocks, 0, ls - 32)


def _e8m0_half_as_fp16(e: np.ndarray, used: np.ndarray) -> torch.Tensor | None:
    """MXFP4's E8M0 exponents e [out, blocks] as their scales 2^(e - 128) (ggml's e8m0_to_fp32_half: the values are
    doubled) in fp16, or None where a `used` block's (one with a nonzero code) is outside fp16's exact powers of two
    2^-24..2^15; unused blocks' scales are 0."""
    exponent = e.astype(np.int32) - 128
    if np.any(used & ((exponent < -24) | (exponent > 15))):
        return None
    return torch.from_numpy(np.where(used, np.ldexp(np.float32(1), exponent), 0).astype(np.float16))


def _trits(blocks: np.ndarray) -> np.ndarray:
    """TQ1_0's 256 trits t - 1 per superblock (int8 [..., 256]), in integers: 5 (qs) or 4 (qh) base-3 digits a byte,
    digit k the top of (byte * 3^k mod 256) * 3 / 256 (ggml-quants.c's dequantize_row_tq1_0; gguf-py's order: bytes
    0..31 times 3^0..4, then 32..47, then qh's 4 bytes times 3^0..3)."""
    pow3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)[:, None]
    lead = blocks.shape[:-1]
    digits = [(blocks[..., None, start:end] * pow3[:k]).reshape(*lead, -1)  # uint8, wrapped mod 256 as ggml's
              for start, end, k in ((0, 32, 5), (32, 48, 5), (48, 52, 4))]
    scaled = np.concatenate(digits, axis=-1)
    return ((scaled.astype(np.uint16) * 3) >> 8).astype(np.int8) - np.int8(1)


def _two_bit_fields(qs: np.ndarray) -> np.ndarray:
    """A superblock's 64 bytes of 2-bit fields as its 256 values (uint8 [..., 256]) in the order of ggml's
    dequantize_row_q2_K and dequantize_row_tq2_0: per 32 bytes, the fields at bits 0, 2, 4, 6 of each byte in turn."""
    fields = qs.reshape(*qs.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    return (fields & 3).reshape(*qs.shape[:-1], SUPER)


def _ue4m3_half_as_fp16(s: np.ndarray) -> torch.Tensor:
    """NVFP4's unsigned E4M3 scales (ggml's ue4m3_to_fp32: bit 7 ignored, 0x7F is 0, halved for the doubled values)
    as fp16, exactly (3 mantissa bits, 2^-10..240): E4M3's bits with the sign bit clear."""
    bits = torch.from_numpy(np.ascontiguousarray(s & 0x7F))
    value = bits.view(torch.float8_e4m3fn).to(torch.float32).masked_fill_(bits == 0x7F, 0)
    return (value * 0.5).to(torch.float16)


def _times_d(blocks: np.ndarray, offset: int, scales: np.ndarray) -> torch.Tensor:
    """A superblock's sub-block `scales` [..., n] (integers) times its fp16 d at byte `offset`, rounded to fp16: the
    two-level scales flattened into one."""
    d = fp16_field(blocks, offset).to(torch.float32)[..., None]
    return (d * torch.from_numpy(scales.astype(np.float32))).to(torch.float16)


def _codes(codes: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(codes).view(np.int8).reshape(shape))


def _five_bit(low: np.ndarray, high_words: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: the low nibbles [..., 32] (element j of a block) with bit j of the block's 32-bit `qh` as
    bit 4 -> q in [0, 31] uint8."""
    bits = np.unpackbits(high_words, axis=-1, bitorder="little")  # [..., 32]: bit j of the little-endian word
    return low | (bits << np.uint8(4))


def _six_bit(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q6_K's 128 bytes of low 4 bits and 64 of high 2 bits per superblock -> [..., 256] codes q - 32 (int8): in each
    128-input half, byte l of its 64 ql holds element l's low nibble (l < 32: elements 0..31, else 32..63) and element
    l + 64's high nibble; bits 2k..2k+1 of byte l of its 32 qh are element l + 32 k's top two bits (ggml-quants.c
    dequantize_row_q6_K)."""
    ql = ql.reshape(*ql.shape[:-1], 2, 64)
    qh = qh.reshape(*qh.shape[:-1], 2, 32)
    q = np.empty((*ql.shape[:-1], 128), dtype=np.uint8)  # [..., half, 128], built in place (a load's transients)
    np.bitwise_and(ql, 0x0F, out=q[..., :64])
    np.right_shift(ql, 4, out=q[..., 64:])
    for k in range(4):
        q[..., 32 * k:32 * (k + 1)] |= ((qh >> np.uint8(2 * k)) & 3) << np.uint8(4)
    q -= np.uint8(32)  # q - 32 modulo 256: the int8 codes' bits
    return q.view(np.int8).reshape(*ql.shape[:-2], SUPER)


def _q6_k_scales(blocks: np.ndarray) -> torch.Tensor:
    """Q6_K's per-16 scales d * sc as fp16 [..., 16]: sc the int8 bytes 192..207, d the fp16 at 208."""
    return _times_d(blocks, 208, np.ascontiguousarray(blocks[..., 192:208]).view(np.int8))


def _three_bit(qs: np.ndarray, hmask: np.ndarray) -> np.ndarray:
    """Q3_K's 64 bytes of 2-bit q and 32 bytes of high bits h per superblock -> [..., 256] codes q - 4 (1 - h) (int8,
    [-4, 3]): bits 2j..2j+1 of byte l of 128-input half n are element 128 n + 32 j + l's q, bit 4 n + j of hmask byte
    l its h (ggml-quants.c dequantize_row_q3_K)."""
    q = (qs.reshape(*qs.shape[:-1], 2, 1, 32) >> np.array([[0], [2], [4], [6]], dtype=np.uint8)) & 3  # [.., n, j, l]
    h = (hmask.reshape(*hmask.shape[:-1], 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 4 n + j, l]
    codes = (q | h.reshape(q.shape) << np.uint8(2)) - np.uint8(4)  # q + 4 h - 4 modulo 256: the int8 codes' bits
    return codes.view(np.int8).reshape(*qs.shape[:-1], SUPER)


def _q3_k_scales(blocks: np.ndarray) -> torch.Tensor:
    """Q3_K's per-16 scales d * (sc - 32) as fp16 [..., 16]: sc's low 4 bits are the nibbles of bytes 96..103 (scales
    0-7 low, 8-15 high), its top 2 bits bits 2k..2k+1 of bytes 104..107 (scale 4k + byte); d the fp16 at 108."""
    low = (blocks[..., 96:104, None] >> np.array([0, 4], dtype=np.uint8)) & 0x0F  # [..., byte, nibble]
    low = np.swapaxes(low, -1, -2).reshape(*blocks.shape[:-1], 16)
    high = (blocks[..., None, 104:108] >> np.array([[0], [2], [4], [6]], dtype=np.uint8)) & 3  # [..., k, byte]
    sc = (low | (high.reshape(*blocks.shape[:-1], 16) << np.uint8(4))).astype(np.int16) - 32
    return _times_d(blocks, 108, sc)


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
