"""llama.cpp's GGUF block formats <-> canonical QuantizedWeight, losslessly, in both directions.

Block layouts (ggml-common.h, block_q8_0 / block_q4_0 / block_q4_1), 32 weights of one row per block:
  Q8_0: fp16 d, 32 int8 q                       w = d * q
  Q4_0: fp16 d, 16 bytes of nibbles             w = d * (q - 8)     (canonical codes q - 8 in [-8, 7])
  Q4_1: fp16 d, fp16 m, 16 bytes of nibbles     w = d * q + m       (codes 0..15, m -> `mins`)
Byte j of the nibbles holds weight j in its low and weight j + 16 in its high half. Round-to-nearest
quantization follows ggml-quants.c's quantize_row_*_ref (as gguf-py's quants.py does) so the bytes are
bit-exact with llama.cpp's. The other block types (Q5_0 / Q5_1, K-quants, i-quants, ...) are mapped onto these
forms by glmserve/quant/gguf_mapped.py; `dequantize_other` turns the rest (float types, and any block type in a
tensor that is not a matrix) into float. Everything is vectorized over all blocks at once.

`from_blocks` keeps the blocks as read (`GGUFBlockWeight`) and makes the canonical tensors on first access only:
the CPU backend packs its tiles straight from the blocks (quant/cpu_backend.py `pack_gguf`), which never unpacks
the nibbles (a server start's load spent a third of its time on that round trip).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from glmserve.quant.schemes import gguf_spec
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight

log = logging.getLogger(__name__)

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 2 + BLOCK, "Q4_0": 2 + BLOCK // 2, "Q4_1": 4 + BLOCK // 2}
HEADER_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}  # the fp16 fields before a block's quants (d; Q4_1: d, m)
NATIVE = tuple(BLOCK_BYTES)


def _blocks(raw: np.ndarray, gguf_type: str, shape: tuple[int, int]) -> np.ndarray:
    out, inp = shape
    if inp % BLOCK:
        raise ValueError(f"{gguf_type}: in_features {inp} is not a multiple of {BLOCK}")
    expected = out * (inp // BLOCK) * BLOCK_BYTES[gguf_type]
    raw = np.asarray(raw).view(np.uint8)
    if raw.size != expected:
        raise ValueError(f"{gguf_type} {shape}: {raw.size} bytes, expected {expected}")
    return raw.reshape(out, inp // BLOCK, BLOCK_BYTES[gguf_type])


def fp16_field(b: np.ndarray, offset: int) -> torch.Tensor:
    """The float16 field at byte `offset` (even) of every block of b [..., block bytes] -> [...] float16: one
    strided copy of 2-byte words (copying the 2-byte slices as bytes first took 1.5x as long; the fields of a
    loaded model are 20% of its from_blocks time)."""
    return torch.from_numpy(np.ascontiguousarray(b.view(np.uint16)[..., offset // 2]).view(np.float16))


def unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] uint8 values 0..15 (low halves first, then high halves), each half written in
    place (a concatenation of the two halves, then a cast, copied every code twice more)."""
    q = np.empty((*qs.shape[:-1], BLOCK), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[..., :BLOCK // 2])
    np.right_shift(qs, 4, out=q[..., BLOCK // 2:])
    return q


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 32] values 0..15 -> [..., 16] bytes."""
    return (q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)).astype(np.uint8)


class GGUFBlockWeight(QuantizedWeight):
    """A QuantizedWeight that keeps a GGUF tensor's blocks as read: `blocks` [out, in / 32, block bytes] uint8
    (a view of the file, or a copy once rows are reordered or stacked). `codes`, `scales` and `mins` are the
    canonical tensors, each made on its first access (a backend that packs the blocks directly reads none of
    them, or only the small scales); `to` another device makes them all."""

    def __init__(self, blocks: np.ndarray, gguf_type: str):  # not the dataclass's: the canonical fields are lazy
        self.blocks, self.gguf_type = blocks, gguf_type
        self.spec = gguf_spec(gguf_type)
        self.zeros = self.global_scale = None

    @property
    def shape(self) -> tuple[int, int]:
        out, blocks, _ = self.blocks.shape
        return out, blocks * BLOCK

    @property
    def quants(self) -> np.ndarray:
        """The blocks' quants [out, in / 32, 32 (Q8_0) or 16 (nibbles)] uint8, a view (last axis contiguous)."""
        return self.blocks[..., HEADER_BYTES[self.gguf_type]:]

    @functools.cached_property
    def scales(self) -> torch.Tensor:  # type: ignore[override]
        return fp16_field(self.blocks, 0)

    @functools.cached_property
    def mins(self) -> torch.Tensor | None:  # type: ignore[override]
        return fp16_field(self.blocks, 2) if self.gguf_type == "Q4_1" else None

    @functools.cached_property
    def codes(self) -> torch.Tensor:  # type: ignore[override]
        """int8 [out, in]: Q8_0's q, Q4_0's q - 8, Q4_1's q."""
        if self.gguf_type == "Q8_0":
            return torch.from_numpy(self.quants.view(np.int8).reshape(self.shape).copy())
        codes = unpack_nibbles(self.quants).view(np.int8)
        if self.gguf_type == "Q4_0":
            codes -= 8
        return torch.from_numpy(codes.reshape(self.shape))

    @property
    def nbytes(self) -> int:
        """The blocks' bytes (what it keeps; counting the canonical tensors would make them)."""
        return self.blocks.nbytes

    def to(self, device: torch.device) -> QuantizedWeight:
        """Itself on the CPU (where its blocks are); elsewhere the canonical tensors moved there."""
        return self if torch.device(device).type == "cpu" else super().to(device)

    def take_rows(self, rows: np.ndarray | torch.Tensor) -> GGUFBlockWeight:
        """The weight of rows `rows` (in that order), blocks copied: no canonical tensor of the whole matrix is
        made (an untied embedding's lookup unpacks only the rows it gathers)."""
        return GGUFBlockWeight(self.blocks[np.asarray(rows)], self.gguf_type)

    def _stack(self, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """GGUF blocks stack as blocks (concat_rows has checked that the parts share their format)."""
        if all(isinstance(p, GGUFBlockWeight) for p in parts):
            return GGUFBlockWeight(np.concatenate([p.blocks for p in parts]), self.gguf_type)
        return super()._stack(parts)


def from_blocks(raw: np.ndarray, gguf_type: str, shape: tuple[int, int]) -> GGUFBlockWeight:
    """A GGUF tensor's raw bytes (any array viewable as uint8; [out, in] in Hugging Face order) as a
    canonical QuantizedWeight whose tensors are made from the blocks on first use."""
    return GGUFBlockWeight(_blocks(raw, gguf_type, shape), gguf_type)


def to_blocks(weight: QuantizedWeight) -> np.ndarray:
    """The GGUF bytes [out, in / 32 * block_bytes] of a weight in one of the native block formats."""
    gguf_type = weight.spec.gguf_type
    if gguf_type not in BLOCK_BYTES:
        raise ValueError(f"{weight.spec} is not a GGUF block format we write ({', '.join(NATIVE)})")
    out, inp = weight.shape
    codes = weight.codes.cpu().numpy().reshape(out, inp // BLOCK, BLOCK)
    parts = [weight.scales.cpu().to(torch.float16).numpy()[..., None].view(np.uint8)]
    if gguf_type == "Q8_0":
        parts.append(codes.astype(np.int8).view(np.uint8))
    elif gguf_type == "Q4_0":
        parts.append(_pack_nibbles((codes + 8).astype(np.uint8)))
    else:
        parts += [weight.mins.cpu().to(torch.float16).numpy()[..., None].view(np.uint8),
                  _pack_nibbles(codes.astype(np.uint8))]
    return np.concatenate(parts, axis=-1).reshape(out, -1)


def _round_away(x: np.ndarray) -> np.ndarray:
    """roundf (half away from zero), as ggml's Q8_0 reference uses: numpy's rint (half to even, exact) moved one
    away from zero where it rounded an exact half towards it (x - rint(x) is exact in float32). 1.7x the speed of
    floor-based rounding on a 4096 x 4096 matrix (the IQ1-IQ3 grid types are re-quantized at load: gguf_mapped.py)."""
    r = np.rint(x)
    off = x - r
    r += ((off == 0.5) & (x > 0)).astype(x.dtype)
    r -= ((off == -0.5) & (x < 0)).astype(x.dtype)
    return r


def _reciprocal(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def quantize_blocks(w: torch.Tensor, spec: QuantSpec) -> QuantizedWeight:
    """Round-to-nearest `w` [out, in] into `spec`'s GGUF block format, bit-exact with llama.cpp's reference
    quantization (ggml-quants.c quantize_row_q8_0_ref / q4_0_ref / q4_1_ref), in float32 like it."""
    gguf_type = spec.gguf_type
    if gguf_type not in BLOCK_BYTES:
        raise ValueError(f"{spec} is not a GGUF block format we quantize to ({', '.join(NATIVE)})")
    out, inp = w.shape
    if inp % BLOCK:
        raise ValueError(f"{gguf_type}: in_features {inp} is not a multiple of {BLOCK}")
    x = w.detach().to(torch.float32).cpu().numpy().reshape(out, inp // BLOCK, BLOCK)
    if gguf_type == "Q8_0":
        d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
        codes = _round_away(x * _reciprocal(d)).astype(np.int8)
        return QuantizedWeight(spec, torch.from_numpy(codes.reshape(out, inp)), _half(d))
    if gguf_type == "Q4_0":
        signed_max = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)
        d = signed_max / np.float32(-8)
        q = np.clip(np.trunc(x * _reciprocal(d) + np.float32(8.5)), 0, 15)
        codes = q.astype(np.int8) - 8
        return QuantizedWeight(spec, torch.from_numpy(codes.reshape(out, inp)), _half(d))
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    q = np.clip(np.trunc((x - lo) * _reciprocal(d) + np.float32(0.5)), 0, 15).astype(np.int8)
    return QuantizedWeight(spec, torch.from_numpy(q.reshape(out, inp)), _half(d), mins=_half(lo))


def _half(per_block: np.ndarray) -> torch.Tensor:
    """[out, blocks, 1] float32 -> [out, blocks] float16 (the stored precision of d and m)."""
    return torch.from_numpy(per_block[..., 0].astype(np.float16))


def dequantize_other(name: str, raw: np.ndarray, gguf_type: GGMLQuantizationType,
                     shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor with no native path (a float type, or blocks outside a matrix) as float32, via gguf-py; a
    block type gets one log line naming the tensor and its type."""
    if gguf_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        log.info("GGUF tensor %s is %s, which has no native kernel: dequantized to float", name, gguf_type.name)
    values = gguf_dequantize(raw, gguf_type).reshape(shape)
    return torch.from_numpy(np.require(values, dtype=np.float32, requirements=["C", "W"]))
