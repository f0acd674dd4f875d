"""The core of `glmserve quantize`: a float transformers model -> per-layer formats (a scheme, a recipe, or a
bits-per-weight budget by measured sensitivity) -> QuantizedModules (round to nearest or GPTQ, outlier columns
kept in float) -> a compressed-tensors safetensors folder."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from glmserve.errors import InvalidRequestError
from glmserve.quant.calibrate import InputStats, collect_stats, gptq, gptq_supports, linear_layers
from glmserve.quant.compressed_tensors import OutlierColumns, QuantizedModule, save_checkpoint, spec_to_args
from glmserve.quant.perplexity import mean_nll
from glmserve.quant.quantize import quantize
from glmserve.quant.recipe import NONE, Recipe
from glmserve.quant.schemes import SCHEMES, scheme
from glmserve.quant.sensitivity import allocate, bits_per_weight, measure, units
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight

METHODS = ("rtn", "gptq")
# the schemes this command can write: every named scheme compressed-tensors holds (not GGUF blocks, not none)
WRITABLE_SCHEMES = tuple(n for n, sch in SCHEMES.items() if sch.weight is not None and sch.weight.gguf_type is None)
DEFAULT_CANDIDATES = ("int8", "w4a16", "w4a16-g64")


def scheme_specs(name: str) -> tuple[QuantSpec, QuantSpec | None]:
    """(weight spec, activation spec) of a scheme this command can write (a compressed-tensors format)."""
    found = scheme(name)  # an unknown name: a typed error listing the schemes
    if found.name not in WRITABLE_SCHEMES:
        raise InvalidRequestError(f"scheme {name!r} cannot be written as compressed-tensors "
                                  f"(writable: {', '.join(WRITABLE_SCHEMES)})")
    weight, activations = found.weight, found.activations
    spec_to_args(weight)  # a typed error for a format compressed-tensors cannot hold
    return weight, activations


@dataclass
class Plan:
    """What to do: per-layer schemes come from `recipe`, or from a sensitivity allocation over `candidates`
    under `bits_budget`; `method` quantizes integer layers (GPTQ needs calibration)."""

    recipe: Recipe | None = None
    bits_budget: float | None = None
    candidates: Sequence[str] = DEFAULT_CANDIDATES
    method: str = "rtn"
    gptq_damp: float = 0.01


@dataclass
class Result:
    modules: dict[str, QuantizedModule]
    schemes: dict[str, str]  # module name -> scheme name
    notes: list[str] = field(default_factory=list)
    sensitivity: dict[tuple[str, ...], dict[str, float]] | None = None


def needs_calibration(plan: Plan) -> bool:
    return plan.method == "gptq" or plan.bits_budget is not None or (
        plan.recipe is not None and plan.recipe.activation_threshold is not None)


def choose_schemes(model: torch.nn.Module, plan: Plan,
                   calib: Sequence[torch.Tensor] | None) -> tuple[dict[str, str], dict | None]:
    """Module name -> scheme name, and the measured sensitivities when a bits budget chose them."""
    layers = linear_layers(model)
    names = [n for n in layers if n != "lm_head" and not n.endswith(".lm_head")]
    if plan.bits_budget is None:
        if plan.recipe is None:
            raise InvalidRequestError("give a scheme, a recipe or a bits budget")
        known = {r.scheme for r in plan.recipe.rules} | {plan.recipe.default}
        for s in known - {NONE}:
            scheme_specs(s)  # a typed error for an unknown name
        return plan.recipe.assign(list(layers), known), None
    if calib is None:
        raise InvalidRequestError("--bits-budget measures layer sensitivity on calibration text: give --calib")
    cands = {c: scheme_specs(c)[0] for c in plan.candidates}
    unit_list = units(names)
    progress = tqdm(total=len(unit_list) * len(cands), desc="sensitivity", unit="eval")
    deltas = measure(model, lambda m: mean_nll(m, calib), unit_list, cands, progress)
    progress.close()
    bits = {u: {c: bits_per_weight(s, layers[u[0]].in_features, layers[u[0]].out_features) for c, s in cands.items()}
            for u in unit_list}
    params = {u: sum(layers[n].weight.numel() for n in u) for u in unit_list}
    choice = allocate(deltas, bits, params, plan.bits_budget)
    return {n: choice[u] for u in unit_list for n in u}, deltas


def quantize_model(model: torch.nn.Module, plan: Plan, calib: Sequence[torch.Tensor] | None = None) -> Result:
    """Quantize the linear layers of a float model per `plan` (the model is left unchanged)."""
    if plan.method not in METHODS:
        raise InvalidRequestError(f"method {plan.method!r} is not one of {METHODS}")
    if needs_calibration(plan) and not calib:
        raise InvalidRequestError("this plan needs calibration text (--calib): GPTQ, a bits budget and "
                                  "activation_threshold all measure activations")
    notes = list(plan.recipe.notes) if plan.recipe else []
    schemes, deltas = choose_schemes(model, plan, calib)
    layers = linear_layers(model, schemes)
    stats: dict[str, InputStats] = {}
    threshold = plan.recipe.activation_threshold if plan.recipe else None
    if plan.method == "gptq" or threshold is not None:
        progress = tqdm(total=len(calib), desc="calibrate", unit="window")
        stats = collect_stats(model, calib, schemes, progress)
        progress.close()
    modules = {}
    progress = tqdm(total=len(schemes), desc="quantize", unit="layer")
    for unit in units(list(schemes)):
        parts = [_prepare(layers[name].weight, stats.get(name), threshold) for name in unit]
        spec, act = scheme_specs(schemes[unit[0]])
        if spec.strategy == "tensor_group" and len({schemes[n] for n in unit}) == 1:
            # NVFP4's fp32 global scale is one per fused layer (q|k|v, gate|up), as vLLM runs them and as
            # llm-compressor writes them: quantize the stacked rows, then split
            joint = quantize(torch.cat([w for w, _, _ in parts]), spec)
            quantized = _split_rows(joint, [w.shape[0] for w, _, _ in parts])
        else:
            quantized = []
            for name, (w, hessian, _) in zip(unit, parts, strict=True):
                spec = scheme_specs(schemes[name])[0]
                gptq_it = plan.method == "gptq" and gptq_supports(spec)
                quantized.append(gptq(w, hessian, spec, damp=plan.gptq_damp) if gptq_it else quantize(w, spec))
        for name, q, (_, _, outliers) in zip(unit, quantized, parts, strict=True):
            modules[name] = QuantizedModule(q, scheme_specs(schemes[name])[1], outliers)
        progress.update(len(unit))
    progress.close()
    if plan.method == "gptq" and any(not gptq_supports(m.weight.spec) for m in modules.values()):
        notes.append("GPTQ applies to integer group/channel weights; fp8 and nvfp4 layers are rounded to nearest")
    if threshold is not None:
        kept = sum(len(m.outliers.columns) for m in modules.values() if m.outliers is not None)
        notes.append(f"activation_threshold {threshold}: {kept} input columns kept in float across "
                     f"{sum(m.outliers is not None for m in modules.values())} layers")
    return Result(modules, schemes, notes, deltas)


def _prepare(weight: torch.Tensor, stats: InputStats | None, threshold: float | None):
    """(weight to quantize, its Hessian or None, outlier columns or None): input columns whose activation
    absmax exceeds `threshold` are taken out of the weight (zeroed) and kept in float."""
    w = weight.detach().float()
    hessian = None if stats is None else stats.hessian.clone()
    outliers = None
    if threshold is not None:
        cols = torch.nonzero(stats.absmax > threshold).flatten()
        if len(cols):
            outliers = OutlierColumns(cols, w[:, cols].clone())
            w = w.clone()
            w[:, cols] = 0.0
            hessian[cols, :] = 0.0  # GPTQ: these inputs are not quantized, nothing to compensate into
            hessian[:, cols] = 0.0
    return w, hessian, outliers


def _split_rows(q: QuantizedWeight, rows: list[int]) -> list[QuantizedWeight]:
    """A row-grouped weight (channel / group / tensor_group scales) cut back into its stacked parts."""
    def cut(t: torch.Tensor | None) -> list:
        return [None] * len(rows) if t is None else list(torch.split(t, rows, dim=0))

    return [QuantizedWeight(q.spec, c.clone(), s.clone(), zeros=None if z is None else z.clone(),
                            global_scale=q.global_scale)
            for c, s, z in zip(cut(q.codes), cut(q.scales), cut(q.zeros), strict=True)]


def float_tensors(model: torch.nn.Module, modules: Mapping[str, QuantizedModule], dtype: torch.dtype | None) -> dict:
    """Every tensor of the model but the quantized weights (lm_head left out when tied to the embeddings)."""
    quantized = {f"{n}.weight" for n in modules}
    tied = getattr(model.config, "tie_word_embeddings", False)
    out = {}
    for name, t in model.state_dict().items():
        if name in quantized or (tied and name == "lm_head.weight"):
            continue
        out[name] = t.detach().to(dtype or t.dtype).clone()
    return out


def save(out_dir: Path, model: torch.nn.Module, tokenizer, result: Result, dtype: torch.dtype | None = None) -> None:
    """The compressed-tensors folder: weights, config.json with quantization_config, tokenizer files."""
    ignore = [n for n in linear_layers(model) if n not in result.modules]
    config = model.config.to_dict()
    if "lm_head" in result.modules:  # a quantized lm_head is its own tensor, no longer the embeddings
        config["tie_word_embeddings"] = False
    if dtype is not None:
        config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    save_checkpoint(out_dir, result.modules, float_tensors(model, result.modules, dtype), config, ignore)
    tokenizer.save_pretrained(str(out_dir))


def weight_bytes(model: torch.nn.Module, result: Result | None) -> tuple[float, float]:
    """(bytes of the weights served this way, bytes in bf16): quantized layers at their bits per weight
    (16-bit scales), outlier columns and every other tensor at 16 bits; tied tensors counted once."""
    seen, total, bf16 = set(), 0.0, 0.0
    layers = linear_layers(model)
    for name, p in model.named_parameters(remove_duplicate=True):
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        bf16 += p.numel() * 2
        module = name.removesuffix(".weight")
        m = None if result is None else result.modules.get(module)
        if m is None or not name.endswith(".weight"):
            total += p.numel() * 2
            continue
        out_f, in_f = layers[module].weight.shape
        k = 0 if m.outliers is None else len(m.outliers.columns)
        total += out_f * in_f * bits_per_weight(m.weight.spec, in_f, out_f) / 8 + out_f * k * 2
    return total, bf16
