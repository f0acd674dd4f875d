"""The backends a quantized linear layer runs on, and the registry that picks one.

A backend takes a QuantizedWeight (canonical form) once at load, repacks it into its own layout (`prepare`;
the canonical tensors are then dropped by the caller) and multiplies activations by it (`apply`). `reference`
(dequantize, then matmul) is the oracle every other backend is tested against. Selection: the highest
priority backend whose `supports` accepts the weight's spec, the activation spec and the device (each
backend checks the instruction set it needs itself); GLMSERVE_QUANT_BACKEND=<name> forces one (tests,
benchmarks).
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Protocol

import torch

from glmserve.errors import InvalidRequestError
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight

BACKEND_ENV = "GLMSERVE_QUANT_BACKEND"


class LinearBackend(Protocol):
    name: str

    def supports(self, weight: QuantSpec, activations: QuantSpec | None, device: torch.device) -> bool: ...

    def prepare(self, weight: QuantizedWeight, activations: QuantSpec | None, device: torch.device) -> Any:
        """The weight in this backend's layout (an opaque object of tensors), made once at load."""

    def apply(self, prepared: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [tokens, in_features] float -> [tokens, out_features] in x's dtype."""

    # Optional: `dequantize_rows(prepared, ids [n], dtype) -> [n, in_features]`, rows of the weight from the
    # backend's own layout. A tied embedding then looks its rows up in the lm_head's prepared weight and no
    # second copy is kept (glmserve/layers/embedding.py); a backend without it costs the canonical copy.


_REGISTRY: list[tuple[int, LinearBackend]] = []
# modules that register a backend when imported; one that does not exist (yet) is skipped
BUILTIN_BACKENDS = ("glmserve.quant.reference", "glmserve.quant.cpu_backend", "glmserve.quant.cpu_float_backend",
                    "glmserve.quant.cuda_backend")


def load_builtin_backends() -> None:
    for module in BUILTIN_BACKENDS:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise


def register(backend: LinearBackend, priority: int) -> None:
    """Higher priority wins among the backends that support a weight; `reference` has priority 0."""
    _REGISTRY.append((priority, backend))
    _REGISTRY.sort(key=lambda entry: -entry[0])


def backend_names() -> list[str]:
    load_builtin_backends()
    return [b.name for _, b in _REGISTRY]


def select(weight: QuantSpec, activations: QuantSpec | None, device: torch.device) -> LinearBackend:
    load_builtin_backends()
    forced = os.environ.get(BACKEND_ENV)
    for _, backend in _REGISTRY:
        if forced and backend.name != forced:
            continue
        if backend.supports(weight, activations, device):
            return backend
    if forced:
        raise InvalidRequestError(f"{BACKEND_ENV}={forced}: no such backend for {weight} on {device} "
                                  f"(registered: {', '.join(backend_names())})")
    raise InvalidRequestError(f"no backend runs {weight} (activations {activations}) on {device}")
