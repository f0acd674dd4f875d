"""Raw llama.cpp blocks of random codes and scales for tests of readers of types gguf-py cannot quantize to (it
only dequantizes K-quants and i-quants): K-quants with the values they stand for (written from ggml-common.h's
block layouts and ggml-quants.c's dequantize_row_q4_K / q5_K / q6_K), and random bytes of any type."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize


def k_blocks(rng: np.random.Generator, n: int, bits: int = 4, d_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q4_K (bits 4) or Q5_K (bits 5) blocks (ggml block_q4_K / block_q5_K: f16 d, f16 dmin, 12 bytes of
    6-bit scales and mins, Q5_K's 32 bytes of fifth bits, 128 bytes of low 4 bits) and the values they stand
    for: d * scale * q - dmin * min per 32, with d and dmin in d_scale * [1e-3, 1e-2]."""
    d, dmin = (d_scale * rng.uniform(1e-3, 1e-2, (2, n, 1))).astype(np.float16)
    sc, mn = rng.integers(0, 64, (2, n, 8), dtype=np.uint8)
    q = rng.integers(0, 1 << bits, (n, 256), dtype=np.uint8)
    scales = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
        ],
        axis=1,
    )
    chunks = q.reshape(n, 4, 2, 32) & 15  # 64 values per 32 bytes: low nibbles then high nibbles
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, 128)
    fifth = []  # Q5_K: bit j of byte l is the fifth bit of value l of sub-block j
    if bits == 5:
        fifth.append(np.bitwise_or.reduce((q.reshape(n, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=1))
    raw = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, *fifth, qs], axis=1)
    per32 = np.repeat(np.arange(8), 32)
    values = (d.astype(np.float32) * sc[:, per32]) * q - dmin.astype(np.float32) * mn[:, per32]
    return raw, values.astype(np.float32)


def q6_k_blocks(rng: np.random.Generator, n: int, d_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q6_K blocks (ggml block_q6_K: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8
    scales, f16 d) and their values: d * scale * (q - 32) per 16, with d in d_scale * [1e-4, 1e-3]."""
    q = rng.integers(0, 64, (n, 256), dtype=np.uint8)
    sc = rng.integers(-128, 128, (n, 16), dtype=np.int8)
    d = (d_scale * rng.uniform(1e-4, 1e-3, (n, 1))).astype(np.float16)
    halves = q.reshape(n, 2, 128)  # each half: ql[i] holds values i and 64+i, qh[l] values l + 32g
    ql = (halves[:, :, :64] & 15) | ((halves[:, :, 64:] & 15) << 4)
    groups = (halves.reshape(n, 2, 4, 32) >> 4) & 3
    qh = groups[:, :, 0] | (groups[:, :, 1] << 2) | (groups[:, :, 2] << 4) | (groups[:, :, 3] << 6)
    raw = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1)
    values = (d.astype(np.float32) * sc[:, np.repeat(np.arange(16), 16)]) * (q.astype(np.float32) - 32)
    return raw, values.astype(np.float32)


def random_blocks(rng: np.random.Generator, gguf_type: str, rows: int, cols: int) -> np.ndarray:
    """[rows, bytes a row] of random bytes as blocks of any type gguf-py dequantizes; a block whose values are not
    finite, or whose largest magnitude is outside [1e-3, 1e3] (random fp16 scales span 1e-8..6e4), is zeroed."""
    qtype = GGMLQuantizationType[gguf_type]
    size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // size * type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        values = gguf_dequantize(raw, qtype).reshape(rows, cols // size, size)
        largest = np.abs(values).max(axis=-1)
    bad = ~np.isfinite(largest) | (largest < 1e-3) | (largest > 1e3)
    blocks = raw.reshape(rows, cols // size, type_size)
    blocks[bad] = 0
    return raw
