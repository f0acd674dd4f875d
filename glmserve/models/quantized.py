"""Puts quantized layers into a model built on the meta device, before its weights load: the model files
keep plain nn.Linear / MergedLinear / nn.Embedding, and the modules the plan (glmserve/quant/plan.py) picks
are swapped for QuantizedLinear / QuantizedEmbedding. What a model keeps float regardless (a weight its
forward reads directly, as MLA's kv_b_proj; MoE expert tensors, which are no Linear modules) it names in
`unquantized_modules`. Once loaded, a quantized model's float lm_head may be kept as 16-bit floats on CPU
(`keep_head_in_half`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from glmserve import kernels
from glmserve.kernels.isa import active_isa
from glmserve.layers.embedding import QuantizedEmbedding
from glmserve.layers.half_linear import HalfLinear, TiedHalfEmbedding, exact_half_dtype
from glmserve.layers.linear import MergedLinear, QuantizedLinear
from glmserve.layers.param_loading import CheckpointTensor, HoldsWeights
from glmserve.quant.plan import Role, dequantizes_checkpoint, plan
from glmserve.quant.reference import dequantize
from glmserve.quant.schemes import Scheme
from glmserve.quant.weight import QuantizedWeight


def quant_targets(model: nn.Module) -> dict[str, Role]:
    """Every module a scheme may apply to, with its role."""
    skip = set(getattr(model, "unquantized_modules", ()))
    targets: dict[str, Role] = {}
    for name, module in model.named_modules():
        if skip & set(name.split(".")):
            continue
        if name == "lm_head":
            targets[name] = "lm_head"
        elif name == "embed_tokens" and type(module) is nn.Embedding:
            targets[name] = "embedding"
        elif type(module) in (nn.Linear, MergedLinear):
            targets[name] = "linear"
    return targets


def stored_formats(model: nn.Module, formats: Mapping[str, Scheme]) -> dict[str, list[Scheme]]:
    """Checkpoint formats by checkpoint weight name -> by our module (parts of a fused module together)."""
    params = dict(model.named_parameters())
    by_module: dict[str, list[Scheme]] = defaultdict(list)
    for name, fmt in formats.items():
        target, _ = model.checkpoint_layout.place(name.removeprefix("model."), params)
        by_module[target.rpartition(".")[0]].append(fmt)
    return dict(by_module)


def quantize_modules(model: nn.Module, quantization: str | None, formats: Mapping[str, Scheme],
                     device: torch.device, quantize_embeddings: bool = False) -> dict[str, Scheme]:
    """Swaps the planned modules of `model` (still on meta) for quantized ones running on `device`; returns
    the plan."""
    chosen = plan(quant_targets(model), quantization, stored_formats(model, formats),
                  tied=model._ties_word_embeddings(), quantize_embeddings=quantize_embeddings)
    for name, scheme in chosen.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        old = getattr(owner, attr)
        new = (QuantizedEmbedding.like(old, scheme, device) if isinstance(old, nn.Embedding)
               else QuantizedLinear.like(old, scheme, device))
        setattr(owner, attr, new)
    return chosen


def keep_head_in_half(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """A loaded quantized model's float lm_head (and the embedding tied to it) kept as bf16 or fp16 numbers where
    every value of the float32 weight is one (layers/half_linear.py): half the bytes a CPU decode step reads, the
    same products. Only on CPU in float32, where some module is quantized (`--quantization none` and float
    checkpoints keep F.linear) and a SIMD build of the kernel runs (the scalar one reads the bytes faster at batch 1
    but multiplies slower than MKL's sgemm from 8 rows: bench/bench_half_head.py)."""
    head = getattr(model, "lm_head", None)
    if (device.type != "cpu" or dtype != torch.float32 or type(head) is not nn.Linear or head.bias is not None
            or active_isa() == "scalar" or not any(isinstance(m, QuantizedLinear) for m in model.modules())):
        return
    matmul = kernels.op("half_linear", device, torch.float32)
    half = None if matmul is None else exact_half_dtype(head.weight)
    if half is None:
        return
    model.lm_head = HalfLinear(head.weight, half, matmul)
    if model._ties_word_embeddings():
        model.embed_tokens = TiedHalfEmbedding(model.lm_head)


def checkpoint_tensors(weights: Iterable[tuple[str, CheckpointTensor]], quantization: str | None
                       ) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors as the plan needs them: quantized ones dequantized unless the checkpoint's
    own format runs."""
    for name, tensor in weights:
        if isinstance(tensor, QuantizedWeight) and dequantizes_checkpoint(quantization):
            tensor = dequantize(tensor)
        yield name, tensor


def weight_bytes(model: nn.Module) -> int:
    """Bytes the loaded model's weights take: its distinct parameter storages (a tied float head counts once)
    plus what quantized modules hold (their backends' layouts)."""
    storages: dict[int, int] = {}
    for t in model.parameters():
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values()) + sum(m.weight_bytes() for m in model.modules() if isinstance(m, HoldsWeights))
