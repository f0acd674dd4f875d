"""The core of `glmserve quantize`: a float transformers model -> per-layer formats (a scheme, a recipe, or a
bits-per-weight budget by measured sensitivity) -> optional SmoothQuant migration -> QuantizedModules (round to
nearest, GPTQ or AWQ, outlier columns kept in float) -> a compressed-tensors safetensors folder."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from glmserve.errors import InvalidRequestError
from glmserve.quant import awq, scale_search, smoothquant
from glmserve.quant.calibrate import InputStats, collect_stats, gptq, gptq_supports, linear_layers
from glmserve.quant.compressed_tensors import (
    OutlierColumns,
    QuantizedModule,
    dense_weight,
    save_checkpoint,
    spec_to_args,
)
from glmserve.quant.perplexity import mean_nll, window_loss
from glmserve.quant.quantize import quantize
from glmserve.quant.recipe import NONE, Recipe
from glmserve.quant.schemes import SCHEMES, scheme
from glmserve.quant.sensitivity import KINDS as SENSITIVITY_KINDS
from glmserve.quant.sensitivity import allocate, bits_per_weight, fisher_deltas, measure, units
from glmserve.quant.sequential import Collect, Served, float_target, quantize_sequential
from glmserve.quant.spec import QuantSpec
from glmserve.quant.tune import TuneOptions, tune
from glmserve.quant.weight import QuantizedWeight

# awq-gptq: AWQ's input-channel scales folded first (no clipping search), then GPTQ on the rescaled weights
# with the rescaled inputs' Hessian (llm-compressor's AWQModifier followed by its GPTQModifier)
METHODS = ("rtn", "gptq", "awq", "awq-gptq")
AWQ_METHODS = ("awq", "awq-gptq")
GPTQ_METHODS = ("gptq", "awq-gptq")
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
    under `bits_budget`, or from both (the recipe's schemes as floors, upgraded under the budget).
    `sensitivity`: each unit's loss increase measured, or estimated from the Fisher diagonal (sensitivity.py);
    `method` quantizes integer layers (GPTQ and AWQ need calibration)."""

    recipe: Recipe | None = None
    bits_budget: float | None = None
    candidates: Sequence[str] | None = None  # None: DEFAULT_CANDIDATES, or with a recipe its own (recipe.py)
    method: str = "rtn"
    sensitivity: str | None = None  # a sensitivity.KINDS kind; None: the recipe's, else "measured"
    gptq_damp: float = 0.01
    smooth: float | None = None  # SmoothQuant's alpha (smoothquant.py); None: no migration
    scale_search: bool = False  # each (row, group)'s range by weighted-MSE search (scale_search.py), not absmax
    # statistics of each decoder layer's units from the model quantized below them (sequential.py), not from
    # the float model in one pass; asymmetric: GPTQ's target is the float model's output (GPTAQ)
    sequential: bool = False
    asymmetric: bool = False
    asymmetric_damp: float | None = None  # the float target's ridge towards W (float_target); None: gptq_damp
    # after quantizing: scales, float minimums and norms trained end to end against the float model (tune.py)
    tune: TuneOptions | None = None

    def budget(self) -> float | None:
        """The bits budget: the plan's own, else its recipe's."""
        if self.bits_budget is not None or self.recipe is None:
            return self.bits_budget
        return self.recipe.bits_budget


@dataclass
class Result:
    modules: dict[str, QuantizedModule]
    schemes: dict[str, str]  # module name -> scheme name
    notes: list[str] = field(default_factory=list)
    sensitivity: dict[tuple[str, ...], dict[str, float]] | None = None
    float_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # float tensors AWQ rescaled (norms)


def needs_calibration(plan: Plan) -> bool:
    return (plan.method != "rtn" or plan.sequential or plan.budget() is not None or plan.smooth is not None
            or plan.tune is not None or (plan.recipe is not None and plan.recipe.activation_threshold is not None))


def choose_schemes(model: torch.nn.Module, plan: Plan,
                   calib: Sequence[torch.Tensor] | None) -> tuple[dict[str, str], dict | None]:
    """Module name -> scheme name, and the measured sensitivities when a bits budget chose them.

    A recipe with a bits budget (the plan's or the recipe's own) gives each unit its floor: the unit keeps its
    rule's scheme or is upgraded to a candidate of more bits; units the recipe leaves in float stay so and are
    outside the budget."""
    layers = linear_layers(model)
    names = [n for n in layers if n != "lm_head" and not n.endswith(".lm_head")]
    budget = plan.budget()
    floor = None
    if plan.recipe is not None:
        upgrades = tuple(plan.candidates or plan.recipe.candidates)
        specs = _specs(plan.recipe.schemes() | set(upgrades))  # a typed error for an unknown name
        floor = plan.recipe.assign(list(layers), specs)
        if budget is None:
            return floor, None
        cand_names = upgrades or tuple(sorted(plan.recipe.schemes() - {NONE}))
    elif budget is None:
        raise InvalidRequestError("give a scheme, a recipe or a bits budget")
    else:
        cand_names = tuple(plan.candidates or DEFAULT_CANDIDATES)
        specs = _specs(cand_names)
    if calib is None:
        raise InvalidRequestError("--bits-budget measures layer sensitivity on calibration text: give --calib")
    unit_list = units(names)
    shape = {u: (layers[u[0]].in_features, layers[u[0]].out_features) for u in unit_list}
    if floor is None:
        options = {u: list(cand_names) for u in unit_list}
    else:
        options = _upgrades(unit_list, floor, specs, cand_names, shape)
        unit_list = list(options)
    kind = plan.sensitivity or (plan.recipe.sensitivity if plan.recipe else None) or "measured"
    if kind not in SENSITIVITY_KINDS:
        raise InvalidRequestError(f"sensitivity {kind!r} is not one of {SENSITIVITY_KINDS}")
    if kind == "fisher":
        progress = tqdm(total=len(calib), desc="fisher", unit="window")
        deltas = fisher_deltas(model, window_loss, calib, unit_list, specs, progress, options)
    else:
        progress = tqdm(total=sum(len(o) for o in options.values()), desc="sensitivity", unit="eval")
        deltas = measure(model, lambda m: mean_nll(m, calib), unit_list, specs, progress, options)
    progress.close()
    bits = {u: {c: bits_per_weight(specs[c], *shape[u]) for c in options[u]} for u in unit_list}
    params = {u: sum(layers[n].weight.numel() for n in u) for u in unit_list}
    choice = allocate(deltas, bits, params, budget)
    chosen = {n: choice[u] for u in unit_list for n in u}
    if floor is not None:  # units outside the budget keep the recipe's word (float ones are absent from both)
        chosen = {n: chosen.get(n, s) for n, s in floor.items()}
    return {n: s for n, s in chosen.items() if s != NONE}, deltas


def _specs(names: Iterable[str]) -> dict[str, QuantSpec | None]:
    """Each scheme name's weight spec (None for "none", float); a typed error for a name this command cannot write."""
    return {n: None if n == NONE else scheme_specs(n)[0] for n in names}


def _upgrades(unit_list: Sequence[tuple[str, ...]], floor: Mapping[str, str], specs: Mapping[str, QuantSpec | None],
              candidates: Sequence[str], shape: Mapping[tuple[str, ...], tuple[int, int]]
              ) -> dict[tuple[str, ...], list[str]]:
    """Per unit the recipe quantizes: its floor scheme first, then the candidates of more bits per weight."""
    options = {}
    for u in unit_list:
        base = {floor.get(n, NONE) for n in u}
        if len(base) > 1:
            raise InvalidRequestError(f"a bits budget upgrades whole units, but the recipe gives {', '.join(u)} "
                                      f"different schemes ({', '.join(sorted(base))})")
        (b,) = base
        if b == NONE:
            continue
        floor_bits = bits_per_weight(specs[b], *shape[u])
        options[u] = [b] + [c for c in candidates if c != b and bits_per_weight(specs[c], *shape[u]) > floor_bits]
    return options


def quantize_model(model: torch.nn.Module, plan: Plan, calib: Sequence[torch.Tensor] | None = None,
                   stats: Mapping[str, InputStats] | None = None) -> Result:
    """Quantize the linear layers of a float model per `plan` (the model is left unchanged). `stats`: input
    statistics collect_stats already gathered on `calib` for these layers (else they are collected here)."""
    if plan.method not in METHODS:
        raise InvalidRequestError(f"method {plan.method!r} is not one of {METHODS}")
    if needs_calibration(plan) and not calib:
        raise InvalidRequestError("this plan needs calibration text (--calib): GPTQ, a bits budget, tuning and "
                                  "activation_threshold all measure activations")
    notes = list(plan.recipe.notes) if plan.recipe else []
    schemes, deltas = choose_schemes(model, plan, calib)
    threshold = plan.recipe.activation_threshold if plan.recipe else None
    if plan.method in AWQ_METHODS and (threshold is not None or plan.smooth is not None):
        raise InvalidRequestError("AWQ rescales input channels; it does not combine with activation_threshold "
                                  "or SmoothQuant")
    if plan.smooth is not None:
        smoothquant.check_alpha(plan.smooth)
    if plan.scale_search and plan.method == "awq":
        raise InvalidRequestError("--scale-search does not combine with --method awq: AWQ's clipping search "
                                  "already chooses the ranges (use rtn, gptq or awq-gptq)")
    if plan.asymmetric and not (plan.sequential and plan.method in GPTQ_METHODS):
        raise InvalidRequestError("the asymmetric (float-output) target is GPTQ's under sequential calibration: "
                                  "give --sequential and --method gptq or awq-gptq")
    if plan.asymmetric_damp is not None and not (plan.asymmetric and plan.asymmetric_damp > 0):
        raise InvalidRequestError("--asymmetric-damp (> 0) sets the ridge of the asymmetric target: give --asymmetric")
    if plan.sequential and not calib:
        raise InvalidRequestError("sequential calibration runs the calibration text through the model: give --calib")
    progress = tqdm(total=len(schemes), desc="quantize", unit="layer")
    if plan.sequential:
        modules, rescaled = _quantize_sequential(model, plan, calib, schemes, threshold, progress)
    else:
        modules, rescaled = _quantize_one_pass(model, plan, calib, stats, schemes, threshold, progress, notes)
    progress.close()
    if plan.tune is not None:
        modules, rescaled, losses = tune(model, modules, rescaled, calib, plan.tune)
        tail = losses[-max(1, len(losses) // 10):]
        notes.append(f"tuned {len(losses)} steps end to end: calibration KL {losses[0]:.4f} at the first step, "
                     f"{sum(tail) / len(tail):.4f} over the last {len(tail)}")
    supported = gptq_supports if plan.method in GPTQ_METHODS else awq.supports
    if plan.method != "rtn" and any(not supported(m.weight.spec) for m in modules.values()):
        also = ", fp8 and nvfp4" if supported is gptq_supports else ""
        notes.append(f"{plan.method.upper()} applies to integer{also} group/channel weights; the other layers are "
                     "rounded to nearest")
    if plan.scale_search and any(not scale_search.supports(m.weight.spec) for m in modules.values()):
        notes.append("the scale search covers integer group/channel and FP8 weights; the other layers keep "
                     "round to nearest's scales")
    if threshold is not None:
        kept = sum(len(m.outliers.columns) for m in modules.values() if m.outliers is not None)
        notes.append(f"activation_threshold {threshold}: {kept} input columns kept in float across "
                     f"{sum(m.outliers is not None for m in modules.values())} layers")
    return Result(modules, schemes, notes, deltas, rescaled)


def _search_for(plan: Plan):
    """The input-scale search folded before quantizing (AWQ's, SmoothQuant's), or None."""
    if plan.method in AWQ_METHODS:
        return _awq_search
    if plan.smooth is not None:
        alpha = plan.smooth
        return lambda ws, st, _spec: smoothquant.smooth_scale(ws, st.absmax, alpha)
    return None


def _quantize_one_pass(model: torch.nn.Module, plan: Plan, calib, stats: Mapping[str, InputStats] | None,
                       schemes: dict[str, str], threshold: float | None, progress,
                       notes: list[str]) -> tuple[dict[str, QuantizedModule], dict[str, torch.Tensor]]:
    """Every layer from the float model's statistics, collected in one pass (or given)."""
    if stats is None and (needs_calibration(plan) or (plan.scale_search and calib)):
        bar = tqdm(total=len(calib), desc="calibrate", unit="window")
        stats = collect_stats(model, calib, schemes, bar)
        bar.close()
    stats = dict(stats or {})
    layers = linear_layers(model, schemes)
    weights = {n: m.weight.detach().float().clone() for n, m in layers.items()}
    rescaled: dict[str, torch.Tensor] = {}
    search = _search_for(plan)
    if search is not None:
        rescaled, folded = _fold_scales(model, schemes, stats, search, weights, units(list(schemes)))
        if plan.smooth is not None:
            notes.append(f"SmoothQuant alpha {plan.smooth}: input scales folded into {len(rescaled)} norms and "
                         f"{len(folded) - len(rescaled)} linear layers' rows")
    modules = {}
    for unit in units(list(schemes)):
        modules.update(_quantize_unit(unit, weights, stats, schemes, plan, threshold))
        progress.update(len(unit))
    return modules, rescaled


def _quantize_sequential(model: torch.nn.Module, plan: Plan, calib, schemes: dict[str, str],
                         threshold: float | None,
                         progress) -> tuple[dict[str, QuantizedModule], dict[str, torch.Tensor]]:
    """Each unit from the statistics of the model quantized below it (sequential.py). A fold whose producer is
    another unit's linear layer (AWQ / SmoothQuant on down_proj: up_proj's rows) is made when that producer's unit
    is quantized, from the consumer's statistics at that point; the consumer is quantized later from fresh ones."""
    named = dict(model.named_modules())
    search = _search_for(plan)
    unit_list = units(list(schemes))
    consumer = {}  # a linear layer -> the unit whose input it produces (where a fold divides its rows)
    for unit in unit_list:
        target = _producer(unit[0])
        if target in schemes:
            consumer[target] = unit
    modules: dict[str, QuantizedModule] = {}
    rescaled: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}  # weights already rescaled by a fold, not yet quantized
    done: set[tuple[str, ...]] = set()  # units whose fold was made
    scales: dict[tuple[str, ...], torch.Tensor] = {}  # the scale s of a unit folded before its statistics were taken

    def step(unit: tuple[str, ...], collect: Collect) -> Served:
        acts = {n: scheme_specs(schemes[n])[1] for n in unit}
        ahead = [consumer[n] for n in unit if n in consumer and consumer[n] not in done] if search else []
        names = list(unit) + [n for u in ahead for n in u]
        stats = collect(names, {n: a for n, a in acts.items() if a is not None})
        weights = {n: pending.pop(n) if n in pending else named[n].weight.detach().float().clone() for n in names}
        s = scales.pop(unit, None)
        if s is not None and stats[unit[0]].cross is not None:
            # the served inputs were taken after the fold (x / s), the float model's are not: put those in the
            # same coordinates (X / s), as the folded weight W s expects
            fixed = replace(stats[unit[0]], cross=stats[unit[0]].cross / s.to(torch.float64)[None, :])
            stats.update({n: fixed for n in unit})
        tensors: dict[str, torch.Tensor] = {}
        if search is not None and unit not in done:
            tensors, folded = _fold_scales(model, schemes, stats, search, weights, [unit] + ahead)
            done.update([unit] + ahead)
            scales.update({u: folded[u] for u in ahead if u in folded})
        pending.update({n: weights[n] for u in ahead for n in u})
        rescaled.update(tensors)
        quantized = _quantize_unit(unit, weights, stats, schemes, plan, threshold)
        modules.update(quantized)
        return Served({n: dense_weight(m) for n, m in quantized.items()}, tensors,
                      {n: (acts[n], None if m.outliers is None else m.outliers.columns)
                       for n, m in quantized.items() if acts[n] is not None})

    quantize_sequential(model, calib, unit_list, step, plan.asymmetric, progress)
    return modules, rescaled


def _quantize_unit(unit: tuple[str, ...], weights: Mapping[str, torch.Tensor], stats: Mapping[str, InputStats],
                   schemes: Mapping[str, str], plan: Plan,
                   threshold: float | None) -> dict[str, QuantizedModule]:
    """The unit's layers (one shared input) quantized from `weights` and their input statistics."""
    target_damp = plan.gptq_damp if plan.asymmetric_damp is None else plan.asymmetric_damp
    parts = [_prepare(weights[name], stats.get(name), threshold, target_damp) for name in unit]
    spec, _ = scheme_specs(schemes[unit[0]])
    if spec.strategy == "tensor_group" and len({schemes[n] for n in unit}) == 1:
        # NVFP4's fp32 global scale is one per fused layer (q|k|v, gate|up), as vLLM runs them and as
        # llm-compressor writes them: quantize the stacked rows (GPTQ: with their one shared input's Hessian),
        # then split
        stacked = torch.cat([w for w, _, _ in parts])
        joint = (gptq(stacked, parts[0][1], spec, damp=plan.gptq_damp) if plan.method in GPTQ_METHODS
                 else quantize(stacked, spec))
        quantized = _split_rows(joint, [w.shape[0] for w, _, _ in parts])
    else:
        quantized = [_quantize_layer(name, w, hessian, scheme_specs(schemes[name])[0], plan)
                     for name, (w, hessian, _) in zip(unit, parts, strict=True)]
    return {name: QuantizedModule(q, scheme_specs(schemes[name])[1], outliers)
            for name, q, (_, _, outliers) in zip(unit, quantized, parts, strict=True)}


def _searched(w: torch.Tensor, hessian: torch.Tensor | None, spec: QuantSpec, plan: Plan) -> QuantizedWeight | None:
    """The scale search's quantization of `w` (importance: the Hessian diagonal), or None when not asked for or
    not covering `spec`."""
    if not plan.scale_search or not scale_search.supports(spec):
        return None
    return scale_search.search_quantize(w, spec, None if hessian is None else torch.diagonal(hessian))


def _quantize_layer(name: str, w: torch.Tensor, hessian: torch.Tensor | None, spec: QuantSpec,
                    plan: Plan) -> QuantizedWeight:
    searched = _searched(w, hessian, spec, plan)
    if plan.method in GPTQ_METHODS and gptq_supports(spec):
        return gptq(w, hessian, spec, damp=plan.gptq_damp, initial=searched)
    if searched is not None:
        return searched
    if plan.method != "awq" or not awq.supports(spec):
        return quantize(w, spec)
    if name.rpartition(".")[2] in ("q_proj", "k_proj"):  # llm-awq's auto_clip leaves q/k unclipped: their
        return quantize(w, spec)  # error goes through the attention scores, which a per-layer error misses
    return awq.clip_quantize(w, hessian, spec)


# Llama-style decoder layers: the op whose output is each AWQ unit's input, where 1/s is folded
# (llm-awq auto_scale.py: input_layernorm -> q/k/v, post_attention_layernorm -> gate/up, up_proj -> down_proj;
# o_proj is scaled there only when v_proj's rows map one to one onto its inputs, not under grouped-query
# attention, so here it is clipped only)
AWQ_FOLDS = {"self_attn.q_proj": "input_layernorm", "mlp.gate_proj": "post_attention_layernorm",
             "mlp.down_proj": "mlp.up_proj"}


def _awq_search(weights: list[torch.Tensor], stats: InputStats, spec: QuantSpec) -> torch.Tensor | None:
    if not awq.supports(spec):
        return None
    s = awq.search_scale(weights, stats.hessian, stats.absmean, spec)
    return None if bool((s == 1).all()) else s  # round to nearest won the search: nothing to fold


def _producer(name: str) -> str | None:
    """The module whose output is the input of the unit led by layer `name` (AWQ_FOLDS), or None."""
    prefix, _, leaf = name.rpartition(".")
    prefix, _, sub = prefix.rpartition(".")
    producer = AWQ_FOLDS.get(f"{sub}.{leaf}")
    return f"{prefix}.{producer}" if producer else None


def _fold_scales(model: torch.nn.Module, schemes: Mapping[str, str], stats: dict[str, InputStats], search,
                 weights: dict[str, torch.Tensor],
                 unit_list: Sequence[tuple[str, ...]]
                 ) -> tuple[dict[str, torch.Tensor], dict[tuple[str, ...], torch.Tensor]]:
    """(the rescaled float tensors, unit -> its scale s for the units folded): each unit of `unit_list` whose
    layers share one scheme and have a known producer gets s = search(its weights, its input stats, spec) (None:
    left as is); its `weights` (float, updated in place) become W s, the producer computes its output / s (a
    linear producer's rows in `weights`, a norm's weight returned), and `stats` is updated in place to the
    statistics of those inputs (GPTQ and outlier detection after SmoothQuant see what the layer will)."""
    named = dict(model.named_modules())
    rescaled: dict[str, torch.Tensor] = {}
    folded: dict[tuple[str, ...], torch.Tensor] = {}
    for unit in unit_list:
        spec = scheme_specs(schemes[unit[0]])[0]
        target = _producer(unit[0])
        if (target is None or len({schemes[n] for n in unit}) > 1 or target not in named
                or (isinstance(named[target], torch.nn.Linear) and target not in weights)):
            continue
        s = search([weights[n] for n in unit], stats[unit[0]], spec)
        if s is None:
            continue
        divided = stats[unit[0]].divided(s)
        for n in unit:
            weights[n] = weights[n] * s
            stats[n] = divided
        if target in weights:  # a linear producer: its output rows
            weights[target] = weights[target] / s[:, None]
        else:  # a norm: its weight
            rescaled[f"{target}.weight"] = named[target].weight.detach().float() / s
        folded[unit] = s
    return rescaled, folded


def _prepare(weight: torch.Tensor, stats: InputStats | None, threshold: float | None, damp: float):
    """(weight to quantize, its Hessian or None, outlier columns or None): the float-output target when the
    statistics hold a cross Gram (sequential.float_target); input columns whose activation absmax exceeds
    `threshold` are taken out of the weight (zeroed) and kept in float."""
    w = weight.detach().float()
    if stats is not None and stats.cross is not None:
        w = float_target(w, stats, damp)
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
                            mins=None if m is None else m.clone(), global_scale=q.global_scale)
            for c, s, z, m in zip(cut(q.codes), cut(q.scales), cut(q.zeros), cut(q.mins), strict=True)]


FloatDtypes = torch.dtype | Mapping[str, torch.dtype] | None  # one for all, per tensor name (others: as they are)


def float_tensors(model: torch.nn.Module, modules: Mapping[str, QuantizedModule], dtype: FloatDtypes) -> dict:
    """Every tensor of the model but the quantized weights (lm_head left out when tied to the embeddings), as
    `dtype` says."""
    quantized = {f"{n}.weight" for n in modules}
    tied = getattr(model.config, "tie_word_embeddings", False)
    out = {}
    for name, t in model.state_dict().items():
        if name in quantized or (tied and name == "lm_head.weight"):
            continue
        want = dtype.get(name, t.dtype) if isinstance(dtype, Mapping) else dtype or t.dtype
        out[name] = t.detach().to(want).clone()
    return out


def save(out_dir: Path, model: torch.nn.Module, tokenizer, result: Result, dtype: FloatDtypes = None) -> None:
    """The compressed-tensors folder: weights, config.json with quantization_config (its dtype: that of the largest
    float tensor where `dtype` is not None), tokenizer files."""
    ignore = [n for n in linear_layers(model) if n not in result.modules]
    config = model.config.to_dict()
    if "lm_head" in result.modules:  # a quantized lm_head is its own tensor, no longer the embeddings
        config["tie_word_embeddings"] = False
    tensors = float_tensors(model, result.modules, dtype)
    tensors.update({k: v.to(tensors[k].dtype) for k, v in result.float_tensors.items()})
    if dtype is not None:
        largest = max(tensors.values(), key=torch.Tensor.numel).dtype
        config["torch_dtype"] = config["dtype"] = str(largest).removeprefix("torch.")
    save_checkpoint(out_dir, result.modules, tensors, config, ignore)
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
