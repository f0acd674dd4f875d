"""Loads a checkpoint (Hugging Face directory with safetensors, or a GGUF file) into our model, float or
quantized (glmserve/quant/plan.py decides which modules run in which format)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, TextIO

import torch
from safetensors import safe_open

from glmserve.errors import UnsupportedModelError
from glmserve.layers.param_loading import CheckpointTensor
from glmserve.models.compressed_loader import compressed_weights
from glmserve.models.quantized import checkpoint_tensors, keep_head_in_half, quantize_modules
from glmserve.models.registry import model_class
from glmserve.quant.compressed_tensors import QUANT_METHOD, safetensors_keys
from glmserve.quant.plan import validate as validate_quantization
from glmserve.quant.schemes import Scheme
from glmserve.sparse.learned import FILE_SUFFIX as INDEXER_FILE_SUFFIX

if TYPE_CHECKING:  # types only: transformers' Auto classes are imported where a directory or --tokenizer needs them
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


@dataclass
class ModelAndTokenizer:
    """What `load_model` returns: the model with its config, tokenizer, stop ids and name."""

    model: torch.nn.Module
    hf_config: PretrainedConfig | SimpleNamespace  # a GGUF's values as a namespace (gguf_loader.model_config)
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: set[int]
    name: str
    max_position_embeddings: int


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: its index's, else every one but our own learned-indexer file
    (kept beside the model)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors") if not p.name.endswith(INDEXER_FILE_SUFFIX))
    if not files:
        raise UnsupportedModelError(f"no .safetensors files in {model_dir}")
    return [model_dir / file for file in files]


def safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _safetensors_count(model_dir: Path) -> int:
    """How many tensors `safetensors_weights(model_dir)` yields (read from the files' headers)."""
    return len(safetensors_keys(safetensors_files(model_dir)))


def with_progress(weights: Iterator[tuple[str, CheckpointTensor]], total: Callable[[], int] | None, name: str,
                  file: TextIO | None = None) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensor stream behind a progress bar (tensors read, converted and loaded, with the rate and
    what is left) on stderr, or `file`, where that is a terminal: a large model's load, or its quantization on load,
    takes minutes. Logs, pipes and tests get the stream as it is (no tqdm import, 37 ms of a launch, and no count).
    `total()`: the tensors the stream yields (None: unknown); called only for a bar (it may read the files' headers)."""
    shown = file or sys.stderr
    if shown is None or not shown.isatty():  # (sys.stderr is None under pythonw)
        yield from weights
        return
    from tqdm import tqdm

    yield from tqdm(weights, total=total() if total else None, desc=f"loading {name}", unit="tensor", leave=False,
                    file=shown)


def _as_set(ids: int | list[int] | None) -> set[int]:
    return set(ids) if isinstance(ids, list) else {ids} if ids is not None else set()


def _eos_ids(tokenizer: PreTrainedTokenizerBase, hf_config: PretrainedConfig | SimpleNamespace,
             model_dir: Path | None) -> set[int]:
    """End of generation: the tokenizer's eos, the config's (end-of-turn ids too), generation_config's."""
    ids = _as_set(tokenizer.eos_token_id) | _as_set(getattr(hf_config, "eos_token_id", None))
    if model_dir is not None and (model_dir / "generation_config.json").exists():
        from transformers import GenerationConfig

        ids |= _as_set(GenerationConfig.from_pretrained(str(model_dir)).eos_token_id)
    return ids


def _auto_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """transformers' AutoTokenizer of a directory or hub id (imported here: its module tree costs a second)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _return_freed_heap() -> None:
    """glibc keeps the load's freed temporaries (checkpoint codes, blocks unpacked and repacked, dequantized
    floats: each under its mmap threshold) in its heaps; malloc_trim hands them back. On the embedded model it
    takes the process from 599 to 486 MB after load (measured, bench/RESULTS.md). A no-op without glibc."""
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:
        trim(0)


def _build(hf_config: PretrainedConfig | SimpleNamespace, weights: Iterator[tuple[str, CheckpointTensor]],
           formats: dict[str, Scheme], device: torch.device, dtype: torch.dtype, quantization: str | None,
           quantize_embeddings: bool) -> torch.nn.Module:
    """The model on meta, its planned modules swapped for quantized ones (glmserve/models/quantized.py), then
    materialized on `device` and loaded."""
    cls = model_class(hf_config)
    max_positions = hf_config.max_position_embeddings
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(hf_config, max_positions)
            quantize_modules(model, quantization, formats, device, quantize_embeddings)
    finally:
        torch.set_default_dtype(previous)
    _materialize(model, device)
    model.rotary.to(device, dtype)
    model.load_weights(checkpoint_tensors(weights, quantization))
    keep_head_in_half(model, device, dtype)
    return model.eval()


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """`Module.to_empty` without its `torch.empty_like` of meta tensors: the first such call imports
    torch.fx.experimental.symbolic_shapes and sympy (1.0-1.7 s wall at load ~2, measured; 2.5 s of a launch's
    py-spy samples). `torch.empty` of the same shape and dtype is what `to_empty` gives (no values)."""
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's CPU ops on one thread, then the caller's count again. A load is many small memory-bound ops
    (unpacking, repacking, concatenating); on two threads each op's OpenMP barrier waits for a thread the OS has
    not scheduled when other processes share the cores: building the embedded model took 8.1-8.8 s (2.7 s of CPU)
    on one thread against 18-42 s (7-12 s of CPU) on two, at load average ~12 on 2 cores (bench/RESULTS.md). The
    server's warm-up generation runs under it too (engine/async_engine.py), for the same reason."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_model(path: str | None, tokenizer_path: str | None, device: torch.device, dtype: torch.dtype,
               quantization: str | None = None, quantize_embeddings: bool = False) -> ModelAndTokenizer:
    """path None loads the embedded default model (SmolLM2-135M-Instruct GGUF). quantization: None runs the
    checkpoint's own format (GGUF blocks natively), "none" float, a scheme name quantizes on load
    (glmserve/quant/plan.py); quantize_embeddings quantizes embeddings and lm_head too. The load runs on one
    thread (`one_thread`)."""
    with one_thread():
        return _load(path, tokenizer_path, device, dtype, quantization, quantize_embeddings)


def _load(path: str | None, tokenizer_path: str | None, device: torch.device, dtype: torch.dtype,
          quantization: str | None, quantize_embeddings: bool) -> ModelAndTokenizer:
    validate_quantization(quantization)
    if path is None:
        from glmserve.models.gguf_loader import embedded_default_gguf

        path = str(embedded_default_gguf())
    location = Path(path)
    if location.is_file() and location.suffix == ".gguf":
        from glmserve.models.gguf_loader import load_gguf

        ckpt = load_gguf(location)
        native = quantization is None
        hf_config, weights, model_dir = ckpt.model_config(), ckpt.tensors(native=native), None
        total = ckpt.tensor_count
        formats = ckpt.native_formats() if native else {}
        tokenizer = _auto_tokenizer(tokenizer_path) if tokenizer_path else ckpt.serving_tokenizer()
    elif location.is_dir() and (location / "config.json").exists():
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(location))
        model_class(hf_config)  # fail fast on an unsupported architecture, before reading weights
        qconfig = getattr(hf_config, "quantization_config", None)
        model_dir = location
        if qconfig:
            if qconfig.get("quant_method") != QUANT_METHOD:
                raise UnsupportedModelError(f"{location}: quant_method {qconfig.get('quant_method')!r} is not "
                                            f"read (only {QUANT_METHOD}); load a float checkpoint with "
                                            "--quantization SCHEME to quantize on load")
            weights, formats = compressed_weights(safetensors_files(location), qconfig, native=quantization is None)
            total = None  # a quantized module's several tensors come as one
        else:
            weights, formats = safetensors_weights(location), {}
            total = functools.partial(_safetensors_count, location)
        tokenizer = _auto_tokenizer(tokenizer_path or str(location))
    else:
        raise UnsupportedModelError(f"{location} is neither a .gguf file nor a model directory with config.json")
    name = location.stem if location.is_file() else location.name
    model = _build(hf_config, with_progress(weights, total, name), formats, device, dtype, quantization,
                   quantize_embeddings)
    _return_freed_heap()
    return ModelAndTokenizer(
        model=model,
        hf_config=hf_config,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(tokenizer, hf_config, model_dir),
        name=name,
        max_position_embeddings=hf_config.max_position_embeddings,
    )
