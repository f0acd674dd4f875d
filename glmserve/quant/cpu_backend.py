"""`cpu_block`: our own CPU kernels (kernels/csrc/quant_matmul.cpp) for int8 and int4 weights, priority 10.

Formats: int8 by tensor, channel or group (a multiple of 32), symmetric or with zero points; int4 by group
(32, 64, any multiple of 32), symmetric or asymmetric; GGUF Q8_0, Q4_0, Q4_1 (canonical form) and Q5_0, Q5_1, Q6_K,
Q3_K, Q2_K (quant/gguf_mapped.py). Each runs in blocks of 32 inputs: at `prepare` every block of an output row becomes
w = d * c + m with fp16 d and m (c: signed int8, an unsigned nibble, for 5 bits a nibble and a fifth bit kept in a
plane of its own, or for int8 codes drawn from a 16-value table (IQ4: TableCodesWeight) a nibble index into the table
kept with each block; Q6_K's 6-bit codes c in [-32, 31] with a scale per 16 inputs are stored as c + 32, a nibble and
two top bits, w = d * c, the scale of inputs 16..31 kept in the block, Q3_K's codes in [-4, 3] likewise as c + 8 in a
nibble, GGUF NVFP4's (E2M1 values from a table, a scale per 16) as nibble indices into the block's table of c + 32,
Q2_K's codes 0..3 with a scale and a min per 16 as two bits alone (`pack_two_bit`); symmetric int4 / 5-bit codes are
stored as c + 8 / c + 16 with m = -8 d / -16 d, integer zero points become m = -d * zero, Q4_1's min is m itself, a
per-channel or per-tensor scale or a group of 64 is repeated on every block it covers), rows are interleaved in tiles
of 16 and the canonical tensors are not kept (GGUF blocks are copied into the tiles as they are: `pack_gguf`).
in_features is padded to a multiple of 32 and out_features to 16 (zero codes and scales). FP8 and NVFP4 weights of
float specs (E4M3, E2M1 codes: `glmserve quantize`'s) are not run here: `cpu_float_block` (quant/cpu_float_backend.py)
runs them.

Activations are quantized to int8 on this path, always: W8A8 (activations `token`, dynamic) as its spec
says, per row; weight-only formats (A16) per block of 32 inputs as llama.cpp does for Q4_0 / Q4_1 / Q8_0
(its q8_0 / q8_1 activation blocks), so that the dot products are integer. This is a deviation from the
reference, which keeps A16 activations in float: per block of 32 the rounding error of each input is
uniform in +-dx/2 (dx = amax / 127) and independent, so the output's relative error is about
amax / (127 sqrt(12) rms) of the input: 0.6% for Gaussian inputs (0.7% to 1% measured with an outlier channel
that sets its block's scale), below the int4 weights' own error and of the order of the int8 weights'
(tests/test_quant_kernels.py states the bounds). Given the same quantized activations and the
fp16 d, m, the integer math is exact: only the fp32 sum of the block results rounds.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from glmserve import kernels
from glmserve.errors import InvalidRequestError
from glmserve.quant.backend import register
from glmserve.quant.gguf_blocks import GGUFBlockWeight
from glmserve.quant.gguf_mapped import TableCodesWeight
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight

QK = 32  # inputs per block (the kernel's)
ROWS = 16  # output rows per tile (the kernel's)
U4_BYTES = ROWS * QK // 2  # nibble bytes per tile and block
FIFTH_BYTES = 64  # after them in 5-bit blocks: 8 masks of 64 fifth bits
TABLE_BYTES = 16  # after them in table blocks: the 16 int8 values their nibbles index
# after them in blocks with two scales (a scale per 16 inputs): 6 bits' top two bits (2 x 64 bytes of four 2-bit
# fields), then the 16 rows' fp16 scales of inputs 16..31
TOP_BITS_BYTES = 128
HIGH_SCALE_BYTES = ROWS * 2
CODE_OFFSET = {6: 32, 4: 8}  # codes stored as c + offset in blocks with two scales, by bits
TABLE_OFFSET = 32  # f4 blocks' tables hold codes c + 32 (c in [-32, 31], as q6's codes)
# bytes per tile block of the formats with two scales -> their codes' offset: q6, s4, f4 (a table and two scales)
TWO_SCALE_OFFSETS = {U4_BYTES + TOP_BITS_BYTES + HIGH_SCALE_BYTES: CODE_OFFSET[6],
                     U4_BYTES + HIGH_SCALE_BYTES: CODE_OFFSET[4],
                     U4_BYTES + TABLE_BYTES + HIGH_SCALE_BYTES: TABLE_OFFSET}
GGUF_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q6_K": 6, "Q3_K": 4, "Q2_K": 2}  # bits of each
Q2_BYTES = TOP_BITS_BYTES + 2 * HIGH_SCALE_BYTES  # 2-bit blocks: the codes as q6's top bits, the high scales and mins
# rows from which AMX CPUs run the bf16 GEMM path instead of the int8 tiles: a whole decode step of the embedded model
# (`bench/profile_decode.py --batch B --prompt-len 128 --clock cpu --no-components`, 1 thread) took 0.90-0.94x the
# time with it at 48 rows, 0.95-0.97x at 40, 1.00-1.01x at 36 (bench/RESULTS.md); prefill-sized batches 1.7-2x
DENSE_MIN_ROWS = 40
# On CPUs with AVX512-BF16 but no AMX (AMD Zen 4): "N" runs batches from N rows on our vdpbf16ps GEMM on the
# packed weight (kernel avx512_bf16_linear, bf16 activations between the MLP's GEMMs as on AMX); unset (the
# default): the int8 tiles run every batch. There vpdpbusd does twice vdpbf16ps's products per cycle: the int8
# tiles measured 1.07-1.4x our bf16 GEMM (and oneDNN's, which it matches) at 64-2,048 rows, a whole prefill of 512 or
# 2,048 tokens 1.06-1.18x faster than with the bf16 GEMM from 64 or 512 rows (bench/RESULTS.md, "Prefill on
# AVX512-BF16 without AMX"); the bf16 path is the more accurate (bf16 activations instead of int8 ones)
AVX512_BF16_ROWS_ENV = "GLMSERVE_AVX512_BF16_ROWS"
# "1": the dense path keeps oneDNN-prepacked bf16 copies of the weights (+2 bytes per weight: 10-30% faster than
# our AMX GEMM at 128-512 rows, bench/RESULTS.md "AMX bf16 GEMM on the packed weights"); otherwise (the default,
# for the memory of quantized serving) our AMX GEMM reads the packed weight (kernel amx_bf16_linear)
PREPACK_ENV = "GLMSERVE_BF16_PREPACK"
# "0": the dense path dequantizes the whole weight into a bf16 scratch at every call and runs F.linear instead of
# our AMX GEMM (the path before it, kept for A/B: bench/bench_prefill_ab.py --env GLMSERVE_AMX_GEMM=0)
AMX_GEMM_ENV = "GLMSERVE_AMX_GEMM"


@dataclass
class PackedWeight:
    """A weight in the kernel's layout (csrc/quant_matmul.cpp): codes [tiles, blocks, 512 (int8), 256 (int4), 320
    (5 bits: the nibbles, then the fifth bits), 272 (table indices: the nibbles, then the table), 416 (6 bits: the
    nibbles, the top two bits, the scales of inputs 16..31), 288 (4 bits with a scale per 16: the nibbles, the
    scales of inputs 16..31), 304 (table indices with a scale per 16: the nibbles, the table, those scales) or 192
    (2 bits with a scale and a min per 16: the codes as q6's top bits, the scales and mins of inputs 16..31)] uint8,
    scales and mins [tiles, blocks, 16] float16 (mins empty when every m is 0; scales of inputs 0..15 where there are
    two). `u4`: the codes are nibbles (int4, 5 or 6 bits, or table indices; the kernels' argument of that name)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    u4: bool
    in_features: int
    out_features: int
    per_token: bool
    linear: Callable
    dense_path: DensePath | None  # how large batches run as a bf16 GEMM; None where they do not (dense_path_for)
    dense: torch.Tensor | None = None  # the bf16 weight in oneDNN's blocked layout, made at its first dense call

    @property
    def gemm(self) -> Callable | None:
        """amx_bf16_linear or avx512_bf16_linear where the dense path is taken."""
        return self.dense_path.gemm if self.dense_path else None

    @property
    def dequantize(self) -> Callable | None:
        """The kernel's dequantize_packed (into bf16) where the dense path is taken."""
        return self.dense_path.dequantize if self.dense_path else None

    @property
    def nbytes(self) -> int:
        """The bytes a matmul reads of this weight."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins))


def _weight_format_supported(spec: QuantSpec) -> bool:
    if spec.gguf_type is not None:
        return GGUF_TYPES.get(spec.gguf_type) == spec.num_bits and spec.type == "int"
    if spec.type != "int" or spec.dynamic or spec.num_bits not in (4, 8):
        return False
    if spec.strategy == "group":
        return spec.group_size is not None and spec.group_size % QK == 0
    return spec.num_bits == 8 and spec.strategy in ("tensor", "channel")


def _activations_per_token(activations: QuantSpec | None) -> bool | None:
    """True: int8 per row (W8A8); False: per block of 32 (weight-only, or int8 activations by group of 32);
    None: activations this backend does not run (float8, other groupings)."""
    if activations is None:
        return False
    if activations.type != "int" or activations.num_bits != 8 or not activations.symmetric:
        return None
    if activations.strategy == "token":
        return True
    if activations.strategy == "group" and activations.group_size == QK:
        return False
    return None


class CpuBlockBackend:
    """Repacks once at load, then one kernel call per matmul (activation quantization included)."""

    name = "cpu_block"

    def supports(self, weight: QuantSpec, activations: QuantSpec | None, device: torch.device) -> bool:
        return (device.type == "cpu" and _weight_format_supported(weight)
                and _activations_per_token(activations) is not None
                and kernels.op("quant_linear", device, torch.float32) is not None)

    def prepare(self, weight: QuantizedWeight, activations: QuantSpec | None, device: torch.device) -> PackedWeight:
        if not self.supports(weight.spec, activations, device):
            raise InvalidRequestError(f"{self.name} does not run {weight.spec} (activations {activations}) on {device}")
        out_features, in_features = weight.shape
        bits = weight.spec.num_bits
        per_token = bool(_activations_per_token(activations))
        if isinstance(weight, GGUFBlockWeight):
            packed = pack_gguf(weight)
        elif weight.spec.group_size == 16:
            packed = pack_two_bit(weight) if weight.spec.num_bits == 2 else pack_two_scales(weight)
        else:
            codes, d, m = block_form(weight)
            indices = None  # codes from a 16-value table (IQ4): their indices as nibbles, the table per block
            if isinstance(weight, TableCodesWeight) and not per_token:
                indices = _table_indices(codes, weight.table)
            if indices is None:
                packed = pack(codes, d, m, bits)
            else:
                packed, bits = pack(indices.view(torch.int8), d, m, 4, weight.table), 4
        return PackedWeight(*packed, u4=bits < 8, in_features=in_features,
                            out_features=out_features, per_token=per_token,
                            linear=kernels.op("quant_linear", device, torch.float32),
                            dense_path=None if per_token else dense_path_for(device))

    def apply(self, prepared: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        p = prepared
        if x.shape[-1] != p.in_features:
            raise InvalidRequestError(f"input has {x.shape[-1]} features, the weight takes {p.in_features}")
        rows = x if x.dim() == 2 else x.reshape(-1, p.in_features)
        if self.bf16_rows(p, rows.shape[0]):  # bf16 in and out: no float32 round trip for bf16 activations
            out = dense_apply(p, rows)
        else:
            if rows.dtype != torch.float32 or not rows.is_contiguous():  # no no-op calls per linear of a step
                rows = rows.to(torch.float32).contiguous()
            out = p.linear(rows, p.per_token, p.codes, p.scales, p.mins, p.u4, p.out_features)
        if bias is not None:
            out = out.to(torch.float32) + bias.to(torch.float32)
        if x.dim() != 2:
            out = out.reshape(*x.shape[:-1], p.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def small_batch(self, prepared: PackedWeight) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
        """`apply` of float32 contiguous [T, in] rows without bias as one bound kernel call (no checks: a decode
        step's straight line of calls, models/llama_decode.py), and the row count from which `apply` takes
        another path (the bf16 GEMM, `bf16_rows`) that this call does not."""
        return _bound(prepared.linear, prepared)

    def small_batch_swiglu(self, prepared: PackedWeight) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """`small_batch` of a gated MLP's merged gate-up weight returning silu(gate) * up [T, I] (kernel
        quant_linear_swiglu: the floats of silu_and_mul after `apply`, without the [T, 2I] product written out and
        read back), and the same row limit; None where I is not a multiple of 16 (a tile may not hold both halves)
        or the kernel is missing."""
        fused = kernels.op("quant_linear_swiglu", torch.device("cpu"), torch.float32)
        return None if fused is None or prepared.out_features % (2 * ROWS) else _bound(fused, prepared)

    def dense_batch(self, prepared: PackedWeight) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """`apply` of bf16 contiguous [T, in] rows without bias from the row count where it takes the bf16 GEMM
        (`bf16_rows`), as one bound call returning bf16 (`dense_apply`, as `apply` calls it), and that row count;
        None where this CPU runs every batch on the int8 tiles."""
        p = prepared
        return None if p.dense_path is None else ((lambda x: dense_apply(p, x)), p.dense_path.min_rows)

    def dense_batch_swiglu(self, prepared: PackedWeight) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """`dense_batch` of a gated MLP's merged gate-up weight returning silu(gate) * up [T, I] bf16 (kernel
        amx_bf16_linear_swiglu: silu_and_mul's floats on the bf16 product, computed in the GEMM's store instead of
        a pass over the [T, 2I] product), and the same row count; None where this CPU has no such GEMM (no AMX) or
        I is not a multiple of 16."""
        p = prepared
        if p.dense_path is None or p.dense_path.gemm_swiglu is None or p.out_features % (2 * ROWS):
            return None
        return (lambda x: dense_swiglu_apply(p, x)), p.dense_path.min_rows

    def bf16_rows(self, prepared: PackedWeight, rows: int) -> bool:
        """True where `apply` runs `rows` rows as the bf16 GEMM (`dense_apply`): AMX CPUs from DENSE_MIN_ROWS
        rows, CPUs with AVX512-BF16 but no AMX from GLMSERVE_AVX512_BF16_ROWS rows where it is set. There bf16
        activations go in and come back in bf16 with no float32 round trip (layers/linear.py `bf16_between` keeps
        the MLP's activations in bf16)."""
        return prepared.dense_path is not None and rows >= prepared.dense_path.min_rows

    def dequantize_rows(self, prepared: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of w = d * c + m read back from the tile layout (`pack`'s inverse for those rows), so that
        no canonical copy of the weight is kept (a tied embedding's lookup, weight inspection)."""
        p = prepared
        tile, row = ids // ROWS, ids % ROWS
        if p.codes.shape[2] == Q2_BYTES:
            return _two_bit_rows(p, tile, row).to(dtype)
        groups = 4 if p.u4 else 8
        tiles = p.codes[..., :groups * ROWS * 4].view(*p.codes.shape[:2], groups, ROWS, 4)  # [tiles, blocks, j, row, t]
        codes = tiles[tile, :, :, row]  # [n, blocks, j, t]: only the rows asked for are gathered
        if p.u4:  # byte j*4+t holds input j*4+t (low nibble) and 16 + j*4+t (high nibble)
            c = torch.cat((codes & 15, codes >> 4), dim=-2)  # [n, blocks, i, t]: input 4i + t
            extra = p.codes[tile, :, U4_BYTES:]  # [n, blocks, fifth bits, table, or (top bits and) high scales]
            if extra.shape[2] == FIFTH_BYTES:  # bit 4 row + t of mask i is the fifth bit of input 4i + t
                masks = extra.reshape(len(ids), -1, 8, 8)  # [n, blocks, i, 8 bytes]
                bits = torch.from_numpy(np.unpackbits(masks.numpy(), axis=-1, bitorder="little"))
                c = c + 16 * bits.view(*masks.shape[:3], ROWS, 4)[torch.arange(len(ids)), :, :, row]
            elif extra.shape[2] == TOP_BITS_BYTES + HIGH_SCALE_BYTES:  # the top two bits
                c = c + 16 * _top_bit_fields(extra[..., :TOP_BITS_BYTES], row)
            elif extra.shape[2] in (TABLE_BYTES, TABLE_BYTES + HIGH_SCALE_BYTES):  # each nibble indexes its block's
                # table
                c = torch.gather(extra[..., :TABLE_BYTES].view(torch.int8), 2, c.flatten(2).long()).view(c.shape)
            c = c.to(torch.float32)
        else:
            c = codes.view(torch.int8).to(torch.float32)
        d = p.scales[tile, :, row].to(torch.float32)  # [n, blocks]
        offset = TWO_SCALE_OFFSETS.get(p.codes.shape[2])
        if offset is not None:  # w = d * (c - offset), inputs 16..31 by the block's own d
            high = p.codes[tile, :, -HIGH_SCALE_BYTES:].contiguous().view(torch.float16)  # [n, blocks, 16]
            d = torch.stack((d, high[torch.arange(len(ids)), :, row].to(torch.float32)), dim=-1)  # [n, blocks, 2]
            w = (c.view(*c.shape[:2], 2, 16) - offset) * d.unsqueeze(-1)
            return w.flatten(1)[:, :p.in_features].to(dtype)
        w = c.flatten(2) * d.unsqueeze(-1)  # [n, blocks, 32]
        if p.mins.numel():
            w = w + p.mins[tile, :, row].to(torch.float32).unsqueeze(-1)
        return w.flatten(1)[:, :p.in_features].to(dtype)


def _bound(kernel: Callable, p: PackedWeight) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """`kernel` (quant_linear or quant_linear_swiglu) bound to p's packed weight, and the row count from which
    `apply` takes the bf16 GEMM instead (none: sys.maxsize)."""
    args = (p.per_token, p.codes, p.scales, p.mins, p.u4, p.out_features)
    return (lambda x: kernel(x, *args)), (p.dense_path.min_rows if p.dense_path else sys.maxsize)


@dataclass(frozen=True)
class DensePath:
    """How large batches run as a bf16 GEMM (`dense_apply`) on this CPU: `gemm` our kernel on the packed weight,
    `dequantize` the kernel's dequantize_packed (the oneDNN options), from `min_rows` rows; `gemm_swiglu` the GEMM
    with SwiGLU in its store (`dense_swiglu_apply`; None: the GEMM, then silu_and_mul)."""

    gemm: Callable
    dequantize: Callable
    min_rows: int
    gemm_swiglu: Callable | None = None


def dense_path_for(device: torch.device) -> DensePath | None:
    """The bf16 GEMM path of large batches on `device`, or None where they stay on the int8 tiles: with the avx512
    build active (GLMSERVE_CPU_ISA=avx2 or scalar stands for a CPU without either), a CPU with AMX takes our AMX
    GEMM from DENSE_MIN_ROWS rows; one with AVX512-BF16 and no AMX our vdpbf16ps GEMM where GLMSERVE_AVX512_BF16_ROWS
    gives the rows it starts at."""
    gemm_swiglu = None
    if kernels.amx_bf16():
        gemm, min_rows = kernels.op("amx_bf16_linear", device, torch.float32), DENSE_MIN_ROWS
        gemm_swiglu = kernels.op("amx_bf16_linear_swiglu", device, torch.float32)
    elif kernels.avx512_bf16() and os.environ.get(AVX512_BF16_ROWS_ENV):
        rows = os.environ[AVX512_BF16_ROWS_ENV]
        if not rows.isdigit() or int(rows) < 1:
            raise InvalidRequestError(f"{AVX512_BF16_ROWS_ENV}={rows!r}: must be a positive number of rows")
        gemm, min_rows = kernels.op("avx512_bf16_linear", device, torch.float32), int(rows)
    else:
        return None
    dequantize = kernels.op("dequantize_packed", device, torch.float32)
    if gemm is None or dequantize is None:
        return None
    return DensePath(gemm, dequantize, min_rows, gemm_swiglu)


_scratch: dict[str, torch.Tensor] = {}  # one bf16 buffer for every layer's dequantized weight (grows)


def _dequantized(p: PackedWeight) -> torch.Tensor:
    """The weight dequantized into the shared bf16 scratch: [out, in] (a view, overwritten by the next call)."""
    kp = p.codes.shape[1] * QK
    need = p.out_features * kp
    buf = _scratch.get("bf16")
    if buf is None or buf.numel() < need:
        buf = _scratch["bf16"] = torch.empty(need, dtype=torch.bfloat16)
    return p.dequantize(p.codes, p.scales, p.mins, p.u4, p.out_features, True, buf)[:, :p.in_features]


def prepacked(p: PackedWeight) -> torch.Tensor:
    """The weight as oneDNN's prepacked bf16 matrix (its AMX blocked layout, as vLLM-CPU and IPEX keep their
    linear weights), made once at the first dense call and kept: the dense path then neither dequantizes nor
    lets oneDNN reorder a plain weight at every call (bench/RESULTS.md, "Prefill on AMX"). Costs 2 bytes per
    weight on top of the packed codes, for the layers that ever run a prefill-sized batch."""
    if p.dense is None:
        p.dense = torch.ops.mkldnn._reorder_linear_weight(_dequantized(p).contiguous(), DENSE_MIN_ROWS * 4)
    return p.dense


def _our_gemm() -> bool:
    """False where GLMSERVE_BF16_PREPACK=1 or GLMSERVE_AMX_GEMM=0 sends the dense path to oneDNN (read per call: the
    A/B benchmarks and tests switch it in a running process)."""
    return os.environ.get(PREPACK_ENV) != "1" and os.environ.get(AMX_GEMM_ENV) != "0"


def dense_apply(p: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """rows [T, in] (float32 or bf16) x the bf16 weight -> [T, out] bf16 (sums in float32, rounded once): our AMX
    (or, without AMX, AVX512-BF16) GEMM on the packed weight (dequantized panel by panel inside the kernel, nothing
    kept), or with GLMSERVE_BF16_PREPACK=1 oneDNN on the prepacked weight, or with GLMSERVE_AMX_GEMM=0 the weight
    dequantized whole at this call and oneDNN."""
    if _our_gemm():
        return p.gemm(rows, p.codes, p.scales, p.mins, p.u4, p.out_features)
    if os.environ.get(PREPACK_ENV) == "1":
        x = rows.to(torch.bfloat16).contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, prepacked(p), None, "none", [], "")
    return F.linear(rows.to(torch.bfloat16).contiguous(), _dequantized(p))


def dense_swiglu_apply(p: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of dense_apply(p, rows) for a merged gate-up weight -> [T, out / 2] bf16: in our AMX GEMM's
    store, or where GLMSERVE_BF16_PREPACK / GLMSERVE_AMX_GEMM send dense_apply to oneDNN, silu_and_mul after it."""
    if _our_gemm():
        return p.dense_path.gemm_swiglu(rows, p.codes, p.scales, p.mins, p.u4, p.out_features)
    return kernels.op("silu_and_mul", rows.device, torch.bfloat16)(dense_apply(p, rows))


def _per_block(t: torch.Tensor, spec: QuantSpec, out: int, blocks: int) -> torch.Tensor:
    """Scales / zeros / mins [out or 1, groups] as float32 [out, blocks], one per block of 32 inputs."""
    t = t.to(torch.float32)
    if spec.strategy in ("tensor", "channel") and t.shape[1] == 1:
        return t.expand(out, blocks)
    group = spec.group_size or QK
    return t.repeat_interleave(group // QK, dim=1)[:, :blocks].expand(out, blocks)


def block_form(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The weight as stored codes c [out, in] (int8 signed, or 0..15 for int4, 0..31 for 5 bits) and per-block
    d, m [out, ceil(in / 32)] fp16 with w = d * c + m (m None when it is 0 everywhere). Raises InvalidRequestError
    where a code is out of its format's range or a scale does not fit fp16."""
    spec, (out, inp) = weight.spec, weight.shape
    blocks = -(-inp // QK)
    c = weight.codes
    least, most = (int(v) for v in torch.aminmax(c))  # one pass for the offset and the range check
    if spec.num_bits in (4, 5):  # stored unsigned: signed codes [-8, 7] / [-16, 15] move up by 8 / 16
        offset = 1 << (spec.num_bits - 1) if least < 0 else 0
        lo, hi = 0, (1 << spec.num_bits) - 1
    else:  # stored signed: uint8 codes (asymmetric int8) move down by 128
        offset = -128 if weight.codes.dtype == torch.uint8 else 0
        lo, hi = -128, 127
    if least + offset < lo or most + offset > hi:
        raise InvalidRequestError(f"{spec}: codes outside the format's range")
    if offset:  # widened only where codes move: an lm_head's int16 copies were the load's peak
        c = c.to(torch.int16) + offset
    d = _per_block(weight.scales, spec, out, blocks)
    m = None
    if offset or weight.zeros is not None or weight.mins is not None:
        z = offset + (_per_block(weight.zeros, spec, out, blocks) if weight.zeros is not None else 0)
        m = -d * z + (_per_block(weight.mins, spec, out, blocks) if weight.mins is not None else 0)
        m = m.to(torch.float16)
    d = d.to(torch.float16)
    if not _finite(d) or (m is not None and not _finite(m)):
        raise InvalidRequestError(f"{spec}: a scale or min does not fit float16")
    return c.to(torch.int8), d, m


def _finite(half: torch.Tensor) -> bool:
    """Whether no float16 value is inf or NaN (exponent bits all ones), read from the bits in numpy: torch.isfinite
    of float16 on CPU converts each value, 0.1 s of the embedded model's load, and torch's int16 bitwise ops and
    compares ran 50-100x slower than numpy's (24 ms against 0.3 ms for the 884K scales of the embedding)."""
    return not ((half.contiguous().numpy().view(np.uint16) & 0x7C00) == 0x7C00).any()


def pack(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
         table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_form's tensors of a `bits`-bit format (8, 4 or 5) in the kernel's tile layout (csrc/quant_matmul.cpp's
    header), padded to whole blocks of 32 inputs and tiles of 16 rows; with `table` (int8 [16], 4-bit indices as
    codes) the t4 layout: each tile block's nibbles, then the table's values. Scales per 16 inputs [out, 2 * blocks]
    (`pack_two_scales`: 6 bits, codes 0..63, the q6 layout; 4 bits, the s4 layout, or with a table of codes c + 32
    the f4 layout): no mins."""
    out, inp = codes.shape
    high = None
    if scales.shape[1] * 16 == -(-inp // QK) * QK:  # the scales of inputs 16..31 go into the blocks, 0..15 the tiles' d
        scales, high = scales[:, 0::2], scales[:, 1::2]
    blocks = scales.shape[1]
    tiles = -(-out // ROWS)
    pad_rows = tiles * ROWS - out
    c = codes if not pad_rows and blocks * QK == inp else F.pad(codes, (0, blocks * QK - inp, 0, pad_rows))
    c = c.view(torch.uint8)  # the same bits: int8 codes, or nibbles 0..15
    if c.storage_offset() % 4:  # a view into another tensor: int32 words below need aligned storage
        c = c.clone()
    tail = [table.view(torch.uint8).expand(tiles, blocks, TABLE_BYTES)] if table is not None else []
    if bits == 5:
        tail.append(_fifth_bits(c, tiles, blocks))
    if bits == 6:  # the top two bits
        tail.append(_top_bits(c, tiles, blocks))
    if high is not None:  # the scales of inputs 16..31
        tail.append(_tiled(high, tiles).view(torch.uint8))
    if bits < 8:  # [tile, row, block, half, 16] -> byte = low half | high half << 4: [tile, row, block, 16 bytes]
        c = c.reshape(tiles, ROWS, blocks, 2, 16)
        if bits > 4:
            c = c & 15
        c = (c[:, :, :, 1] << 4).bitwise_or_(c[:, :, :, 0])  # one temporary, or'ed into in place
    code_bytes = U4_BYTES if bits < 8 else ROWS * QK  # nibbles (5 and 6 bits: the rest in the tail) or bytes
    packed = torch.empty(tiles, blocks, code_bytes + sum(t.shape[-1] for t in tail), dtype=torch.uint8)
    # [tile, row, block, j, t] -> [tile, block, j, row, t], the 4 bytes t moved as one int32 (a quarter of the
    # elements to permute: 8x faster on the 49K-row embedding, bench/RESULTS.md), straight into the blocks' first
    # bytes (no permuted copy, and no second one to append the tail)
    words = c.reshape(tiles, ROWS, blocks, -1, 4).view(torch.int32)[..., 0]
    packed.view(torch.int32)[:, :, :code_bytes // 4].unflatten(2, (-1, ROWS)).copy_(words.permute(0, 2, 3, 1))
    if tail:
        packed[:, :, code_bytes:] = torch.cat(tail, dim=-1) if len(tail) > 1 else tail[0]
    return packed, _tiled(scales, tiles), _tiled(mins, tiles) if mins is not None else _NO_MINS


def _table_indices(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
    """int8 codes [out, in] as indices (uint8, 0..15) into `table` (int8 [16]); None where some code is not one of
    the table's values."""
    position = torch.full((256,), -1, dtype=torch.int16)
    position[table.long() + 128] = torch.arange(len(table), dtype=torch.int16)
    codes = codes.view(torch.uint8)  # c + 128 is its bits with the sign bit flipped
    indices = torch.empty(codes.shape, dtype=torch.uint8)
    # in chunks of 64K codes: the index tensors are int32 / int64 (an embedding's 28M); with chunks of 1M codes a file
    # of table weights (every decoder matrix MXFP4) left the serving process's peak RSS 130 MB higher (heap pages of
    # the freed temporaries kept by the allocator)
    rows = max(1, (1 << 16) // max(1, codes.shape[1]))
    for r in range(0, codes.shape[0], rows):
        found = position[(codes[r:r + rows] ^ 0x80).to(torch.int32)]
        if bool((found < 0).any()):
            return None
        indices[r:r + rows] = found.to(torch.uint8)
    return indices


def pack_two_scales(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack` of a weight with an fp16 scale per 16 inputs and symmetric 6- or 4-bit codes c in [-32, 31] / [-8, 7]
    (GGUF Q6_K / Q3_K as quant/gguf_mapped.py reads them), w = d * c, as codes c + 32 / c + 8; codes from a table of
    values in [-32, 31] (TableCodesWeight: GGUF NVFP4) as nibble indices into the table of c + 32 (f4). Raises
    InvalidRequestError where a code is out of range, the inputs are not whole blocks of 32, or a scale does not fit
    fp16."""
    spec, inp = weight.spec, weight.shape[1]
    offset = CODE_OFFSET.get(spec.num_bits)
    if offset is None or inp % QK or weight.zeros is not None or weight.mins is not None:
        raise InvalidRequestError(f"{spec}: a scale per 16 inputs runs with 6- or 4-bit codes, no minimum, in blocks "
                                  "of 32 inputs")
    scales = weight.scales.to(torch.float16)
    if not _finite(scales):
        raise InvalidRequestError(f"{spec}: a scale does not fit float16")
    if isinstance(weight, TableCodesWeight) and -TABLE_OFFSET <= int(weight.table.min()) <= int(weight.table.max()) \
            < TABLE_OFFSET and (indices := _table_indices(weight.codes, weight.table)) is not None:
        return pack(indices.view(torch.int8), scales, None, 4, weight.table + TABLE_OFFSET)
    least, most = (int(v) for v in torch.aminmax(weight.codes))
    if least < -offset or most >= offset:
        raise InvalidRequestError(f"{spec}: codes outside the format's range")
    return pack(weight.codes + offset, scales, None, spec.num_bits)


def pack_two_bit(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight of 2-bit codes q (0..3) with an fp16 scale d and min m per 16 inputs (GGUF Q2_K as quant/gguf_mapped.py
    reads it), w = d * q + m, in the q2 layout: per tile block the codes as q6 keeps its top two bits (`_top_bits`),
    then the rows' scales and mins of inputs 16..31 (those of 0..15: the tiles' d and m). Raises InvalidRequestError
    where a code is out of range, there is no min, the inputs are not whole blocks of 32, or a scale or min does not
    fit fp16."""
    spec, (out, inp) = weight.spec, weight.shape
    if inp % QK or weight.mins is None or weight.zeros is not None:
        raise InvalidRequestError(f"{spec}: 2-bit codes run with a min per 16 inputs, in blocks of 32 inputs")
    least, most = (int(v) for v in torch.aminmax(weight.codes))
    if least < 0 or most > 3:
        raise InvalidRequestError(f"{spec}: codes outside the format's range")
    scales, mins = weight.scales.to(torch.float16), weight.mins.to(torch.float16)
    if not (_finite(scales) and _finite(mins)):
        raise InvalidRequestError(f"{spec}: a scale or min does not fit float16")
    tiles, blocks = -(-out // ROWS), inp // QK
    c = F.pad(weight.codes.view(torch.uint8), (0, 0, 0, tiles * ROWS - out)) << 4  # the top bits' place in 6 bits
    packed = torch.cat((_top_bits(c, tiles, blocks), _tiled(scales[:, 1::2], tiles).view(torch.uint8),
                        _tiled(mins[:, 1::2], tiles).view(torch.uint8)), dim=-1)
    return packed, _tiled(scales[:, 0::2], tiles), _tiled(mins[:, 0::2], tiles)


def _top_bit_fields(top: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """The two-bit fields of rows `row` from q6 / q2 top-bit bytes [n, blocks, 128] (`_top_bits`' layout: bits 2k,
    2k+1 of byte 4 row + t of vector h are input 4 (4h + k) + t) as [n, blocks, i = 4h + k, t] uint8."""
    n = len(row)
    top = top.reshape(n, -1, 2, ROWS, 4)[torch.arange(n), :, :, row]  # [n, blocks, h, t]
    return ((top.unsqueeze(-2) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3).flatten(2, 3)


def _two_bit_rows(p: PackedWeight, tile: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Rows (tile, row) of a q2 weight as float32 [n, in] (`pack_two_bit`'s inverse for those rows)."""
    n = torch.arange(len(tile))
    c = _top_bit_fields(p.codes[tile, :, :TOP_BITS_BYTES], row).to(torch.float32).view(len(tile), -1, 2, 16)
    high = p.codes[tile, :, TOP_BITS_BYTES:].contiguous().view(torch.float16)  # [n, blocks, 32]: scales, then mins
    d = torch.stack((p.scales[tile, :, row], high[n, :, row]), dim=-1).to(torch.float32).unsqueeze(-1)
    m = torch.stack((p.mins[tile, :, row], high[n, :, ROWS + row]), dim=-1).to(torch.float32).unsqueeze(-1)
    return (c * d + m).flatten(1)[:, :p.in_features]  # halves of 16 inputs, each by its own d and m


def _top_bits(c: torch.Tensor, tiles: int, blocks: int) -> torch.Tensor:
    """The top two bits of 6-bit codes c [tiles * 16, blocks * 32] (uint8) as the q6 layout keeps them: per tile and
    block 2 x 64 bytes [tiles, blocks, 128], bits 2k, 2k+1 of byte 4 r + t of vector h those of row r's input 4 i + t,
    i = 4h + k."""
    top = (c.reshape(tiles, ROWS, blocks, 2, 4, 4) >> 4).permute(0, 2, 3, 1, 5, 4)  # [tile, block, h, r, t, k]
    return (top << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)).sum(-1, dtype=torch.uint8).reshape(tiles, blocks, 128)


def _fifth_bits(c: torch.Tensor, tiles: int, blocks: int) -> torch.Tensor:
    """The fifth bits of 5-bit codes c [tiles * 16, blocks * 32] (uint8) as the u5 layout keeps them: per tile and
    block 8 masks of 64 bits [tiles, blocks, 64 bytes], bit 4 r + t of mask i the fifth bit of row r's input 4 i + t."""
    high = (c.reshape(tiles, ROWS, blocks, 8, 4) >> 4) & 1  # [tile, row r, block, i, t]
    high = high.permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 8, ROWS * 4)  # [tile, block, i, 4 r + t]
    return torch.from_numpy(np.packbits(high.numpy(), axis=-1, bitorder="little")).reshape(tiles, blocks, 64)


_NO_MINS = torch.empty(0, dtype=torch.float16)


def _tiled(t: torch.Tensor, tiles: int) -> torch.Tensor:
    """Per-block d or m [out, blocks] -> [tiles, blocks, 16], rows padded with zeros to whole tiles."""
    return torch.from_numpy(_tile_fields(t.numpy(), tiles))


def pack_gguf(weight: GGUFBlockWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack(*block_form(weight), u4)` of a GGUF Q8_0 / Q4_0 / Q4_1 weight, bit for bit, read from its blocks in
    strided copies: a block's quants already are the tile layout's bytes of its row (ggml-common.h block_q8_0:
    byte i = q_i; block_q4_0 / block_q4_1: byte i = q_i | q_{i+16} << 4, as the u4 layout pairs inputs), so no
    code is unpacked. Q4_0's codes q - 8 are stored as q (m = -8 d) unless no code is negative anywhere."""
    quants, blocks = weight.quants, weight.blocks
    tiles = -(-weight.shape[0] // ROWS)
    offset = 0
    if weight.gguf_type == "Q4_0":  # block_form's offset: 8 where some q - 8 < 0, i.e. some nibble < 8
        offset = 8 if (np.bitwise_and.reduce(quants, axis=None) & 0x88) != 0x88 else 0
        if not offset:  # every nibble >= 8: the codes are q - 8 in both halves, no borrow
            quants = quants - np.uint8(0x88)
    fields = blocks.view(np.uint16)  # the fp16 fields' bits: d at word 0, Q4_1's m at word 1
    d = _tile_fields(fields[..., 0], tiles)
    m = _tile_fields(fields[..., 1], tiles) if weight.gguf_type == "Q4_1" else None
    words = _tile_rows(quants.view(np.uint32), tiles)  # [tiles, blocks, words, 16]
    codes = torch.from_numpy(words.view(np.uint8).reshape(tiles, blocks.shape[1], -1))
    d, m = _gguf_scales(weight.spec, d, m, offset)
    return codes, d, m if m is not None else _NO_MINS


def _gguf_scales(spec: QuantSpec, d: np.ndarray, m: np.ndarray | None,
                 offset: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """block_form's d and m (tiled) from the blocks' fp16 bits `d` and Q4_1's `m`, as its float32 arithmetic
    leaves them: d as stored (a non-finite d is refused either way); Q4_1's m as stored, but -d * 0 + m makes a
    -0.0 min +0.0 under a negative d; Q4_0's m = -d * 8 + 0 where its codes move by 8 (`offset`)."""
    if m is not None:
        m[(m == 0x8000) & (d >= 0x8000)] = 0
        m = torch.from_numpy(m).view(torch.float16)
    d = torch.from_numpy(d).view(torch.float16)
    if offset:
        m = (-d.to(torch.float32) * offset + 0).to(torch.float16)
    if not _finite(d) or (m is not None and not _finite(m)):
        raise InvalidRequestError(f"{spec}: a scale or min does not fit float16")
    return d, m


def _aligned(shape: tuple[int, ...], dtype: np.dtype, zeroed: bool) -> np.ndarray:
    """A numpy array in torch-allocated (64-byte aligned) memory, as `pack`'s tiles are: numpy's own large arrays
    start 16 bytes into a page, where each 64-byte load of a tile spans two cache lines (on Zen 4 no measurable cost
    in prefill, bench/RESULTS.md; other CPUs split loads at a higher price)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return (torch.zeros if zeroed else torch.empty)(size, dtype=torch.uint8).numpy().view(dtype).reshape(shape)


def _tile_fields(values: np.ndarray, tiles: int) -> np.ndarray:
    """One value per block [out, blocks] (a d or m) -> [tiles, blocks, 16]: `_tile_rows` of single values."""
    return _tile_rows(values[..., None], tiles)[:, :, 0]


def _tile_rows(values: np.ndarray, tiles: int) -> np.ndarray:
    """Row-major [out, blocks, k] values (any strides, unaligned ones too) -> the tile layout [tiles, blocks, k, 16]:
    value j of row r of a tile at [j, r], rows padded with zeros to whole tiles; one strided copy."""
    out, blocks, k = values.shape
    full = out // ROWS
    packed = _aligned((tiles, blocks, k, ROWS), values.dtype, zeroed=bool(out % ROWS))
    rows_first = packed.transpose(0, 3, 1, 2)  # [tile, row, block, k], a view of `packed`
    rows_first[:full] = values[:full * ROWS].reshape(full, ROWS, blocks, k)
    if out % ROWS:
        rows_first[full, :out % ROWS] = values[full * ROWS:]
    return packed


register(CpuBlockBackend(), priority=10)
