"""A token embedding whose rows stay quantized: a lookup dequantizes only the gathered rows, in one
batched op. Tied to a quantized lm_head it keeps no weight of its own where the head's backend can read
rows back from its layout (the reference backend does), so the one copy serves both."""

from __future__ import annotations

import torch
from torch import nn

from glmserve.layers.linear import QuantizedLinear
from glmserve.layers.param_loading import WHOLE, CheckpointTensor, Shard
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize_rows
from glmserve.quant.schemes import Scheme
from glmserve.quant.weight import QuantizedWeight


def unset_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """An nn.Embedding whose weight is left unset (torch.empty, on the default device): every model fills it
    from its checkpoint. nn.Embedding's own init draws normal_ values, which on the meta device goes through
    torch._refs and imports torch._dynamo: 1.8 s of CPU at each server start (bench/RESULTS.md)."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))


class QuantizedEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, scheme: Scheme, device: torch.device,
                 dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.scheme = scheme
        self.device, self.dtype = torch.device(device), dtype
        self._tied: list[QuantizedLinear] = []  # the tied lm_head (a list: not registered as a submodule)
        self._weight: QuantizedWeight | None = None

    @classmethod
    def like(cls, embedding: nn.Embedding, scheme: Scheme, device: torch.device) -> QuantizedEmbedding:
        return cls(embedding.num_embeddings, embedding.embedding_dim, scheme, device, embedding.weight.dtype)

    def tie(self, head: QuantizedLinear) -> None:
        """The checkpoint's embedding matrix is also `head`'s weight (tie_word_embeddings)."""
        if (head.out_features, head.in_features) != (self.num_embeddings, self.embedding_dim):
            raise ValueError("a tied lm_head must have the embedding's shape")
        self._tied, head.tied = [head], True

    @property
    def head(self) -> QuantizedLinear | None:
        return self._tied[0] if self._tied else None

    # -- loading (glmserve/layers/param_loading.py HoldsWeights) ------------------------------------------
    def weight_slots(self) -> dict[str, int]:
        return {"weight": self.num_embeddings * self.embedding_dim}

    def load_weight(self, name: str, tensor: CheckpointTensor, shard: Shard) -> None:
        if name != "weight" or shard != WHOLE:
            raise ValueError(f"QuantizedEmbedding takes its whole weight, not {name!r} {shard}")
        if tuple(tensor.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model "
                             f"{(self.num_embeddings, self.embedding_dim)}")
        if not isinstance(tensor, QuantizedWeight):
            if self.scheme.weight is None:
                raise ValueError("a float embedding matrix for a QuantizedEmbedding without a scheme")
            tensor = quantize(tensor, self.scheme.weight)
        self._weight = tensor
        if self.head is not None:
            self.head.load_weight("weight", tensor, WHOLE)

    def finalize(self) -> None:
        if self.head is not None:
            self.head.finalize()
            if self.head.dequantize_rows(torch.zeros(1, dtype=torch.long, device=self.device), self.dtype) is not None:
                self._weight = None  # rows come from the head's prepared weight: one copy
                return
        if self._weight is None:
            raise ValueError("QuantizedEmbedding finalized before its weight was loaded")
        self._weight = self._weight.to(self.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self._weight is None:
            rows = self.head.dequantize_rows(flat, self.dtype)
        else:
            rows = dequantize_rows(self._weight, flat, self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def weight_bytes(self) -> int:
        """Bytes of the weight this module keeps itself (0 where the tied head's serves the rows)."""
        return 0 if self._weight is None else self._weight.nbytes

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme.name}, "
                f"tied={self.head is not None}, own_copy={self._weight is not None}")
