"""RMSNorm computed in float32 (as the reference does), returned in the input dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * y.to(x.dtype)
