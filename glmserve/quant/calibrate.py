"""Calibration: per-layer input statistics from a float model run on calibration text, and GPTQ.

`collect_stats` hooks every named nn.Linear of a float model and accumulates, per layer, the input Gram matrix
H = sum_tokens x x^T (GPTQ's Hessian up to a factor 2), the per-input-channel absmax (outlier detection) and mean
|x| (AWQ's salience).
Layers fed the very same input tensor object in a forward pass (q/k/v, gate/up) share one accumulator. The statistics
come from the float model in one pass (not GPTQ's sequential re-run through already-quantized layers).

`gptq` follows Frantar et al. 2022 (arXiv 2210.17323), Algorithm 1 and the authors' reference implementation
(gptq.py, `fasterquant`): dampen H by `damp` times its mean diagonal, take the upper Cholesky factor of H^-1,
quantize columns in blocks of 128, spreading each column's error over the not-yet-quantized columns. By default in
act order with static groups (the reference's --act-order with static_groups=True): SmolLM2's inputs have a few
channels whose activations are 100x the rest, and quantizing those columns last leaves no columns to absorb their
error. Without act order, group scales (and zero points) are set from the error-updated weights when a group's
first column is reached. Asymmetric weights with a float minimum per group (spec.float_min) run the loop with
the float zero point -m / s and keep their float16 minimums. Either way the result is an ordinary group-wise
QuantizedWeight that every backend runs.
FP8 E4M3 weights (per channel, group or 128x128 block) go through the same loop, each column rounded onto the E4M3
grid under fixed scales; a block's scale (set from the weights before any update) serves each of its rows, and the
block columns are the groups (the last one shorter where 128 does not divide the inputs). NVFP4 likewise: its fp32
global scale and E4M3 scales per 16 inputs are set by round to nearest first, then each column is rounded onto the
E2M1 grid under them (llm-compressor's GPTQModifier runs NVFP4 the same way: scales from the observer, GPTQ's
column loop on the fixed grid).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from glmserve.quant.quantize import FP8_MAX, quantize
from glmserve.quant.reference import E2M1_VALUES
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight


@dataclass
class InputStats:
    """One layer input's statistics: Gram matrix [in, in] (float64), channel absmax and sum of |x| [in], token
    count; `cross` (sequential.py's asymmetric target): sum X~^T X of these inputs X~ with the float model's inputs
    X of the same layer [in, in], float64, else None."""

    gram: torch.Tensor
    absmax: torch.Tensor
    abssum: torch.Tensor
    tokens: int = 0
    cross: torch.Tensor | None = None

    @classmethod
    def empty(cls, n: int, cross: bool = False) -> InputStats:
        return cls(torch.zeros(n, n, dtype=torch.float64), torch.zeros(n), torch.zeros(n, dtype=torch.float64),
                   cross=torch.zeros(n, n, dtype=torch.float64) if cross else None)

    def add(self, x: torch.Tensor, x_float: torch.Tensor | None = None) -> None:
        """Accumulate the inputs x [..., in]; `x_float` [tokens, in]: the float model's inputs of the same tokens
        (needed when the statistics hold `cross`)."""
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        if (self.cross is None) != (x_float is None):
            raise ValueError("the float inputs go with statistics that hold a cross Gram, and only with them")
        self.gram.addmm_(x.T, x)
        if self.cross is not None:
            self.cross.addmm_(x.T, x_float.reshape(x.shape).to(torch.float64))
        self.absmax = torch.maximum(self.absmax, x.abs().amax(dim=0).to(self.absmax.dtype))
        self.abssum += x.abs().sum(dim=0)
        self.tokens += x.shape[0]

    @property
    def absmean(self) -> torch.Tensor:
        """Mean |x| per input channel (AWQ's activation salience)."""
        return self.abssum / max(self.tokens, 1)

    @property
    def hessian(self) -> torch.Tensor:
        return self.gram / max(self.tokens, 1)

    def divided(self, s: torch.Tensor) -> InputStats:
        """The statistics of the inputs x / s (s [in] > 0: an input-channel scale folded into the producer; the
        float model's inputs of `cross` in the same coordinates)."""
        s64 = s.to(torch.float64)
        outer = s64[:, None] * s64[None, :]
        return InputStats(self.gram / outer, self.absmax / s.to(self.absmax.dtype), self.abssum / s64, self.tokens,
                          None if self.cross is None else self.cross / outer)


def linear_layers(model: torch.nn.Module, names: Iterable[str] | None = None) -> dict[str, torch.nn.Linear]:
    wanted = None if names is None else set(names)
    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and (wanted is None or n in wanted)}


@torch.no_grad()
def collect_stats(model: torch.nn.Module, batches: Iterable[torch.Tensor], names: Iterable[str],
                  progress=None) -> dict[str, InputStats]:
    """Run `model(input_ids)` on each batch [1, tokens] and return the input statistics of the layers `names`."""
    layers = linear_layers(model, names)
    stats: dict[str, InputStats] = {}
    # id of an input tensor in the current forward -> (the tensor, its accumulator); holding the tensor keeps
    # its id from being reused by a later one within the pass
    seen: dict[int, tuple[torch.Tensor, InputStats]] = {}

    def hook(name: str):
        def pre(module: torch.nn.Module, args: tuple) -> None:
            x = args[0]
            hit = seen.get(id(x))
            if hit is not None and hit[0] is x:
                stats.setdefault(name, hit[1])
                return
            if name not in stats:
                stats[name] = InputStats.empty(x.shape[-1])
            stats[name].add(x)
            seen[id(x)] = (x, stats[name])
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    try:
        for ids in batches:
            seen.clear()
            model(ids)
            if progress is not None:
                progress.update(1)
    finally:
        for h in handles:
            h.remove()
    return stats


def _codes_for(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """Codes (integers, or E4M3 values) of the columns `w` [out, k] under one scale (and zero point) per row, as
    quantize() rounds."""
    if spec.type == "float" and spec.num_bits == 4:  # the nearest E2M1 value, signed
        scaled = w / scale
        grid = torch.tensor(E2M1_VALUES[:8], dtype=w.dtype)
        return grid[(scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)] * torch.where(scaled < 0, -1.0, 1.0)
    if spec.type == "float":
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(w.dtype)
    if zero is None:
        qmax = 2 ** (spec.num_bits - 1) - 1
        return torch.round(w / scale).clamp(-qmax - 1, qmax)
    return torch.round(w / scale + zero).clamp(0, 2 ** spec.num_bits - 1)


def _value(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    return (codes if zero is None else codes - zero) * scale


def _is_nvfp4(spec: QuantSpec) -> bool:
    return spec.type == "float" and spec.num_bits == 4 and spec.strategy == "tensor_group"


def gptq_supports(spec: QuantSpec) -> bool:
    """Integer group/channel weights, FP8 E4M3 per channel, group or block and NVFP4 (their codes rounded onto the
    E4M3 / E2M1 grid under fixed scales, as llm-compressor's GPTQ runs any quantization args through one
    fake-quantize)."""
    if _is_nvfp4(spec):
        return True
    fp8 = spec.type == "float" and spec.num_bits == 8 and spec.symmetric
    strategies = ("group", "channel", "block") if fp8 else ("group", "channel")
    return (spec.type == "int" or fp8) and spec.strategy in strategies and spec.gguf_type is None


@torch.no_grad()
def gptq(w: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, damp: float = 0.01, block: int = 128,
         act_order: bool = True, initial: QuantizedWeight | None = None) -> QuantizedWeight:
    """GPTQ-quantize `w` [out, in] (int, group or channel strategy) given its input Hessian [in, in].

    act_order: quantize columns in order of decreasing Hessian diagonal (the reference's --act-order), so the
    inputs with the largest activations are rounded first while the most columns remain to absorb their error;
    groups stay contiguous with scales set from the weights before any update (the reference's static_groups,
    llm-compressor's actorder "static"), so the output is an ordinary group-wise weight.
    initial: a quantization of `w` under `spec` whose scales (and zero points) stay fixed, e.g. from the scale
    search (scale_search.py; GPTQ's reference likewise sets its grid by an MSE search before the column loop);
    default: round to nearest's."""
    if not gptq_supports(spec):
        raise ValueError(f"GPTQ quantizes integer or FP8 group/channel weights, not {spec}")
    if initial is not None and (initial.spec != spec or tuple(initial.codes.shape) != tuple(w.shape)):
        raise ValueError(f"the initial weight ({initial.spec}, {tuple(initial.codes.shape)}) is not a "
                         f"{tuple(w.shape)} weight under {spec}")
    out_f, in_f = w.shape
    nvfp4 = _is_nvfp4(spec)
    W = w.detach().to(torch.float64).clone()
    H = hessian.to(torch.float64).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    # the canonical dtypes for this spec, and the scales fixed before any update (block, NVFP4, act order, initial)
    rtn = initial if initial is not None else quantize(W.float(), spec)
    block_scales = rtn.scales if spec.strategy == "block" or nvfp4 else None
    group = {"group": spec.group_size, "tensor_group": spec.group_size,
             "block": spec.block_structure[1] if spec.block_structure else None}.get(spec.strategy, in_f)
    if in_f % group and block_scales is None:
        raise ValueError(f"in_features {in_f} is not a multiple of the group size {group}")
    group_spec = QuantSpec(spec.num_bits, spec.type, spec.symmetric, "channel", zero_point=spec.zero_point)
    # scales set before any update (else per group from the error-updated weights as the loop reaches it)
    fixed = act_order or initial is not None or block_scales is not None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
    else:
        perm = torch.arange(in_f)
    W, H = W[:, perm], H[perm][:, perm]
    H += torch.eye(in_f, dtype=H.dtype) * damp * torch.diag(H).mean()
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    codes = torch.empty(out_f, in_f)
    scales = torch.empty(out_f, -(-in_f // group))
    # asymmetric: the zero point z per group; a float minimum m runs as the float zero point z = -m / s, and the
    # minimums themselves are kept for the result (`mins`)
    zeros = None if spec.symmetric else torch.empty(out_f, in_f // group, dtype=torch.float64)
    mins = torch.empty(out_f, in_f // group, dtype=torch.float16) if spec.float_min else None
    if nvfp4:
        scales[:] = block_scales.float() / rtn.global_scale
    elif block_scales is not None:
        scales[:] = block_scales.float().repeat_interleave(spec.block_structure[0], dim=0)[:out_f]
    elif fixed:  # each group's scales from the weights before any update (the reference's static groups)
        scales[:] = rtn.scales.float().reshape(out_f, -1)
        if mins is not None:
            mins[:] = rtn.mins.reshape(out_f, -1)
            zeros[:] = -rtn.mins.double().reshape(out_f, -1) / rtn.scales.double().reshape(out_f, -1)
        elif zeros is not None:
            zeros[:] = rtn.zeros.double().reshape(out_f, -1)
    scale = zero = None
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        W1, Hinv1 = W[:, b0:b1].clone(), Hinv[b0:b1, b0:b1]
        err1 = torch.zeros_like(W1)
        for i in range(b1 - b0):
            col = b0 + i
            if fixed:
                g = int(perm[col]) // group
                scale = scales[:, g:g + 1].double()
                zero = None if zeros is None else zeros[:, g:g + 1].double()
            elif col % group == 0:  # this group's scale from the error-updated weights (later blocks included)
                cols = torch.cat([W1[:, i:], W[:, b1:]], dim=1)[:, :group]
                q = quantize(cols.float(), group_spec)
                scale = q.scales.to(torch.float64)
                zero = None if q.zeros is None else q.zeros.to(torch.float64)
                if q.mins is not None:
                    zero = -q.mins.to(torch.float64) / scale
                    mins[:, col // group] = q.mins.squeeze(1)
                scales[:, col // group] = q.scales.squeeze(1)
                if zeros is not None:
                    zeros[:, col // group] = zero.squeeze(1)
            c = _codes_for(W1[:, i:i + 1], scale, zero, spec)
            codes[:, int(perm[col])] = c.squeeze(1).float()
            err = (W1[:, i:i + 1] - _value(c, scale, zero)) / Hinv1[i, i]
            W1[:, i:] -= err @ Hinv1[i:i + 1, i:]
            err1[:, i:i + 1] = err
        W[:, b1:] -= err1 @ Hinv[b0:b1, b1:]
    if nvfp4:  # signed E2M1 values -> codes (magnitude index, + 8 for a negative)
        grid = torch.tensor(E2M1_VALUES[:8])
        magnitude = (codes.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)
        return QuantizedWeight(spec, (magnitude + 8 * (codes < 0)).to(rtn.codes.dtype), block_scales,
                               global_scale=rtn.global_scale)
    if block_scales is not None:
        scales = block_scales
    if mins is not None:
        return QuantizedWeight(spec, codes.to(rtn.codes.dtype), scales.to(rtn.scales.dtype), mins=mins)
    return QuantizedWeight(spec, codes.to(rtn.codes.dtype), scales.to(rtn.scales.dtype),
                           zeros=None if zeros is None else zeros.to(rtn.zeros.dtype))
