"""RMSNorm computed in float32 (as the reference does), returned in the input dtype; `add_norm` fuses the residual
add before it into one pass on CPU (kernels `add_rms_norm`)."""

from __future__ import annotations

import torch
from torch import nn

from glmserve import kernels

_NO_DELTA = torch.empty(0)


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

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """x += delta in place (the residual stream; delta may be narrower, e.g. a bf16 projection output), then
        this norm of x in `out_dtype`: one C++ pass for float32 [T, H] CPU tensors (bf16 out rounds the float32
        result once), PyTorch ops otherwise."""
        kernel = kernels.op("add_rms_norm", x.device, x.dtype)
        fused = (kernel is not None and x.dim() == 2 and x.is_contiguous() and self.weight.dtype == torch.float32
                 and out_dtype in (torch.float32, torch.bfloat16)
                 and (delta is None or (delta.shape == x.shape and delta.is_contiguous()
                                        and delta.dtype in (torch.float32, torch.bfloat16))))
        if fused:
            return kernel(x, _NO_DELTA if delta is None else delta, self.weight, self.eps, out_dtype == torch.bfloat16)
        if delta is not None:
            x.add_(delta)
        return self(x).to(out_dtype)
