"""Linear layers that fuse several checkpoint matrices into one matmul (q|k|v, gate|up)."""

from __future__ import annotations

import torch
from torch import nn

from glmserve.layers.param_loading import Shard, copy_into


class MergedLinear(nn.Linear):
    """One matmul for several projections of the same input; `load_parameter` fills one part (or all)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def load_parameter(self, param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> None:
        """Shard.part: which projection `tensor` is (None: all of them, already fused in the checkpoint)."""
        if shard.part is None:
            copy_into(param.data, tensor)
            return
        start = sum(self.output_sizes[:shard.part])
        copy_into(param.data[start:start + self.output_sizes[shard.part]], tensor)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.output_sizes, dim=-1)
