"""Linear layers that fuse several checkpoint matrices into one matmul (q|k|v, gate|up)."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One matmul for several projections of the same input; `load_shard` fills one part."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def load_shard(self, param: nn.Parameter, shard: int, tensor: torch.Tensor) -> None:
        start = sum(self.output_sizes[:shard])
        param.data[start:start + self.output_sizes[shard]].copy_(tensor)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.output_sizes, dim=-1)
