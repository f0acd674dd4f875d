"""Linear layers: `MergedLinear` fuses several checkpoint matrices into one float matmul (q|k|v, gate|up);
`QuantizedLinear` is the same (plain or merged) with quantized weights on a backend from the registry."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from glmserve.layers.param_loading import CheckpointTensor, Shard, copy_into
from glmserve.quant.backend import LinearBackend, select
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize_rows
from glmserve.quant.schemes import Scheme
from glmserve.quant.weight import QuantizedWeight, WeightWithFloatColumns, concat_rows, stackable

BF16_ACTIVATIONS_ENV = "GLMSERVE_BF16_ACTIVATIONS"  # "0": activations between linears stay float32


def copy_part(param: nn.Parameter, tensor: torch.Tensor, shard: Shard, output_sizes: list[int]) -> None:
    """Fills the rows of projection `shard.part` of a fused parameter (None: all of it) with `tensor`."""
    if shard.part is None:
        copy_into(param.data, tensor)
        return
    start = sum(output_sizes[:shard.part])
    copy_into(param.data[start:start + output_sizes[shard.part]], tensor)


class MergedLinear(nn.Linear):
    """One matmul for several projections of the same input; `load_parameter` fills one part (or all)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def load_parameter(self, param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> None:
        """Shard.part: which projection `tensor` is (None: all of them, already fused in the checkpoint)."""
        copy_part(param, tensor, shard, self.output_sizes)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.output_sizes, dim=-1)


_COVERED = object()  # a part loaded as rows of the previous part's (fused, quantized) checkpoint tensor


@dataclass
class _Segment:
    """Consecutive output rows computed by one matmul: on a quant backend, or in float (backend None). `columns` /
    `float_part` ([k], [out, k]): input columns kept in float beside the codes (zero there), whose product is added
    to the backend's on inputs with those columns zeroed (so that they do not set an activation block's scale)."""

    backend: LinearBackend | None
    prepared: Any  # the backend's layout; a float [rows, in] tensor when backend is None
    prepared_rows: int
    canonical: QuantizedWeight | None = None  # kept only where the backend cannot read its rows back
    columns: torch.Tensor | None = None
    float_part: torch.Tensor | None = None

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.backend is None:
            return self.prepared[ids].to(dtype)
        if self.canonical is not None:
            out = dequantize_rows(self.canonical, ids, dtype)
        else:
            out = self.backend.dequantize_rows(self.prepared, ids, dtype)
        if self.columns is not None:
            out[:, self.columns] = self.float_part[ids].to(dtype)
        return out

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.backend is None:
            return F.linear(x, self.prepared, bias)
        if self.columns is None:
            return self.backend.apply(self.prepared, x, bias)
        return self.with_float_columns(lambda z: self.backend.apply(self.prepared, z, bias))(x)

    def with_float_columns(self, matmul: Callable[[torch.Tensor], torch.Tensor]
                           ) -> Callable[[torch.Tensor], torch.Tensor]:
        """`matmul` (the codes' product) of [T, in] rows with the float columns' product added."""
        columns, float_part = self.columns, self.float_part

        def call(x: torch.Tensor) -> torch.Tensor:
            y = matmul(x.index_fill(-1, columns, 0))
            return y.add_(F.linear(x.index_select(-1, columns).to(float_part.dtype), float_part).to(y.dtype))
        return call


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W quantized; W is `output_sizes` parts stacked along the output rows (one part:
    a plain projection). Each part arrives as a float tensor, quantized on load per `scheme.weight`, or as a
    QuantizedWeight (GGUF blocks, checkpoint codes). `finalize` (after the last part) stacks the parts,
    picks a backend (glmserve/quant/backend.py `select`), repacks once and drops the canonical and float
    copies. Parts of different formats (a GGUF with mixed types) run as consecutive segments, one matmul
    each; a float part of a scheme-less module (no native kernel for its type) runs in float. Bias stays
    float, in the model dtype. `device` is where the weight runs; the bias is made on the default device
    (meta while a model is built, then moved by `to_empty`)."""

    def __init__(self, in_features: int, output_sizes: list[int], scheme: Scheme, bias: bool,
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.scheme = scheme
        self.device, self.dtype = torch.device(device), dtype
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype)) if bias else None
        self.tied = False  # the weight comes from a tied embedding (glmserve/layers/embedding.py), not a slot
        self._parts: list[Any] = [None] * len(self.output_sizes)  # CheckpointTensor, _COVERED or None
        self._segments: list[_Segment] = []

    @classmethod
    def like(cls, linear: nn.Linear, scheme: Scheme, device: torch.device) -> QuantizedLinear:
        """The quantized counterpart of an nn.Linear or MergedLinear (same shapes, parts, bias and dtype)."""
        sizes = getattr(linear, "output_sizes", [linear.out_features])
        return cls(linear.in_features, sizes, scheme, linear.bias is not None, device, linear.weight.dtype)

    # -- loading (glmserve/layers/param_loading.py HoldsWeights) ------------------------------------------
    def weight_slots(self) -> dict[str, int]:
        return {} if self.tied else {"weight": self.out_features * self.in_features}

    def load_weight(self, name: str, tensor: CheckpointTensor, shard: Shard) -> None:
        if name != "weight":
            raise ValueError(f"QuantizedLinear has no weight {name!r}")
        parts = range(len(self.output_sizes)) if shard.part is None else [shard.part]  # None: all, fused
        want = (sum(self.output_sizes[p] for p in parts), self.in_features)
        if tuple(tensor.shape) != want:
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model {want}")
        if any(self._parts[p] is not None for p in parts):
            raise ValueError(f"parts {list(parts)} of this weight are loaded twice")
        if isinstance(tensor, QuantizedWeight) or len(parts) == 1:
            self._parts[parts[0]] = tensor  # a fused quantized tensor stays whole: it is one segment
            for p in parts[1:]:
                self._parts[p] = _COVERED
        else:
            for p, piece in zip(parts, tensor.split([self.output_sizes[p] for p in parts])):
                self._parts[p] = piece

    def load_parameter(self, param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> None:
        """The bias (float), whole or one part."""
        copy_part(param, tensor, shard, self.output_sizes)

    def finalize(self) -> None:
        """Stacks the parts into segments and prepares each on its backend; idempotent."""
        if self._segments:
            return
        if any(p is None for p in self._parts):
            raise ValueError("QuantizedLinear finalized before all of its parts were loaded")
        runs: list[list[CheckpointTensor]] = []
        for part in self._parts:
            if part is _COVERED:
                continue
            if runs and _same_run(runs[-1][-1], part, self.scheme):
                runs[-1].append(part)
            else:
                runs.append([part])
        self._parts = [None] * len(self.output_sizes)
        self._segments = [self._prepare(run) for run in runs]

    def _prepare(self, run: list[CheckpointTensor]) -> _Segment:
        if not isinstance(run[0], QuantizedWeight):
            floats = torch.cat(run) if len(run) > 1 else run[0]
            if self.scheme.weight is None:
                return _Segment(None, floats.to(self.device, self.dtype), floats.shape[0])
            weight = quantize(floats, self.scheme.weight)
        else:
            weight = concat_rows(run) if len(run) > 1 else run[0]
        return self._prepare_quantized(weight)

    def _prepare_quantized(self, weight: QuantizedWeight) -> _Segment:
        backend = select(weight.spec, self.scheme.activations, self.device)
        weight = weight.to(self.device)
        prepared = backend.prepare(weight, self.scheme.activations, self.device)
        # a backend that cannot read rows back (`dequantize_rows`) costs the canonical copy: tied embeddings
        # and weight inspection (learned-indexer fingerprints) need the rows
        keep = None if hasattr(backend, "dequantize_rows") else weight
        inside = getattr(backend, "keeps_float_columns", None)  # a backend that adds the float columns' product itself
        if not isinstance(weight, WeightWithFloatColumns) or (inside is not None and inside(prepared)):
            return _Segment(backend, prepared, weight.shape[0], keep)
        return _Segment(backend, prepared, weight.shape[0], keep, weight.outliers.columns,
                        weight.outliers.weight.to(self.dtype).contiguous())

    # -- running --------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # a model's flat batch: as it is
        if len(self._segments) == 1:
            y = self._segments[0].apply(flat, self.bias)
        else:
            y = torch.cat([s.apply(flat, None) for s in self._segments], dim=-1)
            if self.bias is not None:
                y = y + self.bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.output_sizes, dim=-1)

    def small_batch(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """`forward` of float32 contiguous [T, in] rows as one bound call (several segments, e.g. a GGUF's q and k
        in one block type and v in another: their calls' outputs side by side, as forward concatenates them), bias
        added in place (the float32 add `apply` and forward make), and the row count from which `forward` takes
        another path; None where a float bias is not float32 or a segment's backend has no `small_batch`
        (quant/cpu_backend.py)."""
        bias = self.bias
        if bias is not None and bias.dtype != torch.float32:
            return None
        bound = self._segment_calls("small_batch")
        if bound is None:
            return None
        matmul, limit = _side_by_side(bound, min)
        return (matmul if bias is None else lambda x: matmul(x).add_(bias)), limit

    def small_batch_swiglu(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """For a gated MLP's merged gate-up projection: silu(gate) * up of `forward`'s output for float32 contiguous
        [T, in] rows as one bound call (the backend's `small_batch_swiglu`), and the row count from which it does not
        stand for forward + silu_and_mul; None where the weight is several segments, has a bias or the backend has
        no such call."""
        return self._bound_backend_call("small_batch_swiglu")

    def dense_batch_swiglu(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """For a gated MLP's merged gate-up projection: silu(gate) * up of `dense_batch`'s output as one bound call
        (the backend's `dense_batch_swiglu`) and the same row count; None where the weight is several segments, has
        a bias or the backend has no such call."""
        return self._bound_backend_call("dense_batch_swiglu")

    def dense_batch(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """`forward` of bf16 contiguous [T, in] rows as one bound call returning bf16 (the backend's bf16 GEMM,
        `dense_batch`; several segments side by side, from the rows where each takes its GEMM), and the row count
        from which `forward` takes that GEMM; None where the weight has a bias or a segment runs every batch on one
        path."""
        if self.bias is not None:
            return None
        bound = self._segment_calls("dense_batch")
        return None if bound is None else _side_by_side(bound, max)

    def _segment_calls(self, name: str) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] | None:
        """Each segment's backend `name(prepared)` (a bound call and its row limit), or None where one has none.
        Float columns join only the plain product (`small_batch`): SwiGLU and the bf16 GEMMs' rows stay whole."""
        bound = []
        for segment in self._segments:
            if segment.columns is not None and name != "small_batch":
                return None
            method = getattr(segment.backend, name, None)
            call = None if method is None else method(segment.prepared)
            if call is None:
                return None
            if segment.columns is not None:
                call = (segment.with_float_columns(call[0]), call[1])
            bound.append(call)
        return bound

    def _bound_backend_call(self, name: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """The backend's `name(prepared)` (a bound call and its row limit) of a single-segment weight without bias;
        None otherwise or where the backend has no such method (or gives none)."""
        if len(self._segments) != 1 or self.bias is not None:
            return None
        bound = self._segment_calls(name)
        return None if bound is None else bound[0]

    def takes_bf16(self, rows: int) -> bool:
        """True where every segment runs `rows` rows as a bf16 GEMM (its backend's `bf16_rows`, without bias):
        bf16 inputs then come back in bf16 with no float32 round trip."""
        return self.bias is None and all(
            s.backend is not None and s.columns is None and hasattr(s.backend, "bf16_rows")
            and s.backend.bf16_rows(s.prepared, rows) for s in self._segments)

    @property
    def weight(self) -> torch.Tensor:
        """W [out, in] in float, dequantized on demand (inspection: weight fingerprints, tests; not kept)."""
        if not self._segments:
            raise ValueError("QuantizedLinear has no weight before finalize")
        rows = [s.rows(torch.arange(s.prepared_rows, device=self.device), self.dtype) for s in self._segments]
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Rows `ids` of W (a tied embedding's lookup) where W is one segment; None otherwise."""
        if len(self._segments) != 1:
            return None
        return self._segments[0].rows(ids, dtype)

    def weight_bytes(self) -> int:
        """Bytes of the run-time weight (every tensor the prepared segments hold) plus the bias."""
        total = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        seen: set[int] = set()
        return total + sum(_tensor_bytes((s.prepared, s.canonical, s.columns, s.float_part), seen)
                           for s in self._segments)

    def extra_repr(self) -> str:
        formats = [type(s.backend).__name__ if s.backend else "float" for s in self._segments]
        return (f"in_features={self.in_features}, output_sizes={self.output_sizes}, scheme={self.scheme.name}, "
                f"bias={self.bias is not None}, backends={formats or 'not loaded'}")


def bf16_between(x: torch.Tensor, *linears: nn.Module) -> bool:
    """True where float32 activations `x` may enter `linears` in bf16 and stay bf16 between them (an MLP's
    gate-up and down on AMX prefill: two casts of the wide intermediate and the float32 SiLU saved): each is
    a QuantizedLinear that `takes_bf16` x's rows, and GLMSERVE_BF16_ACTIVATIONS is not "0"."""
    if x.dtype != torch.float32:
        return False
    rows = x.numel() // x.shape[-1]  # the environment read last: decode batches stop at takes_bf16's row count
    return (all(isinstance(linear, QuantizedLinear) and linear.takes_bf16(rows) for linear in linears)
            and os.environ.get(BF16_ACTIVATIONS_ENV) != "0")


def _side_by_side(bound: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]],
                  limit_of: Callable[[Iterable[int]], int]) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """Segments' bound calls as one: the only one, or their outputs concatenated along the features (forward's
    torch.cat); the row limit is `limit_of` theirs (min: from where any of them differs; max: where all take it)."""
    calls = [call for call, _ in bound]
    limit = limit_of(rows for _, rows in bound)
    if len(calls) == 1:
        return calls[0], limit
    return (lambda x: torch.cat([call(x) for call in calls], dim=-1)), limit


def small_batch_matmul(linear: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
    """y = linear(x) for float32 contiguous CPU rows x [T, in] as one bound call, and the row count from which it
    does not stand for the module's forward (which takes another path there): a QuantizedLinear's `small_batch`, or
    F.linear for a float32 nn.Linear / MergedLinear; None otherwise (the caller runs the module)."""
    if isinstance(linear, QuantizedLinear):
        return linear.small_batch()
    if type(linear) in (nn.Linear, MergedLinear) and linear.weight.dtype == torch.float32:
        weight, bias = linear.weight, linear.bias
        return (lambda x: F.linear(x, weight, bias)), sys.maxsize
    return None


def swiglu_matmul(linear: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
    """silu(gate) * up of a merged gate-up projection's output for float32 contiguous CPU rows x [T, in] as one bound
    call, and the row count from which it does not stand for the module's forward + silu_and_mul: a QuantizedLinear's
    `small_batch_swiglu`; None otherwise (the caller runs the projection, then silu_and_mul)."""
    return linear.small_batch_swiglu() if isinstance(linear, QuantizedLinear) else None


def dense_swiglu_matmul(linear: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
    """silu(gate) * up of a merged gate-up projection's output in bf16 for bf16 contiguous CPU rows x [T, in] as one
    bound call, from the row count where the module's forward runs a bf16 GEMM (returned too): a QuantizedLinear's
    `dense_batch_swiglu`; None otherwise (the caller runs the projection, then silu_and_mul)."""
    return linear.dense_batch_swiglu() if isinstance(linear, QuantizedLinear) else None


def dense_batch_matmul(linear: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
    """y = linear(x) in bf16 for bf16 contiguous CPU rows x [T, in] from the row count where the module's forward
    runs a bf16 GEMM (that count is returned too): a QuantizedLinear's `dense_batch`; None otherwise."""
    return linear.dense_batch() if isinstance(linear, QuantizedLinear) else None


def _same_run(prev: CheckpointTensor, part: CheckpointTensor, scheme: Scheme) -> bool:
    """Whether `part` stacks onto `prev` into one segment: both float, or both quantized and stackable."""
    if isinstance(prev, QuantizedWeight) != isinstance(part, QuantizedWeight):
        return False
    if not isinstance(part, QuantizedWeight):
        return True
    return stackable(prev, part)


def _tensor_bytes(obj: Any, seen: set[int]) -> int:
    """Bytes of the distinct tensors in a backend's prepared object (tensors, tuples, dataclasses...)."""
    if isinstance(obj, torch.Tensor) and obj.is_mkldnn:  # oneDNN's opaque layout (a prepacked weight): no storage
        return obj.numel() * obj.element_size()
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, QuantizedWeight):
        return sum(_tensor_bytes(t, seen) for t in (obj.codes, obj.scales, obj.zeros, obj.mins, obj.global_scale))
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o, seen) for o in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(o, seen) for o in vars(obj).values())
    return 0
