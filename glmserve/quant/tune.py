"""End-to-end tuning of a quantized model's continuous parameters against its float model: the integer (or
float8 / float4) codes stay as they are, while each group's scale (and float minimum), the input columns a recipe
keeps in float and every norm's weight are trained by gradient descent so that the quantized model's next-token
distributions match the float model's on the calibration text (mean KL(float || quantized) per token).

Follows EfficientQAT's end-to-end step of training only the quantization parameters with the codes frozen
(E2E-QP, Chen et al. 2024, arXiv 2407.11062, section 3.3) and norm tweaking (Li et al. 2023, arXiv 2309.02784:
the norms' weights adjusted after quantization, here by the same end-to-end loss rather than per layer). The
format is unchanged, so every backend and the compressed-tensors export take the tuned weights as they took the
untuned ones. Scales stored in float8 (NVFP4's E4M3 scales) are rounded to float8 in every step, with the
gradient passed straight through.

Parameters are relative, s = s0 (1 + t) for a scale, m = m0 + s0 u for a float minimum, g = g0 (1 + v) for a
norm's weight, w = w0 + rms(w0) k for a layer's float columns, all offsets 0 at the start, so one learning rate
suits every layer whatever its magnitude. The student runs under bfloat16 autocast by default (2.4x faster than
float32 on an AVX512-BF16 CPU, measured on SmolLM2-135M); the float teacher's log-probabilities are computed in
float32, kept for the calibration text's windows and computed again for each draw of a sampled one (memory grows
with the calibration text, not with the samples).

The calibration text can be extended by windows the float model writes itself (`TuneOptions.samples`): each
continues a short piece of a calibration window by sampling (temperature 1, nucleus 0.95), as LLM-QAT distils on
the model's own generations (Liu et al. 2023, arXiv 2305.17888, section 2.1). Each step then draws half its windows
from the calibration text and half from the sampled ones: more distinct windows against the overfitting of a few
thousand calibration tokens for millions of scales, while the real text stays in every step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from tqdm import tqdm

from glmserve.quant.compressed_tensors import QuantizedModule
from glmserve.quant.reference import code_values, expand_to, fake_quantize_inputs
from glmserve.quant.weight import QuantizedWeight

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class TuneOptions:
    steps: int = 100
    lr: float = 1e-3  # Adam's step on the relative parameters t, u, v (cosine decay to 0)
    windows_per_step: int = 4  # calibration windows in one step's batch
    seed: int = 0  # the order in which windows are drawn
    # the student's compute dtype: bfloat16 autocast (fast), or float32 where the format's own error is below
    # bfloat16's (a W8A8 model's KL can be)
    dtype: torch.dtype = torch.bfloat16
    samples: int = 0  # windows the float model writes, added to the calibration windows (sampled_windows)
    prompt_tokens: int = 32  # tokens of a calibration window each sampled window continues


class _TunedLayer:
    """One quantized layer's dense weight as a function of its trainable scale, minimum and outlier-column
    offsets."""

    def __init__(self, module: QuantizedModule):
        weight = module.weight
        self.module = module
        self.base = code_values(weight)  # value(codes) - zeros, [out, in] float32
        if weight.zeros is not None:
            self.base = self.base - expand_to(weight.zeros, weight.spec, weight.shape)
        self.scales0 = weight.scales.float()  # the effective scales before tuning (minimums move in their units)
        if weight.global_scale is not None:
            self.scales0 = self.scales0 / weight.global_scale.float()
        self.t = torch.zeros_like(self.scales0, requires_grad=True)
        self.u = None if weight.mins is None else torch.zeros_like(self.scales0, requires_grad=True)
        # input columns kept in float (a recipe's outlier channels): w = w0 + rms(w0) k, trained as well
        self.k = None if module.outliers is None else torch.zeros_like(module.outliers.weight, dtype=torch.float32,
                                                                       requires_grad=True)

    def parameters(self) -> list[torch.Tensor]:
        return [p for p in (self.t, self.u, self.k) if p is not None]

    def _stored_scales(self) -> torch.Tensor:
        """The scales as stored (before a global scale divides them); float8 ones rounded to float8 with the
        straight-through gradient, so a scale moves to the next float8 value once its tuning has crossed the
        midpoint (LSQ's estimator, Esser et al. 2020, arXiv 1902.08153)."""
        stored = self.module.weight.scales
        s = stored.float() * (1 + self.t)
        if stored.dtype in FLOAT8_DTYPES:
            s = s.clamp(max=torch.finfo(stored.dtype).max)
            s = s + (s.to(stored.dtype).float() - s).detach()
        return s

    def _scales(self) -> torch.Tensor:
        s = self._stored_scales()
        global_scale = self.module.weight.global_scale
        return s if global_scale is None else s / global_scale.float()

    def _mins(self) -> torch.Tensor | None:
        if self.u is None:
            return None
        return self.module.weight.mins.float() + self.scales0 * self.u

    def dense(self) -> torch.Tensor:
        spec, shape = self.module.weight.spec, self.module.weight.shape
        w = self.base * expand_to(self._scales(), spec, shape)
        mins = self._mins()
        if mins is not None:
            w = w + expand_to(mins, spec, shape)
        outliers = self._outliers()
        if outliers is not None:
            w = w.index_copy(1, self.module.outliers.columns, outliers)
        return w

    def _outliers(self) -> torch.Tensor | None:
        if self.k is None:
            return None
        w0 = self.module.outliers.weight.float()
        return w0 + w0.square().mean().sqrt() * self.k

    @torch.no_grad()
    def tuned(self) -> QuantizedModule:
        """The module with its tuned scales, minimums and outlier columns in their stored dtypes."""
        weight: QuantizedWeight = self.module.weight
        scales = self._stored_scales().to(weight.scales.dtype)
        mins, outliers = self._mins(), self._outliers()
        if outliers is not None:
            outliers = replace(self.module.outliers, weight=outliers.to(self.module.outliers.weight.dtype))
        return replace(self.module, weight=replace(weight, scales=scales,
                                                   mins=None if mins is None else mins.to(weight.mins.dtype)),
                       outliers=outliers)


def norm_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State-dict name -> weight of every normalization module (RMSNorm / LayerNorm)."""
    return {f"{name}.weight": m.weight for name, m in model.named_modules()
            if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None), torch.Tensor)}


@torch.no_grad()
def _teacher(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The float model's next-token log-probabilities of a window, computed in float32 and kept in bfloat16 [len - 1,
    vocab]: 50 MB a 512-token window for SmolLM2's 49,152 tokens, 150 MB for GLM's, so tune() keeps them for the
    calibration text's windows only and computes a sampled window's each time a step draws it."""
    return F.log_softmax(model(ids).logits[0, :-1].float(), dim=-1).to(torch.bfloat16)


@torch.no_grad()
def sampled_windows(model: torch.nn.Module, windows: Sequence[torch.Tensor], count: int, prompt_tokens: int,
                    seed: int, batch: int = 16) -> list[torch.Tensor]:
    """`count` windows as long as the longest of `windows`, each written by `model` (nucleus sampling, p 0.95)
    after `prompt_tokens` tokens (at most half the shortest window) taken at a random place in one of `windows` in
    turn (so the languages and topics of the calibration text are continued in their proportions)."""
    length, shortest = max(w.shape[1] for w in windows), min(w.shape[1] for w in windows)
    if prompt_tokens < 1 or shortest < 2:
        raise ValueError(f"sampled windows continue prompt_tokens={prompt_tokens} (>= 1) tokens of calibration "
                         f"windows of 2 or more (the shortest has {shortest})")
    prompt_tokens = min(prompt_tokens, shortest // 2)
    places = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        source = windows[i % len(windows)][0]
        start = int(torch.randint(source.numel() - prompt_tokens + 1, (1,), generator=places))
        prompts.append(source[start:start + prompt_tokens])
    out: list[torch.Tensor] = []
    new = length - prompt_tokens
    with torch.random.fork_rng(), tqdm(total=count, desc="sample", unit="window") as bar:
        torch.manual_seed(seed)
        for first in range(0, count, batch):
            heads = torch.stack(prompts[first:first + batch])
            ids = model.generate(heads, attention_mask=torch.ones_like(heads), do_sample=True, top_k=0, top_p=0.95,
                                 temperature=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
            out += list(ids.split(1))
            bar.update(len(heads))
    return out


def _kl(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || softmax(logits)); logits [n, vocab], teacher log-probs [n, vocab]."""
    t = teacher.float()
    return (t.exp() * (t - F.log_softmax(logits.float(), dim=-1))).sum(-1).mean()


def tune(model: torch.nn.Module, modules: dict[str, QuantizedModule], float_tensors: dict[str, torch.Tensor],
         windows: Sequence[torch.Tensor], options: TuneOptions, sampled: Sequence[torch.Tensor] | None = None,
         ) -> tuple[dict[str, QuantizedModule], dict[str, torch.Tensor], list[float]]:
    """(the modules with tuned scales / minimums / outlier columns, the float tensors with tuned norms added, the
    loss of each step). `model`: the float model (left unchanged; its outputs are the target); `float_tensors`:
    tensors the quantized model computes with in place of the float model's (norms AWQ or SmoothQuant rescaled);
    `sampled`: windows sampled_windows already wrote for these windows and options (several quantizations of one
    model tuned on the same samples), else options.samples of them are written here."""
    if options.steps < 1 or options.lr <= 0 or options.windows_per_step < 1 or options.samples < 0:
        raise ValueError(f"tuning needs steps >= 1, lr > 0, windows per step >= 1 and samples >= 0, not {options}")
    if not windows:
        raise ValueError("tuning needs calibration windows")
    text_windows = len(windows)
    if sampled is None and options.samples:
        sampled = sampled_windows(model, windows, options.samples, options.prompt_tokens, options.seed)
    windows = list(windows) + list(sampled or ())
    layers = {name: _TunedLayer(m) for name, m in modules.items()}
    norms = {k: float_tensors.get(k, w).detach() for k, w in norm_weights(model).items()}
    norms0 = {k: w.float() for k, w in norms.items()}
    norm_offsets = {k: torch.zeros_like(w, requires_grad=True) for k, w in norms0.items()}
    params = [p for layer in layers.values() for p in layer.parameters()] + list(norm_offsets.values())
    optimizer = torch.optim.Adam(params, lr=options.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / options.steps)))
    fixed = {k: v for k, v in float_tensors.items() if k not in norms0}
    order = torch.Generator().manual_seed(options.seed)
    losses, kept = [], {}
    for _ in tqdm(range(options.steps), desc="tune", unit="step"):
        picks = _draw(order, text_windows, len(windows), options.windows_per_step)
        # the float model's log-probs, before the rounding hooks: the calibration text's kept once computed (each is
        # drawn many times), a sampled window's computed each time (they are many, each drawn a few times)
        targets = [kept[i] if i in kept else _teacher(model, windows[i]) for i in picks]
        kept.update({i: t for i, t in zip(picks, targets, strict=True) if i < text_windows})
        with _rounded_inputs(model, modules), torch.autocast("cpu", dtype=options.dtype,
                                                             enabled=options.dtype != torch.float32):
            weights = {f"{name}.weight": layer.dense() for name, layer in layers.items()}
            weights.update({k: norms0[k] * (1 + v) for k, v in norm_offsets.items()})
            weights.update(fixed)
            loss = sum(_kl(torch.func.functional_call(model, weights, (windows[i],)).logits[0, :-1], target)
                       for i, target in zip(picks, targets, strict=True)) / len(picks)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    tuned_norms = {k: (norms0[k] * (1 + v.detach())).to(norms[k].dtype) for k, v in norm_offsets.items()}
    return {name: layer.tuned() for name, layer in layers.items()}, {**float_tensors, **tuned_norms}, losses


def _draw(order: torch.Generator, text: int, total: int, count: int) -> list[int]:
    """One step's window indices: `count` of the `text` calibration windows when there are no others; with sampled
    windows (indices text..total-1) half of them (rounded up) from the calibration text and the rest sampled, so
    the real text stays in every step while the sampled windows add variety."""
    if total == text:
        return torch.randperm(text, generator=order)[:count].tolist()
    from_text = (count + 1) // 2
    return (torch.randperm(text, generator=order)[:from_text].tolist()
            + (text + torch.randperm(total - text, generator=order)[:count - from_text]).tolist())


@contextmanager
def _rounded_inputs(model: torch.nn.Module, modules: dict[str, QuantizedModule]):
    """While open, the layers of `modules` with an activation format round their inputs (_straight_through)."""
    named = dict(model.named_modules())
    hooks = [named[name].register_forward_pre_hook(_straight_through(m)) for name, m in modules.items()
             if m.input_activations is not None]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _straight_through(module: QuantizedModule):
    """A forward pre-hook that rounds the layer's inputs as its activation format does, with the straight-through
    estimator's gradient (identity) so the loss reaches the layers below."""
    spec = module.input_activations
    kept = None if module.outliers is None else module.outliers.columns

    def hook(_layer, args):
        x = args[0]
        return (x + (fake_quantize_inputs(x.detach(), spec, kept) - x.detach()),) + args[1:]

    return hook
