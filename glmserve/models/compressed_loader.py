"""A compressed-tensors checkpoint (what `glmserve quantize` and llm-compressor write) as the loader's tensor
stream: each quantized linear layer's tensors (glmserve/quant/compressed_tensors.py decodes them) arrive as
one QuantizedWeight under `<module>.weight` (a WeightWithFloatColumns where the module keeps float outlier
columns), with its stored format (weights and input activations, W8A8's dynamic int8 tokens) for the plan
(glmserve/quant/plan.py); or as its float weight when the checkpoint is dequantized (`--quantization none` or a
scheme). Float tensors pass through."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from glmserve.errors import UnsupportedModelError
from glmserve.layers.param_loading import CheckpointTensor
from glmserve.quant.compressed_tensors import (
    QUANT_METHOD,
    QuantizedModule,
    dense_weight,
    quantized_modules,
    read_safetensors,
    safetensors_keys,
    stream_modules,
)
from glmserve.quant.schemes import Scheme
from glmserve.quant.weight import WeightWithFloatColumns


def compressed_weights(files: list[Path], qconfig: Mapping, native: bool
                       ) -> tuple[Iterator[tuple[str, CheckpointTensor]], dict[str, Scheme]]:
    """(the tensor stream, {checkpoint weight name: stored format}) of the safetensors `files` under
    `qconfig`; native: quantized modules stay QuantizedWeights, else they are dequantized (formats empty).
    What the engine cannot run fails here, before any tensor is read."""
    keys = safetensors_keys(files)
    specs = quantized_modules(qconfig, keys)
    _check_runnable(qconfig, specs)
    formats = {f"{name}.weight": Scheme(QUANT_METHOD, w, a) for name, (w, a) in specs.items()} if native else {}
    return _tensors(qconfig, keys, files, native), formats


def _check_runnable(qconfig: Mapping, specs: Mapping) -> None:
    if qconfig.get("quantization_status", "compressed") != "compressed":
        raise UnsupportedModelError(f"quantization_status {qconfig['quantization_status']!r}: only compressed "
                                    "checkpoints are read")
    if qconfig.get("kv_cache_scheme"):
        raise UnsupportedModelError("a quantized KV cache scheme (kv_cache_scheme) is not read from checkpoints")
    for name, group in qconfig.get("config_groups", {}).items():
        if group.get("output_activations"):
            raise UnsupportedModelError(f"quantization_config group {name!r}: output activation quantization "
                                        "is not supported")
    for module, (_, activations) in specs.items():
        if activations is not None and not activations.dynamic:
            raise UnsupportedModelError(f"{module}: static input activation scales are not supported (only "
                                        "dynamic ones, e.g. W8A8 per token)")
    if not specs:
        raise UnsupportedModelError("the quantization_config targets no quantized tensor of the checkpoint")


def _tensors(qconfig: Mapping, keys: list[str], files: list[Path], native: bool
             ) -> Iterator[tuple[str, CheckpointTensor]]:
    for name, item in stream_modules(qconfig, keys, read_safetensors(files)):
        if not isinstance(item, QuantizedModule):
            yield name, item
        elif native:  # float outlier columns ride with the codes (layers/linear.py adds their product)
            yield f"{name}.weight", (item.weight if item.outliers is None
                                     else WeightWithFloatColumns.of(item.weight, item.outliers))
        else:
            yield f"{name}.weight", dense_weight(item, torch.float32)
