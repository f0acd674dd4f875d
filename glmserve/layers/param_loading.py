"""How a layer's parameters are filled from checkpoint tensors, one tensor at a time.

A checkpoint tensor may be one piece of a parameter of ours (`Shard`: a part of a fused matrix such as
q of qkv_proj, of one expert of a 3D expert tensor). A module that owns such parameters, or stores them
in its own layout, implements `LoadsParameters`; any other parameter is filled by `load_whole`. A module
whose weight is no parameter at all (quantized codes and scales in a backend's layout) implements
`HoldsWeights`: it names the weights it takes like parameters, takes float tensors or QuantizedWeights
for them and, once every one is in, builds its run-time form (`finalize`). glmserve/models/weights.py
decides which tensor goes where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from glmserve.quant.weight import QuantizedWeight

CheckpointTensor = torch.Tensor | QuantizedWeight


@dataclass(frozen=True)
class Shard:
    """The piece of a parameter one checkpoint tensor fills: part `part` of a fused matrix (None: all of
    it), of expert `expert` (None: a parameter that is not per expert)."""

    part: int | None = None
    expert: int | None = None


WHOLE = Shard()


@runtime_checkable
class LoadsParameters(Protocol):
    """A module that places checkpoint tensors into its parameters itself; each call fills as many
    elements of `param` as `tensor` has (the loader counts them to find parameters left unfilled)."""

    def load_parameter(self, param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> None: ...


@runtime_checkable
class HoldsWeights(Protocol):
    """A module whose weights are not nn.Parameters. `weight_slots` names them (relative to the module, e.g.
    "weight") with the number of elements each takes; `load_weight` takes one checkpoint tensor (or a part
    of one, per `shard`) for a slot; `finalize` runs once after the loader has filled every slot;
    `weight_bytes` is the memory the finalized weights take."""

    def weight_slots(self) -> dict[str, int]: ...

    def load_weight(self, name: str, tensor: CheckpointTensor, shard: Shard) -> None: ...

    def finalize(self) -> None: ...

    def weight_bytes(self) -> int: ...


def numel(tensor: CheckpointTensor) -> int:
    """Elements a checkpoint tensor fills (a QuantizedWeight: its logical [out, in])."""
    if isinstance(tensor, QuantizedWeight):
        out, inp = tensor.shape
        return out * inp
    return tensor.numel()


def copy_into(dst: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copies `tensor` into `dst` (a parameter's data or a view of it); shapes must be equal."""
    if dst.shape != tensor.shape:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
    dst.copy_(tensor)


def load_whole(param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> None:
    """The loader of a parameter whose module has none of its own: the tensor is all of it."""
    if shard != WHOLE:
        raise ValueError(f"{shard} of a parameter that is not fused")
    copy_into(param.data, tensor)
