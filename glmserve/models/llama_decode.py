"""The decode step of Llama-family layers as a straight line of C++ calls (CPU, float32 residual stream).

At batch 1 a small model's decode layer spends more time in Python than in arithmetic outside its linears: each of
its ~12 small ops crosses an nn.Module call, a kernel lookup, shape and dtype checks and a few views (SmolLM2-135M:
"model rest" 3.6 ms of a 11-14 ms step on Zen 4, the same at 1 and 2 threads; bench/RESULTS.md). `DecodeLayer`
resolves a layer's calls once (each linear's bound kernel call, layers/linear.py `small_batch_matmul`; the norm
weights; the KV pool's halves), and `run_decode` runs a step's layers through them with the inputs every
layer shares made once (the rope tables at the step's positions, the slot mapping, the decode group's slots and
lengths). Sparse scorers attached to a layer (glmserve/sparse: the default engine keeps block bounds) see every key
written, as layers/attention.py hands them over.

The calls and their inputs are those of the module path (models/llama.py: the same kernels on the same tensors), so
the result is the same bit for bit; differences of form only: a layer's MLP output is added into the residual stream
by the next layer's fused add + norm (add_rms_norm's add is the float32 add `x.add_` makes), rope of q and k and the
KV write are one call (kernels `rope_store_kv`: the math of rope_neox_ and store_kv, and the keys read back as
kv_format's `roundtrip` gives them), which reads the step's [T, R] rope tables made once.

Batches from the rows where the linears' forwards take the bf16 GEMM (AMX CPUs: 40, quant/cpu_backend.py
DENSE_MIN_ROWS) run the module path's bf16 flow as a straight line too (`DecodeLayer._dense`): each norm rounds its
output to bf16 for the GEMM after it, q/k/v come back widened to float32 for rope, the KV write and attention, whose
output is rounded to bf16 for o_proj, and the MLP stays bf16 (gate-up, SwiGLU, down) until its output is added.

A step or model that does not qualify runs the module path: prefill rows, sparse or offloaded decode rows, a KV pool
that is not float32 or bf16, per-head q/k norms (Qwen3), interleaved rope, a residual stream that is not float32 and
contiguous on CPU, a linear without a bound call, a batch between the rows where one linear takes the bf16 GEMM and
those where all do (or bf16 GEMM rows with GLMSERVE_BF16_ACTIVATIONS=0), a kernel that is not available, or
GLMSERVE_FUSED_DECODE=0.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from glmserve import kernels
from glmserve.layers.attention import AttentionMetadata, PagedAttention
from glmserve.layers.linear import (
    BF16_ACTIVATIONS_ENV,
    dense_batch_matmul,
    dense_swiglu_matmul,
    small_batch_matmul,
    swiglu_matmul,
)

if TYPE_CHECKING:
    from glmserve.models.llama import DecoderOnlyLM, LlamaDecoderLayer

FUSED_DECODE_ENV = "GLMSERVE_FUSED_DECODE"  # "0": decode steps run the module path
_NO_DELTA = torch.empty(0)
Matmul = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DecodeKernels:
    """The C++ ops of a decode layer (kernels/dispatch.py), looked up once per step; `silu_and_mul_bf16` (the bf16
    GEMM rows' SwiGLU) may be missing: those rows then run the module path."""

    add_rms_norm: Callable
    rope_store_kv: Callable
    paged_decode: Callable
    silu_and_mul: Callable
    silu_and_mul_bf16: Callable | None

    @classmethod
    def resolve(cls) -> DecodeKernels | None:
        cpu = torch.device("cpu")
        found = {f.name: kernels.op(f.name, cpu, torch.float32) for f in fields(cls) if f.name != "silu_and_mul_bf16"}
        if any(k is None for k in found.values()):
            return None
        return cls(**found, silu_and_mul_bf16=kernels.op("silu_and_mul", cpu, torch.bfloat16))


@dataclass(frozen=True)
class DecodeStep:
    """What every layer of one decode-only step reads: kernels, rope tables [T, R] at the positions, the KV write's
    slots [T] and the decode group's key slots [T, L] and lengths [T]; `dense_ok`: bf16 GEMM rows may run here
    (the bf16 SwiGLU kernel is there, and GLMSERVE_BF16_ACTIVATIONS is not "0": their module path's activations are
    then bf16 between the linears)."""

    kernels: DecodeKernels
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    kv_slots: torch.Tensor
    context_lens: torch.Tensor
    dense_ok: bool


def decode_step(model: DecoderOnlyLM, x: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None) -> DecodeStep | None:
    """The step's shared inputs where the step qualifies (decode rows only, dense and resident; float32 contiguous
    CPU rows; neox rope in float32; the kernels available; GLMSERVE_FUSED_DECODE is not "0"), else None. `meta` None:
    a forward without paged attention (the learned indexer's teacher runs, glmserve/training)."""
    if meta is None:
        return None
    g, rope = meta.decode, model.rotary
    if (meta.prefill is not None or g is None or g.sparse is not None or g.offloaded is not None
            or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or rope.interleaved
            or rope.cos_table.dtype != torch.float32 or os.environ.get(FUSED_DECODE_ENV) == "0"):
        return None
    found = DecodeKernels.resolve()
    if found is None:
        return None
    return DecodeStep(found, rope.cos_table[positions], rope.sin_table[positions], meta.slot_mapping, g.kv_slots,
                      g.context_lens,
                      found.silu_and_mul_bf16 is not None and os.environ.get(BF16_ACTIVATIONS_ENV) != "0")


class DecodeLayer:
    """One LlamaDecoderLayer's decode calls, resolved once (`of`)."""

    def __init__(self, layer: LlamaDecoderLayer, matmuls: list[tuple[Matmul, int]], gated: tuple[Matmul, int] | None,
                 dense: list[tuple[Matmul, int] | None], dense_gated: tuple[Matmul, int] | None):
        attn = layer.self_attn
        self.attn: PagedAttention = attn.attn
        self.heads = attn.num_heads
        self.norm_in, self.norm_post = layer.input_layernorm, layer.post_attention_layernorm
        (self.qkv, _), (self.o_proj, _), (self.gate_up, _), (self.down, _) = matmuls
        # gate-up and SwiGLU in one call where the backend has it (layers/linear.py swiglu_matmul), as the module path
        self.gated = gated[0] if gated is not None else None
        limits = [limit for _, limit in matmuls] + ([gated[1]] if gated is not None else [])
        self.max_rows = min(limits)  # batches from here: a linear's forward differs
        # qkv, o, gate-up, down as their bf16 GEMMs, and the rows from which every forward takes its GEMM
        self.dense = None if None in dense else tuple(matmul for matmul, _ in dense)
        self.dense_rows = sys.maxsize if self.dense is None else max(rows for _, rows in dense)
        # gate-up and SwiGLU as one bf16 GEMM where the backend has it (layers/linear.py dense_swiglu_matmul); it
        # starts where gate-up's GEMM does, at or before dense_rows
        self.dense_gated = dense_gated[0] if dense_gated is not None else None
        self._pool: torch.Tensor | None = None
        self._halves: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, layer: torch.nn.Module) -> DecodeLayer | None:
        """The layer's decode calls, or None where it has another structure (not a LlamaDecoderLayer, q/k norms)
        or a linear without a bound call."""
        from glmserve.models.llama import LlamaDecoderLayer

        if type(layer) is not LlamaDecoderLayer or layer.self_attn.q_norm is not None:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.float32 for w in norms):
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        matmuls = [small_batch_matmul(m) for m in linears]
        if any(m is None for m in matmuls):
            return None
        return cls(layer, matmuls, swiglu_matmul(mlp.gate_up_proj), [dense_batch_matmul(m) for m in linears],
                   dense_swiglu_matmul(mlp.gate_up_proj))

    def ready(self, rows: int, dense_ok: bool) -> bool:
        """Whether this step's `rows` rows run here: a float32, bf16 or int8 pool (its halves kept while it stays
        bound), and fewer rows than where a linear takes another path or, where bf16 GEMM rows may run (`dense_ok`),
        enough for every linear's bf16 GEMM."""
        pool = self.attn.kv_cache
        if pool is None or pool.dtype not in (torch.float32, torch.bfloat16, torch.int8):
            return False
        if rows >= self.max_rows and not (dense_ok and rows >= self.dense_rows):
            return False
        if pool is not self._pool:
            self._pool, self._halves = pool, (pool[0], pool[1])
        return True

    def __call__(self, x: torch.Tensor, delta: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x: the residual stream [T, hidden] (float32), += delta (the previous layer's MLP output, float32 or bf16,
        or empty) in place; returns this layer's MLP output (not yet added)."""
        if x.shape[0] >= self.max_rows:
            return self._dense(x, delta, step)
        k = step.kernels
        h = k.add_rms_norm(x, delta, self.norm_in.weight, self.norm_in.eps, False)
        h = k.add_rms_norm(x, self.o_proj(self._attend(self.qkv(h), step)), self.norm_post.weight, self.norm_post.eps,
                           False)
        return self.down(self.gated(h) if self.gated is not None else k.silu_and_mul(self.gate_up(h)))

    def _dense(self, x: torch.Tensor, delta: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """`__call__` where every linear runs its bf16 GEMM, as the module path's bf16 flow (models/llama.py
        `_gemm_dtype`); returns the MLP's output in bf16."""
        k, (qkv, o_proj, gate_up, down) = step.kernels, self.dense
        h = k.add_rms_norm(x, delta, self.norm_in.weight, self.norm_in.eps, True)
        out = self._attend(qkv(h).to(torch.float32), step).to(torch.bfloat16)
        h = k.add_rms_norm(x, o_proj(out), self.norm_post.weight, self.norm_post.eps, True)
        return down(self.dense_gated(h) if self.dense_gated is not None else k.silu_and_mul_bf16(gate_up(h)))

    def _attend(self, qkv: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """Rope, the KV write and decode attention of the float32 qkv projection [T, (H + 2 Hkv) D] -> [T, H D]."""
        k, t = step.kernels, qkv.shape[0]
        k_cache, v_cache = self._halves
        q, key = k.rope_store_kv(qkv, self.heads, step.cos, step.sin, k_cache, v_cache, step.slot_mapping)
        for indexer in self.attn.indexers.values():  # the keys as the pool holds them, as PagedAttention shows them
            indexer.on_kv_written(step.slot_mapping, key, self._pool)
        return k.paged_decode(q, k_cache, v_cache, step.kv_slots, step.context_lens, self.attn.scale).view(t, -1)


def decode_layers(model: DecoderOnlyLM) -> list[DecodeLayer] | None:
    """The model's layers' decode calls, resolved at the first decode step and kept (None: some layer has none)."""
    if not hasattr(model, "_decode_layers"):
        layers = [DecodeLayer.of(layer) for layer in model.layers]
        model._decode_layers = None if any(layer is None for layer in layers) else layers
    return model._decode_layers


def run_decode(model: DecoderOnlyLM, x: torch.Tensor, step: DecodeStep) -> bool:
    """Runs the model's layers on x [T, hidden] in place through their decode calls; False (x untouched) where some
    layer does not take this step (the caller runs the module path)."""
    layers = decode_layers(model)
    rows = x.shape[0]
    if layers is None or not all(layer.ready(rows, step.dense_ok) for layer in layers):
        return False
    delta = _NO_DELTA
    for layer in layers:
        delta = layer(x, delta, step)
    x.add_(delta)
    return True

