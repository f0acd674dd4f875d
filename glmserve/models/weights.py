"""Copies checkpoint tensors (Hugging Face names) into a model, filling fused layers by part."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from glmserve.layers.linear import MergedLinear

# checkpoint part name -> (fused module name, shard index)
DEFAULT_FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    fused_parts: dict[str, tuple[str, int]] = DEFAULT_FUSED_PARTS,
    ignore: tuple[str, ...] = ("rotary_emb.inv_freq",),
) -> None:
    """Loads every parameter exactly once; missing or unexpected names are an error."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    tied = getattr(model, "tie_word_embeddings", False)
    for name, tensor in weights:
        if any(s in name for s in ignore) or (tied and name == "lm_head.weight"):
            continue
        module_path, _, param_kind = name.rpartition(".")
        owner_path, _, part = module_path.rpartition(".")
        if part in fused_parts and f"{owner_path}.{fused_parts[part][0]}" in modules:
            fused_path = f"{owner_path}.{fused_parts[part][0]}"
            module = modules[fused_path]
            assert isinstance(module, MergedLinear)
            target = f"{fused_path}.{param_kind}"
            module.load_shard(params[target], fused_parts[part][1], tensor)
            loaded.add(f"{target}#{fused_parts[part][1]}")
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if params[name].shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
        params[name].data.copy_(tensor)
        loaded.add(name)
    missing = [n for n in params if n not in loaded and not _fused_complete(n, loaded, modules)]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


def _fused_complete(param_name: str, loaded: set[str], modules: dict[str, nn.Module]) -> bool:
    module = modules.get(param_name.rpartition(".")[0])
    if not isinstance(module, MergedLinear):
        return False
    return all(f"{param_name}#{i}" in loaded for i in range(len(module.output_sizes)))
