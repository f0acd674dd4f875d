"""The one dispatcher: a caller asks for an op by name for its tensors' device and dtype and gets the C++
op of the active instruction-set variant, or None to take its PyTorch path.

Ops (all CPU, float32 queries/scores; signatures of csrc/*.cpp):
  paged_decode(q [B,H,D], k_cache [Hkv,S,W], v_cache, slots [B,L] i64, ctx_lens [B] i64, scale) -> out [B,H,D]
               (cache f32/bf16/f16 with W = D, or int8 / fp8-bits uint8 rows with W = D + 2: glmserve/kv/kv_format.py)
  paged_decode_lse(same arguments) -> [out [B,H,D], lse [B,H]]: also each head's log-sum-exp of scores
  store_kv(k_cache [Hkv,S,W], v_cache, slots [T] i64, k [T,Hkv,D], v, roundtrip=False) (in place): one layer's KV
               write into float32 / bf16 caches (k/v float32 or bf16 rows, any row stride), rounded as torch's cast
               rounds, or int8 ones (W = D + 2), quantized as kv_format.py's KVFormat.quantize; `roundtrip` (int8
               caches) -> [k, v [T,Hkv,D]] as their readers see them (int8_roundtrip's floats), else []
  int8_dequantize(rows [N,D+2] i8, out_bf16) -> [N,D] f32 or bf16: stored int8 KV rows as code x scale
  int8_roundtrip(x [N,D] f32 or bf16, out_bf16) -> [N,D] f32 or bf16: x as int8 KV stores and dequantizes it
  bounds_update(slots [T] i64, keys [T,Hkv,D] f32 or bf16, bounds [blocks,2,Hkv,D], block_size) (in place)
  block_scores(q [B,H,D], bounds [blocks,2,Hkv,D], tables [B,W] i64, num_units [B] i64, scale) -> [B,W]
  learned_scores(qi [B,Hi,d], w [B,Hi] (times the scale), keys [slots,d] f32 or bf16, tables [B,W] i64,
                 block_size, length, ctx [B] i64, distance_bias [NB], sink_bias [S]) -> [B,length]
  select_slots(scores [B,U], unit_size, ctx [B], top_k [B], threshold [B], sink [B], local [B],
               kv_slots [B,L], pins [B,P] i64 (pinned units, -1 = none)) -> [slots [B,W], lengths [B]]
  quantize_activations(x [T,in], per_token) -> [q [T,in32] i8, d [T,in32/32], s [T,in32/32], sum [T,in32/32] i32]:
                 int8 codes per block of 32 inputs (in32: in rounded up to 32) or per row (per_token)
  quant_matmul(q, d, s, sum, codes [tiles,blocks,bytes] u8, scales [tiles,blocks,16] f16, mins (same, or
               empty), u4, out_features) -> [T,out]: quantized activations x weights packed by quant/cpu_backend.py
  quant_linear(x [T,in], per_token, codes, scales, mins, u4, out_features) -> [T,out]: both of the above
  quant_linear_swiglu(same arguments; out_features = 2I, I a multiple of 16) -> [T,I]: silu(gate) * up of a merged
               gate-up weight's quant_linear, as silu_and_mul computes it, without the [T,2I] product in memory
  float_quant_linear(x [T,in], fp8_tokens, codes [tiles,kp or kp/2,16] u8, scales [tiles,groups,16] (f32, or
               E4M3 bytes for fp4), fp4, group, factor, post, out_features, columns [n] i64 (or empty), float_part
               [tiles,n,16] f32) -> [T,out]: FP8 / NVFP4 weights packed by quant/cpu_float_backend.py, dequantized in
               the kernel, plus the product of input columns kept in float (zeroed in the rows the codes multiply)
  fp8_fake_quantize_rows(x [T,in]) -> [T,in]: E4M3 per-token fake quantization (float_quant_linear's fp8_tokens)
  half_linear(x [T,in], codes [tiles,kp,16] 16-bit, bf16, out_features) -> [T,out]: a bf16 or fp16 weight packed by
               layers/half_linear.py, widened exactly to float32 in the kernel
  set_amx(enable) -> bool: whether quant_matmul / quant_linear run batches of 6+ rows (int8 weights; 10+ for
               int4) on the AMX int8 tiles
               (default: yes where the CPU and the avx512 build have them, unless GLMSERVE_CPU_AMX=0); returns
               whether they now do
  amx_bf16_linear(x [T,in] bf16 or f32, codes, scales, mins, u4, out_features) -> [T,out] bf16: x times the
               packed weight on the AMX bf16 tiles, dequantized panel by panel in the kernel (float32 sums); the
               avx512 build on CPUs with AMX-BF16 only (kernels.amx_bf16()), an error elsewhere
  amx_bf16_linear_swiglu(same arguments; out_features = 2I, I a multiple of 16) -> [T,I] bf16: silu(gate) * up of
               a merged gate-up weight's amx_bf16_linear, as silu_and_mul computes it on that bf16 product, in the
               GEMM's store (no [T,2I] product in memory)
  avx512_bf16_linear(x [T,in] bf16 or f32, codes, scales, mins, u4, out_features) -> [T,out] bf16: amx_bf16_linear's
               contract on AVX512-BF16 (vdpbf16ps; csrc/bf16_gemm.cpp), for CPUs without AMX; the avx512 build on
               CPUs with AVX512-BF16 only (kernels.avx512_bf16()), an error elsewhere
  avx512_bf16_available() -> bool: whether this variant and CPU run avx512_bf16_linear
  dequantize_packed(codes, scales, mins, u4, out_features, bf16, out) -> [out_features, in32] bf16 or f32:
               the packed weight as a dense matrix, written into the flat buffer `out`
  add_rms_norm(x [T,H] f32 (in place), delta [T,H] f32/bf16 or empty, weight [H] f32, eps, bf16_out) -> [T,H]:
               the residual add and the following RMSNorm in one pass (bf16 or f32 out)
  rope_neox_(x [T,heads,D] f32 or bf16, cos [T,R], sin [T,R] f32) (in place): neox rope with layers/rotary.py's
               tables, in float32 (bf16 x: rounded once)
  silu_and_mul(x [T,2I] f32 or bf16) -> [T,I]: SwiGLU's silu(gate) * up, rounded once (also for bf16 tensors)
  rope_store_kv(qkv [T,(H+2Hkv)D] f32, H, cos [T,R], sin [T,R] f32, k_cache, v_cache [Hkv,slots,W] f32 or bf16
               (W = D) or int8 (W = D + 2), slots [T] i64) -> (q [T,H,D], k [T,Hkv,D]) f32: a decode step's rope of
               q and k and KV write in one pass, k as the cache holds it
  prefill_attention(q [T,Hq,D] bf16, k [B,L,Hk,D] bf16, v (same), q_lens [B] i64, kv_lens [B] i64, scale,
               out_bf16, engine="") -> [T,Hq,D] bf16 or f32: causal attention of rows of q_lens queries packed in q,
               each at the end of its kv_lens keys, on the AMX bf16 tiles or with AVX512-BF16 (bf16 tensors only)
  prefill_attention_available() -> bool: whether this variant and CPU run prefill_attention (avx512 with AMX or
               AVX512-BF16)
  prefill_attention_engines() -> [str]: the engines they run it on, best first ("amx", "avx512_fma",
               "avx512_bf16"; float32 FMAs before vdpbf16ps on Intel CPUs)
  prefill_attention_f32(q [T,Hq,D] f32, k [B,L,Hk,D] f32 or bf16, v (same), q_lens [B] i64, kv_lens [B] i64,
               scale) -> [T,Hq,D] f32: the causal attention of prefill_attention's rows in float32 (FMAs, online
               softmax); the avx2 build only (CPUs without AVX-512)
  prefill_attention_f32_available() -> bool: whether this variant runs prefill_attention_f32
  first_max(x [S,V] f32, contiguous rows) -> [S] i64: each row's index of its maximum, the first of equal maxima
               (a NaN first): torch.max(x, -1).indices in one vectorized pass per row (sampling's greedy pick)
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import torch

from glmserve.kernels.build import load
from glmserve.kernels.isa import active_isa

OPS: dict[str, str] = {  # op -> the source (extension) that defines it
    "paged_decode": "paged_decode",
    "paged_decode_lse": "paged_decode",
    "store_kv": "paged_decode",
    "int8_dequantize": "paged_decode",
    "int8_roundtrip": "paged_decode",
    "bounds_update": "sparse",
    "block_scores": "sparse",
    "learned_scores": "sparse",
    "select_slots": "sparse",
    "quantize_activations": "quant_matmul",
    "quant_matmul": "quant_matmul",
    "quant_linear": "quant_matmul",
    "quant_linear_swiglu": "quant_matmul",
    "float_quant_linear": "float_quant_matmul",
    "fp8_fake_quantize_rows": "float_quant_matmul",
    "half_linear": "float_quant_matmul",
    "dequantize_packed": "quant_matmul",
    "amx_bf16_linear": "quant_matmul",
    "amx_bf16_linear_swiglu": "quant_matmul",
    "set_amx": "quant_matmul",
    "avx512_bf16_linear": "bf16_gemm",
    "avx512_bf16_available": "bf16_gemm",
    "add_rms_norm": "prefill_ops",
    "rope_neox_": "prefill_ops",
    "silu_and_mul": "prefill_ops",
    "rope_store_kv": "prefill_ops",
    "prefill_attention": "prefill_attention",
    "prefill_attention_available": "prefill_attention",
    "prefill_attention_engines": "prefill_attention",
    "prefill_attention_f32": "prefill_attention_f32",
    "prefill_attention_f32_available": "prefill_attention_f32",
    "first_max": "sampling",
}
DTYPES = (torch.float32,)  # every op's query / score dtype, unless OP_DTYPES says otherwise
OP_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "store_kv": (torch.float32, torch.bfloat16),
    "bounds_update": (torch.float32, torch.bfloat16),
    "rope_neox_": (torch.float32, torch.bfloat16),
    "silu_and_mul": (torch.float32, torch.bfloat16),
    "prefill_attention": (torch.bfloat16,),
    "prefill_attention_available": (torch.bfloat16,),
    "prefill_attention_engines": (torch.bfloat16,),
}


def torch_only() -> bool:
    """GLMSERVE_TORCH_ONLY=1: no C++ kernel is used (every caller takes its PyTorch path)."""
    return os.environ.get("GLMSERVE_TORCH_ONLY") == "1"


def dtypes(name: str) -> tuple[torch.dtype, ...]:
    """The query / tensor dtypes op `name` is dispatched for (its first: the one its tests ask with)."""
    return OP_DTYPES.get(name, DTYPES)


def op(name: str, device: torch.device, dtype: torch.dtype) -> Callable | None:
    """The C++ op `name` (one of OPS) for tensors of `dtype` on `device`, from the active instruction-set
    variant; None where the caller takes its PyTorch path: another device or dtype, GLMSERVE_TORCH_ONLY=1,
    or a kernel that could not be built. Inside `pinned()` each answer is looked up once."""
    answers = getattr(_pins, "answers", None)
    if answers is None:
        return _lookup(name, device, dtype)
    key = (name, device.type, dtype)
    if key not in answers:
        answers[key] = _lookup(name, device, dtype)
    return answers[key]


def _lookup(name: str, device: torch.device, dtype: torch.dtype) -> Callable | None:
    source = OPS[name]
    if device.type != "cpu" or dtype not in dtypes(name) or torch_only():
        return None
    module = load(source, active_isa())
    return None if module is None else getattr(module, name)


_pins = threading.local()  # .answers: this thread's pinned op() answers, while inside pinned()


@contextlib.contextmanager
def pinned() -> Iterator[None]:
    """Within (in this thread): `op` answers each (name, device type, dtype) once, as the environment
    (GLMSERVE_CPU_ISA, GLMSERVE_TORCH_ONLY) was at that first lookup, and reuses it. A decode step asks ~200 times
    (each layer's norms, rope, KV write, attention, linears), ~2 us each for the two environment reads; a model
    step runs inside one (engine/runner.py). Nested: the outermost one's answers hold."""
    if getattr(_pins, "answers", None) is not None:
        yield
        return
    _pins.answers = {}
    try:
        yield
    finally:
        _pins.answers = None
