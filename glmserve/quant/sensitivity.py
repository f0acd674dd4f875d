"""Mixed precision by measured layer sensitivity (the seeds' layer-wise sensitivity-aware quantization).

`measure`: for each unit (a set of linear layers quantized together: q/k/v, gate/up, which serving engines fuse
and so must share a format) and each candidate scheme, the calibration loss increase when that unit alone is
fake-quantized (its weights replaced by dequantize(quantize(w)), then restored).
`fisher_deltas`: the same quantity estimated to second order from one gradient pass instead of one loss evaluation
per unit and candidate: loss increase ~ 1/2 sum_i F_ii dw_i^2 with F the diagonal empirical Fisher (squared
gradients of the calibration loss, accumulated per window), the sensitivity HAWQ-V2 (Dong et al. 2020, arXiv
1911.03852) and SqueezeLLM (Kim et al. 2023, arXiv 2306.07629) use. It sees every calibration token at the cost
of ~3 forward passes, where `measure` pays a forward pass per unit and candidate.
`allocate`: per-unit schemes minimizing the summed loss increase under a bits-per-weight budget, greedily:
start every unit at its cheapest candidate and repeatedly take the upgrade with the largest loss decrease per
added bit that still fits (the classic multiple-choice knapsack greedy over the convex hull of each unit's
(bits, loss) points).
`bits_per_weight`: storage bits of a format with 16-bit scales (and zero points of the code's width), as a
serving layout keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import contextmanager

import torch

from glmserve.errors import InvalidRequestError
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize
from glmserve.quant.spec import QuantSpec

SCALE_BITS = 16
KINDS = ("measured", "fisher")  # how a unit's loss increase is found: `measure` or `fisher_deltas`
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def bits_per_weight(spec: QuantSpec | None, in_features: int, out_features: int = 1) -> float:
    """None is a float layer at 16 bits (bf16)."""
    if spec is None:
        return 16.0
    if spec.strategy == "tensor_group":  # NVFP4: an E4M3 scale per group plus one fp32 global
        return spec.num_bits + 8 / spec.group_size + 32 / (in_features * out_features)
    per_scale = {"channel": in_features, "group": spec.group_size or in_features,
                 "tensor": in_features * out_features}.get(spec.strategy)
    if spec.strategy == "block":
        per_scale = spec.block_structure[0] * spec.block_structure[1]
    extra = SCALE_BITS + (0 if spec.symmetric else SCALE_BITS if spec.float_min else spec.num_bits)
    return spec.num_bits + extra / per_scale


def units(linear_names: Sequence[str]) -> list[tuple[str, ...]]:
    """Group layer names into the units that get one format: q/k/v of one attention, gate/up of one MLP."""
    present, out, done = set(linear_names), [], set()
    for name in linear_names:
        if name in done:
            continue
        prefix, _, leaf = name.rpartition(".")
        unit = (name,)
        for fused in FUSED:
            if leaf in fused:
                unit = tuple(n for n in (f"{prefix}.{f}" if prefix else f for f in fused) if n in present)
        done.update(unit)
        out.append(unit)
    return out


@contextmanager
def fake_quantized(layers: Mapping[str, torch.nn.Linear], names: Sequence[str], spec: QuantSpec):
    saved = {n: layers[n].weight.data for n in names}
    try:
        for n in names:
            w = saved[n]
            layers[n].weight.data = dequantize(quantize(w, spec), w.dtype)
        yield
    finally:
        for n in names:
            layers[n].weight.data = saved[n]


@torch.no_grad()
def measure(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module], float], unit_list: Sequence[tuple[str, ...]],
            candidates: Mapping[str, QuantSpec | None], progress=None,
            options: Mapping[tuple[str, ...], Collection[str]] | None = None
            ) -> dict[tuple[str, ...], dict[str, float]]:
    """unit -> candidate name -> loss increase over the float model's loss (`loss_fn`, on calibration text).
    `options`: per unit, the candidates to measure (default all); a None spec is float (no increase)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    base = loss_fn(model)
    out: dict[tuple[str, ...], dict[str, float]] = {}
    for unit in unit_list:
        out[unit] = {}
        for name, spec in _wanted(candidates, options, unit):
            if spec is None:
                out[unit][name] = 0.0
            else:
                with fake_quantized(layers, unit, spec):
                    out[unit][name] = loss_fn(model) - base
            if progress is not None:
                progress.update(1)
    return out


def fisher_deltas(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
                  windows: Sequence[torch.Tensor], unit_list: Sequence[tuple[str, ...]],
                  candidates: Mapping[str, QuantSpec | None], progress=None,
                  options: Mapping[tuple[str, ...], Collection[str]] | None = None
                  ) -> dict[tuple[str, ...], dict[str, float]]:
    """unit -> candidate -> estimated loss increase; `loss_fn(model, window)` is the differentiable mean loss.
    `options` and None specs as in `measure`."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names = [n for u in unit_list for n in u]
    weights = [layers[n].weight for n in names]
    fisher = [torch.zeros_like(w) for w in weights]
    wanted = [w.requires_grad for w in weights]
    frozen = [p for p in model.parameters() if p.requires_grad and all(p is not w for w in weights)]
    try:
        for p in frozen:
            p.requires_grad_(False)
        for w in weights:
            w.requires_grad_(True)
        for ids in windows:
            grads = torch.autograd.grad(loss_fn(model, ids), weights)
            for f, g in zip(fisher, grads, strict=True):
                f.add_(g.detach() ** 2)
            if progress is not None:
                progress.update(1)
    finally:
        for w, r in zip(weights, wanted, strict=True):
            w.requires_grad_(r)
        for p in frozen:
            p.requires_grad_(True)
    by_name = dict(zip(names, fisher, strict=True))

    def delta(unit: tuple[str, ...], spec: QuantSpec | None) -> float:
        if spec is None:
            return 0.0
        return 0.5 * sum((by_name[n] * (dequantize(quantize(layers[n].weight, spec)) - layers[n].weight) ** 2)
                         .sum().item() for n in unit) / len(windows)

    with torch.no_grad():
        return {u: {c: delta(u, spec) for c, spec in _wanted(candidates, options, u)} for u in unit_list}


def _wanted(candidates: Mapping[str, QuantSpec | None], options: Mapping[tuple[str, ...], Collection[str]] | None,
            unit: tuple[str, ...]) -> list[tuple[str, QuantSpec | None]]:
    return [(c, s) for c, s in candidates.items() if options is None or c in options[unit]]


def allocate(deltas: Mapping[tuple[str, ...], Mapping[str, float]], bits: Mapping[tuple[str, ...], Mapping[str, float]],
             params: Mapping[tuple[str, ...], int], budget: float) -> dict[tuple[str, ...], str]:
    """Per unit, the candidate to use so that sum(bits * params) <= budget * sum(params) (bits per weight), with
    the summed loss increase made small. `bits[unit][candidate]` is the bits per weight of that choice."""
    total = sum(params.values())
    order = {u: sorted(bits[u], key=lambda c: (bits[u][c], deltas[u][c])) for u in deltas}
    choice = {u: order[u][0] for u in deltas}
    used = sum(bits[u][choice[u]] * params[u] for u in deltas)
    if used > budget * total + 1e-9:
        raise InvalidRequestError(f"bits budget {budget} is below the cheapest choice "
                                  f"({used / total:.3f} bits per weight)")
    while True:
        best, best_gain = None, 0.0
        for u in deltas:
            cur = choice[u]
            for c in order[u]:
                extra = (bits[u][c] - bits[u][cur]) * params[u]
                gain = deltas[u][cur] - deltas[u][c]
                if extra <= 0 or gain <= 0 or used + extra > budget * total + 1e-9:
                    continue
                if gain / extra > best_gain:
                    best, best_gain = (u, c, extra), gain / extra
        if best is None:
            return choice
        u, c, extra = best
        choice[u], used = c, used + extra
