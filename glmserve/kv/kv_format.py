"""KV formats: how a token's key or value row of one kv head is stored in the pool (`--kv-cache-dtype`).

Float formats (float32, bfloat16, float16) store the row as is. `auto` (`default_kv_format`) is int8 for a float32
model on CPU (bfloat16 where the model's attention does not read quantized rows, e.g. the MLA latent cache, or the C++
decode kernel is missing): decode attention, which reads every cached row each step, is memory-bound there, and int8
rows are 0.516x of bfloat16's bytes at +0.11-0.12% perplexity (bench/RESULTS.md "int8 KV by default on CPU"); elsewhere
the model dtype. `--kv-cache-dtype bfloat16` / `float32` keep float rows. Quantized formats store it as 8-bit codes
with one scale per (token, kv head), packed into the same row:

    row [head_dim + 2] = head_dim codes, then the float16 scale's two bytes

- `int8`: symmetric, codes round(x * (1 / scale)) in [-127, 127], scale = absmax / 127 (pool dtype int8);
- `fp8` (E4M3, `float8_e4m3fn`): codes (x / scale) in E4M3, scale = absmax / 448 (pool dtype uint8, the codes'
  bits: CPU torch has no index_copy_ for float8 tensors).

Why per token-head and packed: the row is quantized once, at the KV write (slot mapping store), from that
token's values alone, so it never changes when later tokens join its block (no read-modify-write of a block's
scale, no rescaling of cached prefix blocks), the same token gives the same bytes whatever batch it was
computed in (prefix-cache hits and restored chunks are bit-identical), and one outlier token (an attention
sink's large key) costs only its own row's resolution. Packing the scale into the row makes every block copy
(tiers, running offload, sessions: glmserve/kv/kv_io.py) carry its scales with no second tensor, and the pool's
dtype names its format (`format_of`), so every reader dequantizes with no extra argument. Cost: 2 bytes per
head_dim codes (head_dim 64: 66 bytes a row against bfloat16's 128, 0.516x; head_dim 128: 0.508x). KV formats
follow vLLM's `--kv-cache-dtype fp8` naming (vLLM uses per-tensor scales; these are finer), the int8 scheme
is KIVI's / "KV cache int8" per-token quantization (Liu et al., 2024, arXiv:2402.02750, keys per token here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from glmserve import kernels
from glmserve.errors import InvalidRequestError

SCALE_BYTES = 2  # one float16 scale per row
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
MIN_SCALE = 2.0 ** -24  # smallest float16 subnormal: an all-zero row keeps a usable scale
MAX_SCALE = 65504.0  # largest float16


@dataclass(frozen=True)
class KVFormat:
    """One KV format: its name (as `--kv-cache-dtype` spells it), the pool's storage dtype and whether rows
    are quantized (codes + scale)."""

    name: str
    storage: torch.dtype
    quantized: bool

    def row_width(self, head_dim: int) -> int:
        """Elements (of `storage`) per stored row of `head_dim` values."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def bytes_per_row(self, head_dim: int) -> int:
        return self.row_width(head_dim) * torch.empty((), dtype=self.storage).element_size()

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] float -> stored rows [..., row_width(D)] of `storage` (float formats: a cast)."""
        if not self.quantized:
            return x.to(self.storage)
        xf = x.float()
        top = INT8_MAX if self.name == "int8" else FP8_MAX
        scale = (xf.abs().amax(-1, keepdim=True) / top).clamp_(MIN_SCALE, MAX_SCALE).half()
        scaled = (xf * (1 / scale.float())).clamp_(-top, top)  # by the reciprocal: as the C++ stores (kv_int8.h)
        codes = (scaled.round_().to(torch.int8) if self.name == "int8"
                 else scaled.to(torch.float8_e4m3fn).view(torch.uint8))
        return torch.cat([codes, scale.view(self.storage)], dim=-1)

    def roundtrip(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x as a reader of the pool sees it after the write (quantized, then dequantized in x's dtype; a float
        format narrower than x: rounded), in `dtype` (None: x's). A float format that is `dtype` is one cast; int8
        on CPU one C++ pass (kernels `int8_roundtrip`, the same floats)."""
        dtype = dtype or x.dtype
        if self.quantized:
            if (self.name == "int8" and (kernel := _int8_op("int8_roundtrip", x, dtype)) is not None
                    and x.dtype in _KERNEL_DTYPES):
                return kernel(x.reshape(-1, x.shape[-1]).contiguous(), dtype == torch.bfloat16).view(x.shape)
            return dequantize(self.quantize(x), x.dtype).to(dtype)
        return x.to(self.storage).to(dtype)

    def __str__(self) -> str:
        return self.name


FORMATS: dict[str, KVFormat] = {
    "float32": KVFormat("float32", torch.float32, False),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16, False),
    "float16": KVFormat("float16", torch.float16, False),
    "int8": KVFormat("int8", torch.int8, True),
    "fp8": KVFormat("fp8", torch.uint8, True),
}
ALIASES = {"fp8_e4m3": "fp8"}
_BY_STORAGE = {f.storage: f for f in FORMATS.values()}


def kv_format(name_or_dtype: str | torch.dtype | KVFormat) -> KVFormat:
    """The format named `name_or_dtype` (a `--kv-cache-dtype` value, or a float torch dtype)."""
    if isinstance(name_or_dtype, KVFormat):
        return name_or_dtype
    if isinstance(name_or_dtype, torch.dtype):
        name_or_dtype = str(name_or_dtype).removeprefix("torch.")
    name = ALIASES.get(name_or_dtype, name_or_dtype)
    if name not in FORMATS:
        raise InvalidRequestError(f"KV cache format must be one of {sorted([*FORMATS, *ALIASES])}, "
                                  f"got {name_or_dtype!r}")
    return FORMATS[name]


def default_kv_format(model_dtype: torch.dtype, device: torch.device, quantized_ok: bool = True) -> KVFormat:
    """The format of `--kv-cache-dtype auto`. A float32 model on CPU: int8 where the model's attention reads
    quantized rows (`quantized_ok`) and our C++ decode kernel is built (it reads the codes in place; decode
    attention, which reads every cached row each step, is memory-bound there: bench/RESULTS.md "int8 KV by default
    on CPU"), else bfloat16 (read by a 16-bit shift; prefill over cached context runs bf16 on AMX). Elsewhere the
    model dtype."""
    if device.type == "cpu" and model_dtype == torch.float32:
        if quantized_ok and kernels.op("paged_decode", device, model_dtype) is not None:
            return FORMATS["int8"]
        return FORMATS["bfloat16"]
    return kv_format(model_dtype)


def format_of(pool: torch.Tensor) -> KVFormat:
    """The format of rows stored in `pool` (any slice of a pool), from its dtype."""
    fmt = _BY_STORAGE.get(pool.dtype)
    if fmt is None:
        raise InvalidRequestError(f"no KV format stores rows as {pool.dtype}")
    return fmt


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., W] (any pool slice) -> values [..., D] in `dtype` (float formats: a cast). Quantized rows:
    code x scale in float32, then one rounding to `dtype`, so a bf16 reader sees the values a float32 reader sees,
    rounded (a bf16 product would round the float16 scale first)."""
    fmt = format_of(rows)
    if not fmt.quantized:
        return rows.to(dtype)
    d = rows.shape[-1] - SCALE_BYTES
    if fmt.name == "int8" and (kernel := _int8_op("int8_dequantize", rows, dtype)) is not None:  # one C++ pass
        flat = rows.reshape(-1, rows.shape[-1]).contiguous()
        return kernel(flat, dtype == torch.bfloat16).view(*rows.shape[:-1], d)
    codes = rows[..., :d]
    scale = rows[..., d:].view(torch.float16).float()  # rows start at even offsets: the bytes view as float16
    values = codes.float() if fmt.name == "int8" else codes.view(torch.float8_e4m3fn).float()
    return (values * scale).to(dtype)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the int8 ops' value dtypes


def _int8_op(name: str, t: torch.Tensor, dtype: torch.dtype) -> Callable | None:
    """The C++ int8 row op `name` for a CPU tensor `t` and output `dtype` (float32 or bf16), else None."""
    return kernels.op(name, t.device, torch.float32) if dtype in _KERNEL_DTYPES else None


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Writes x [T, Hkv, D] at `slots` [T] of one pool side `cache` [Hkv, slots, W], in the pool's format:
    one quantize of the batch and one index_copy_."""
    cache.index_copy_(1, slots, format_of(cache).quantize(x).transpose(0, 1))


def store_kv(pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             roundtrip: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Writes one layer's k and v [T, Hkv, D] at `slots` [T] of its pool [2, Hkv, slots, W], in the pool's format:
    float32 / bfloat16 / int8 pools in one C++ pass on CPU (kernels `store_kv`: the cast or quantize and both copies,
    the same bytes), else `store` per side. `roundtrip`: also returns k and v as a reader of the pool sees them
    (KVFormat.roundtrip; for int8 pools on CPU from the same pass: the same floats)."""
    fmt = format_of(pool)
    fused = pool.dtype in (torch.float32, torch.bfloat16, torch.int8)  # float16 pools: torch's cast (exact at overflow)
    kernel = kernels.op("store_kv", k.device, k.dtype) if fused else None
    if kernel is not None and v.dtype == k.dtype and k.stride(-1) == 1 and v.stride(-1) == 1:
        seen = kernel(pool[0], pool[1], slots, k, v, roundtrip and fmt.name == "int8")  # [] unless asked
        if seen:
            return seen[0], seen[1]
    else:
        store(pool[0], slots, k)
        store(pool[1], slots, v)
    return (fmt.roundtrip(k), fmt.roundtrip(v)) if roundtrip else None
