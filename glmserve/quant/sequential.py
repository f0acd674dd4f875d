"""Sequential calibration: each decoder layer's input statistics gathered from the model whose layers below are
already quantized, as GPTQ's authors run LLaMA (Frantar et al. 2022, arXiv 2210.17323, section 5; their llama.py
`llama_sequential` with --true-sequential), instead of from the float model in one pass (calibrate.collect_stats).

The inputs of the first decoder layer are captured once per calibration window (the decoder layer's positional
arguments and keyword arguments: position embeddings, mask); then layer by layer, unit by unit in the order the
layer runs them (q/k/v, o, gate/up, down: "true sequential"), the layer is re-run on its cached inputs with hooks
that accumulate the unit's input statistics, `step` quantizes the unit from them, and its weights are replaced by
what the served layer computes with (dequantized; rescaled norms; activations fake-quantized as the scheme does),
so later units and layers see the quantized layer's outputs. The layer's outputs on the quantized stream are the
next layer's inputs. The model is restored at the end.

Asymmetric target (GPTAQ, Li et al. 2025, arXiv 2504.02692): the float model is run beside it on its own stream,
and each unit also gets the cross Gram C = sum X~^T X of its served inputs X~ (quantized stream, activation
rounding included) with the float model's inputs X. GPTQ on V = W C^T (H~ + lambda I)^-1 with Hessian H~ = X~^T X~
then minimizes ||X W^T - X~ V'^T|| (the least-squares target V makes the residual orthogonal to X~'s columns), so
the error the layers below left, and the unit's own activation rounding, are compensated where the weights can.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call

from glmserve.errors import UnsupportedModelError
from glmserve.quant.calibrate import InputStats
from glmserve.quant.reference import fake_quantize_inputs
from glmserve.quant.spec import QuantSpec


@torch.no_grad()
def float_target(w: torch.Tensor, stats: InputStats, damp: float) -> torch.Tensor:
    """The weight V [out, in] whose output on the served inputs X~ best matches the float model's X W^T: least
    squares, ridge-regularized towards W (lambda = `damp` times the mean Hessian diagonal, GPTQ's damping), so V = W
    where X~ = X: V^T = W^T + (H~ + lambda I)^-1 (C - H~) W^T, H~ = X~^T X~ / n, C = X~^T X / n."""
    if stats.cross is None:
        raise ValueError("the float-output target needs statistics with a cross Gram (asymmetric collection)")
    h = stats.hessian
    c = stats.cross / max(stats.tokens, 1)
    a = h + torch.eye(h.shape[0], dtype=h.dtype) * damp * torch.diagonal(h).mean()
    w64 = w.detach().to(torch.float64)
    return (w64 + torch.linalg.solve(a, (c - h) @ w64.T).T).to(w.dtype)


class _Stop(Exception):
    """Raised by the capture hook: the rest of the model is not needed."""


@dataclass
class Served:
    """What a quantized unit's layers compute with: module name -> dense weight, parameter name -> float tensor
    (rescaled norms, rows of a producer), module name -> (activation spec, input columns left unrounded)."""

    weights: dict[str, torch.Tensor]
    tensors: dict[str, torch.Tensor]
    activations: dict[str, tuple[QuantSpec, torch.Tensor | None]]


# collect(names, own) -> the current input statistics of the modules `names`, their inputs rounded per `own`
# (module -> activation spec: the unit's own activation format) before they are accumulated
Collect = Callable[[Sequence[str], Mapping[str, QuantSpec]], dict[str, InputStats]]
# step(unit, collect) -> what the unit's layers serve
Step = Callable[[tuple[str, ...], Collect], Served]


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """(name, the ModuleList of decoder layers): the first ModuleList whose entries hold linear layers."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and any(
                isinstance(x, torch.nn.Linear) for x in m[0].modules()):
            return name, m
    raise UnsupportedModelError(f"{type(model).__name__}: no list of decoder layers found for sequential "
                                "calibration")


@torch.no_grad()
def _first_inputs(model: torch.nn.Module, layer: torch.nn.Module, windows: Iterable[torch.Tensor]) -> list:
    """[(args, kwargs)] the first decoder layer receives for each window."""
    captured = []

    def hook(_m, args, kwargs):
        captured.append((args, kwargs))
        raise _Stop

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in windows:
            try:
                model(ids, use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return captured


def _forward(layer: torch.nn.Module, inputs: tuple, state: dict | None = None) -> tuple:
    """The next layer's (args, kwargs): `layer` run on `inputs` (with the parameters `state`, if given), its
    hidden states put in place of the input's."""
    args, kwargs = inputs
    out = layer(*args, **kwargs) if state is None else functional_call(layer, state, args, kwargs)
    hidden = out[0] if isinstance(out, tuple) else out
    if args:
        return (hidden,) + args[1:], kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _order(layer: torch.nn.Module, inputs: list, names: Mapping[str, str]) -> list[str]:
    """The modules `names` (local name -> full name) in the order the layer calls them."""
    modules = dict(layer.named_modules())
    order: list[str] = []
    handles = [modules[local].register_forward_pre_hook(lambda _m, _a, n=full: order.append(n))
               for local, full in names.items()]
    try:
        args, kwargs = inputs[0]
        layer(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return list(dict.fromkeys(order))


@torch.no_grad()
def quantize_sequential(model: torch.nn.Module, windows: Sequence[torch.Tensor], unit_list: Sequence[tuple[str, ...]],
                        step: Step, asymmetric: bool = False, progress=None) -> None:
    """Call `step` on every unit of `unit_list` (tuples of module names sharing one input), layer by layer in
    execution order, with statistics from the model whose earlier units are quantized (see the module docstring).
    Units outside the decoder layers are not supported (an error); the model is left unchanged."""
    prefix, layers = decoder_layers(model)
    named = dict(model.named_modules())
    by_layer: dict[int, list[tuple[str, ...]]] = {}
    for unit in unit_list:
        head = unit[0].removeprefix(f"{prefix}.")
        index = head.partition(".")[0]
        if not unit[0].startswith(f"{prefix}.") or not index.isdigit():
            raise UnsupportedModelError(f"{unit[0]} is not inside a decoder layer: sequential calibration "
                                        "quantizes decoder layers only")
        by_layer.setdefault(int(index), []).append(unit)
    params = dict(model.named_parameters())
    saved = {k: p.data for k, p in params.items()}  # restored at the end (tensors are replaced, not written)
    rounding: dict[str, tuple[QuantSpec, torch.Tensor | None]] = {}
    enabled = [True]

    def round_hook(name: str):
        def pre(_m, args):
            if not enabled[0] or name not in rounding:
                return None
            spec, kept = rounding[name]
            return (fake_quantize_inputs(args[0], spec, kept),) + args[1:]
        return pre

    handles = [named[n].register_forward_pre_hook(round_hook(n)) for unit in unit_list for n in unit]
    try:
        quantized = _first_inputs(model, layers[0], windows)
        floats = [(a, dict(k)) for a, k in quantized] if asymmetric else None
        for i, layer in enumerate(layers):
            lp = f"{prefix}.{i}."
            float_state = {k: v.clone() for k, v in layer.state_dict().items()} if asymmetric else None
            units_here = by_layer.get(i, [])
            local = {n.removeprefix(lp): n for unit in units_here for n in unit}
            order = _order(layer, quantized, local) if units_here else []
            units_here.sort(key=lambda u: min(order.index(n) if n in order else len(order) for n in u))
            for unit in units_here:
                def collect(names: Sequence[str], own: Mapping[str, QuantSpec], layer=layer, lp=lp,
                            inputs=(quantized, floats, float_state)) -> dict[str, InputStats]:
                    return _collect(layer, lp, names, own, *inputs, enabled)
                served = step(unit, collect)
                for n, w in served.weights.items():
                    named[n].weight.data = w.to(named[n].weight.dtype)
                for k, t in served.tensors.items():
                    params[k].data = t.to(params[k].dtype)
                rounding.update(served.activations)
                if progress is not None:
                    progress.update(len(unit))
            quantized = [_forward(layer, x) for x in quantized]
            if floats is not None:
                enabled[0] = False
                floats = [_forward(layer, x, float_state) for x in floats]
                enabled[0] = True
    finally:
        for h in handles:
            h.remove()
        for k, p in params.items():
            p.data = saved[k]


def _collect(layer: torch.nn.Module, lp: str, names: Sequence[str], own: Mapping[str, QuantSpec], quantized: list,
             floats: list | None, float_state: dict | None, enabled: list) -> dict[str, InputStats]:
    """Input statistics of the modules `names` (full names, inside `layer`) on the quantized stream, activation
    rounding of already-quantized modules applied and the inputs of `names` rounded per `own`; with
    `floats`, also the cross Gram with the float stream's inputs of the same modules. Modules fed one input tensor
    share one InputStats, as collect_stats."""
    modules = dict(layer.named_modules())
    stats: dict[str, InputStats] = {}
    current: dict[str, torch.Tensor] = {}  # name -> the float stream's input in this window

    def capture(name: str):
        def pre(_m, args):
            current[name] = args[0].reshape(-1, args[0].shape[-1])
            if len(current) == len(names):
                raise _Stop  # the rest of the layer is not needed
        return pre

    def accumulate(name: str):
        def pre(_m, args):
            x = args[0]
            spec = own.get(name)
            served = x if spec is None else fake_quantize_inputs(x, spec, None)
            # q/k/v, gate/up: one input, one accumulator
            shared = next((s for other, s in stats.items() if seen.get(other) is x), None)
            if shared is not None:
                stats[name] = shared
            else:
                s = stats.setdefault(name, InputStats.empty(x.shape[-1], cross=floats is not None))
                s.add(served, None if floats is None else current[name])
            seen[name] = x
            if len(seen) == len(names):
                raise _Stop
        return pre

    seen: dict[str, torch.Tensor] = {}
    for w in range(len(quantized)):
        if floats is not None:
            enabled[0] = False
            handles = [modules[n.removeprefix(lp)].register_forward_pre_hook(capture(n)) for n in names]
            try:
                current.clear()
                _forward(layer, floats[w], float_state)
            except _Stop:
                pass
            finally:
                enabled[0] = True
                for h in handles:
                    h.remove()
        seen.clear()
        handles = [modules[n.removeprefix(lp)].register_forward_pre_hook(accumulate(n)) for n in names]
        try:
            _forward(layer, quantized[w])
        except _Stop:
            pass
        finally:
            for h in handles:
                h.remove()
    return stats
