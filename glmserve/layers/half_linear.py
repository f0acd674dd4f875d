"""A quantized model's high-precision lm_head as 16-bit floats on CPU, and the embedding tied to it.

Recipes keep the lm_head (and the embedding it is tied to) in high precision, which on CPU, where the engine
computes in float32, meant a float32 matrix read whole at every decode step: SmolLM2's 49,152 x 576 head is 113 MB,
7.7 of a 17.5 ms batch-1 step of a seeds'-recipe folder (bench/RESULTS.md). Where every value of that float32 weight
is a bf16 number (a bf16 checkpoint, `glmserve quantize --dtype bfloat16`), or else an fp16 one, `HalfLinear` keeps
it as those 16-bit numbers, packed as the float kernel's tiles (16 output rows interleaved, inputs padded to 16:
glmserve/kernels/csrc/float_quant_matmul.cpp `half_linear`), and multiplies float32 activations by them widened
exactly: the products F.linear forms on the float32 weight, summed in another order. Nothing is rounded; a weight
that is neither stays float32 (models/quantized.py `keep_head_in_half` decides).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from glmserve.layers.param_loading import CheckpointTensor, Shard
from glmserve.quant.cpu_float_backend import PAD, ROWS, tiled
from glmserve.quant.schemes import Scheme

HALF_DTYPES = (torch.bfloat16, torch.float16)  # tried in this order
CHECK_ROWS = 4096  # rows compared per step of exact_half_dtype (bounds its temporary copies)


def exact_half_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The first of HALF_DTYPES that holds every value of `weight` exactly, or None."""
    for dtype in HALF_DTYPES:
        if all(torch.equal(rows.to(dtype).to(rows.dtype), rows) for rows in weight.detach().split(CHECK_ROWS)):
            return dtype
    return None


class HalfLinear(nn.Module):
    """y = x W^T (no bias) with W kept as 16-bit floats in the kernel's tiles; float32 in and out. The tiles are no
    parameter (as QuantizedLinear's layouts): `weight_bytes` reports them; `dequantize_rows` reads rows back (the tied
    embedding's lookup)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, matmul: Callable[..., torch.Tensor]):
        super().__init__()
        if dtype not in HALF_DTYPES:
            raise ValueError(f"HalfLinear keeps bf16 or fp16 weights, not {dtype}")
        self.out_features, self.in_features = weight.shape
        kp, tiles = -(-self.in_features // PAD) * PAD, -(-self.out_features // ROWS)
        self.codes = tiled(weight.detach(), tiles, kp, dtype)  # [tiles, kp, 16]
        self.scheme = Scheme(str(dtype).removeprefix("torch."), None)  # named in the startup log's formats
        self._matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.float32)
        out = self._matmul(flat, self.codes, self.codes.dtype == torch.bfloat16, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [n] of W as `dtype` [n, in]."""
        return self.codes[ids // ROWS, :, ids % ROWS][:, :self.in_features].to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """W [out, in] in float32, widened on demand (inspection, as QuantizedLinear.weight; not kept)."""
        return self.dequantize_rows(torch.arange(self.out_features), torch.float32)

    # -- glmserve/layers/param_loading.py HoldsWeights: made from a loaded weight, nothing left to fill -------------
    def weight_slots(self) -> dict[str, int]:
        return {}

    def load_weight(self, name: str, tensor: CheckpointTensor, shard: Shard) -> None:
        raise ValueError("a HalfLinear is made from a loaded weight and takes no checkpoint tensor")

    def finalize(self) -> None:
        pass

    def weight_bytes(self) -> int:
        return self.codes.numel() * self.codes.element_size()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.scheme.name}"


class TiedHalfEmbedding(nn.Module):
    """The token embedding tied to a HalfLinear head: its rows are read from the head's tiles (one copy of the
    matrix), widened to float32."""

    def __init__(self, head: HalfLinear):
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self._head = [head]  # a list: not registered as a submodule (the model holds it as lm_head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._head[0].dequantize_rows(ids.reshape(-1), torch.float32)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied to lm_head ({self._head[0].scheme.name})"
