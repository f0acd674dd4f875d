"""Which scheme each quantizable module of a model runs in, from `EngineConfig.quantization`.

  None       the checkpoint's own format: modules whose checkpoint weights are stored quantized (GGUF
             Q8_0/Q4_0/Q4_1 blocks, a compressed-tensors `quantization_config`) run from those codes; the rest
             stays float
  "none"     everything float (a quantized checkpoint is dequantized: the float path)
  a scheme   quantize on load (glmserve/quant/schemes.py): every linear layer; embeddings and lm_head only
             with `quantize_embeddings` (they stay high precision by default, as norms always do)

A tied lm_head follows the embedding: both quantized (one copy) or neither. The model side (which modules
exist, what the checkpoint stores for each) is glmserve/models/quantized.py; this module only decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from glmserve.errors import InvalidRequestError
from glmserve.quant.schemes import Scheme, scheme

Role = Literal["linear", "embedding", "lm_head"]
CHECKPOINT = "checkpoint"  # the Scheme name of a module run in its checkpoint's format


def validate(quantization: str | None) -> None:
    """Fails on an unknown scheme name before anything is loaded."""
    if quantization is not None:
        scheme(quantization)


def dequantizes_checkpoint(quantization: str | None) -> bool:
    """Whether quantized checkpoint tensors are turned into float on load (then float or requantized)."""
    return quantization is not None


def plan(targets: Mapping[str, Role], quantization: str | None, stored: Mapping[str, list[Scheme]],
         tied: bool, quantize_embeddings: bool = False) -> dict[str, Scheme]:
    """{module name: scheme} for the modules that become quantized; others stay float.

    targets: every quantizable module with its role. stored: per module, the formats its checkpoint weights
    are stored in (one per stored tensor; empty or absent: float), used when `quantization` is None."""
    validate(quantization)
    embeddings = [n for n, r in targets.items() if r == "embedding"]
    heads = [n for n, r in targets.items() if r == "lm_head"]
    if quantization is None:
        chosen = {name: _stored_scheme(name, stored[name]) for name in targets if stored.get(name)}
    elif scheme(quantization).weight is None:
        return {}
    else:
        chosen_scheme = scheme(quantization)
        chosen = {name: chosen_scheme for name, role in targets.items() if role == "linear" or quantize_embeddings}
        for name in embeddings if quantize_embeddings else ():
            _check_embedding_scheme(name, chosen_scheme)
    if tied:
        for embedding, head in zip(embeddings, heads):
            if embedding in chosen:
                chosen[head] = chosen[embedding]
            else:
                chosen.pop(head, None)
    return chosen


def _stored_scheme(name: str, formats: list[Scheme]) -> Scheme:
    """One module run from its stored parts: their weight formats may differ (each runs as its own segment),
    their activation quantization may not."""
    activations = {f.activations for f in formats}
    if len(activations) > 1:
        raise InvalidRequestError(f"{name}: its checkpoint parts quantize activations differently: {activations}")
    return Scheme(CHECKPOINT, None, activations.pop())


def _check_embedding_scheme(name: str, chosen: Scheme) -> None:
    if chosen.weight is not None and chosen.weight.strategy in ("tensor", "block"):
        raise InvalidRequestError(f"scheme {chosen.name!r} quantizes per {chosen.weight.strategy}, which an "
                                  f"embedding ({name}) cannot gather rows from; quantize it per channel or group")
