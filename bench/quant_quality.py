"""Quantization quality, side by side in one run: the float model vs every weight format `glmserve quantize` writes
(round to nearest, GPTQ, AWQ, SmoothQuant, mixed by measured sensitivity at a bits budget, the seeds' recipe), plus
llama.cpp's Q8_0 rounding. Each compressed-tensors configuration is written as a folder, read back, and run in the
float model with the reference backend's arithmetic: its layers' weights dequantized (outlier columns restored), the
float tensors it stores (norms, which AWQ rescales) loaded, and activations fake-quantized where the scheme
quantizes them (W8A8's int8 tokens, FP8's E4M3 tokens; input channels whose weight columns a recipe keeps in float
are left out of that rounding, as LLM.int8()'s decomposition computes them). The engine's own kernels (cpu_block's
int8 activation blocks) are not in these numbers: bench/bench_quality.py measures through the server.

Reported per configuration, on the calibration text (what GPTQ/AWQ/sensitivity saw) and on held-out text:
perplexity, its increase over float32, and the mean KL divergence KL(float || quantized) of the next-token
distributions. Weight memory: quantized layers at their bits per weight with 16-bit scales, everything else
(embeddings, norms, outlier columns) at 16 bits, vs all of it in bf16.

  PYTHONPATH=. python bench/quant_quality.py --calib bench/data/calib_en.txt bench/data/calib_zh.txt \\
      --heldout bench/data/heldout_en.txt bench/data/heldout_zh.txt

`--rotate KIND` first rotates the float model's residual stream (glmserve/quant/rotate.py: norms folded, lm_head
untied, QuaRot's R1): the rotated float model is then the reference of every row (its own row reports its
perplexity and KL against the unrotated float, equal to float rounding), and the rows quantize the rotated weights,
which no longer lie on the GGUF's Q4_1 grid. "below bf16" stays against the shipped (tied) model in bf16.

`--perturb SIGMA` adds seeded Gaussian noise of SIGMA times each 32-block's Q4_1 step ((max - min) / 15) to every
linear weight but lm_head, so that its weights lie on no 4-bit grid (tied embeddings are untouched): that perturbed
float model is then the reference of every row (its own row reports its perplexity and KL against the embedded
model), like the rotated one. Unlike --rotate it changes the function; unlike it, it keeps the weights' layout (no
folded norms, no Hadamard-mixed inputs), so round to nearest meets the model's own outlier structure.

`--online-down-rotation` (with --rotate) adds QuaRot's R4 as an evaluation only: every down_proj's input x becomes
x Q4 (a randomized Hadamard of the intermediate size, in a forward pre-hook: an online rotation, here a dense matmul
where an engine would run a fast Hadamard transform) and its weight W Q4, so the float model computes the same
function; calibration and every row then see the rotated down_proj inputs. The engine does not run this rotation:
these rows are not servable folders.

On a shared, loaded machine keep `--threads 1`: GPTQ's column loop is thousands of small ops, and with 2 threads
on oversubscribed cores (load average 13 on 2 cores) one 576x576 GPTQ layer took 55 s, against 3.3 s on one
thread run right before it.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from glmserve.cli import run_quantize
from glmserve.models.hf_float import load_float
from glmserve.quant.calibrate import collect_stats, linear_layers
from glmserve.quant.compressed_tensors import dense_weight, load_checkpoint
from glmserve.quant.perplexity import token_windows
from glmserve.quant.pipeline import bits_per_weight, scheme_specs, weight_bytes
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize, fake_quantize_inputs
from glmserve.quant.rotate import KINDS, rotate_model, rotation
from glmserve.quant.schemes import scheme
from glmserve.quant.tune import TuneOptions, sampled_windows, tune

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "int8": dict(scheme="int8"),
    "int8-g64": dict(scheme="int8-g64"),
    "int8-g32": dict(scheme="int8-g32"),
    "gptq-int8": dict(scheme="int8", method="gptq"),
    "awq-int8": dict(scheme="int8", method="awq"),  # AWQ's scales and clipping on per-channel int8
    "q8_0": dict(gguf="q8_0"),  # llama.cpp's rounding, not a compressed-tensors format: applied in memory
    "w8a8": dict(scheme="w8a8"),
    # SmoothQuant (Xiao et al. 2022) at the paper's alpha 0.5 and at 0.8 (its choice for some models)
    "w8a8-sq": dict(scheme="w8a8", smooth=0.5),
    "w8a8-sq0.8": dict(scheme="w8a8", smooth=0.8),
    "gptq-w8a8-sq": dict(scheme="w8a8", smooth=0.5, method="gptq"),
    "fp8": dict(scheme="fp8"),
    "fp8-sq": dict(scheme="fp8", smooth=0.5),
    "gptq-fp8": dict(scheme="fp8", method="gptq"),
    "gptq-fp8-sq": dict(scheme="fp8", smooth=0.5, method="gptq"),
    "fp8-a16": dict(scheme="fp8-a16"),  # FP8 weights only
    "fp8-block": dict(scheme="fp8-block"),
    # DeepSeek-V3's fine-grained FP8: 128x128 weight blocks, activations per 1x128 tile
    "fp8-block-g128": dict(scheme="fp8-block-g128"),
    "gptq-fp8-block-g128": dict(scheme="fp8-block-g128", method="gptq"),
    # the scale search (-ss: each (row, group)'s range by Hessian-diagonal-weighted MSE, quant/scale_search.py),
    # alone and as GPTQ's fixed grid; GPTQ on FP8 weights only and with E4M3 tokens; damping alternatives
    "fp8-a16-ss": dict(scheme="fp8-a16", scale_search=True),
    "fp8-ss": dict(scheme="fp8", scale_search=True),
    "gptq-fp8-a16": dict(scheme="fp8-a16", method="gptq"),
    "gptq-fp8-a16-ss": dict(scheme="fp8-a16", method="gptq", scale_search=True),
    "gptq-fp8-a16-ss-d0.1": dict(scheme="fp8-a16", method="gptq", scale_search=True, gptq_damp=0.1),
    "gptq-fp8-ss": dict(scheme="fp8", method="gptq", scale_search=True),
    "gptq-fp8-block-g128-ss": dict(scheme="fp8-block-g128", method="gptq", scale_search=True),
    "rtn-w4a16-asym-ss": dict(scheme="w4a16-asym", scale_search=True),
    "gptq-w4a16-asym-ss": dict(scheme="w4a16-asym", method="gptq", scale_search=True),
    "gptq-w4a16-asym-ss-d0.1": dict(scheme="w4a16-asym", method="gptq", scale_search=True, gptq_damp=0.1),
    "awq-gptq-w4a16-asym-ss": dict(scheme="w4a16-asym", method="awq-gptq", scale_search=True),
    # sequential calibration (seq-: each decoder layer's statistics from the model quantized below it, sublayer by
    # sublayer) and its asymmetric target (seqa-: GPTQ fits the float model's output, GPTAQ); quant/sequential.py
    "seq-gptq-w4a16-asym-ss": dict(scheme="w4a16-asym", method="gptq", scale_search=True, sequential=True),
    "seq-awq-gptq-w4a16-asym-ss": dict(scheme="w4a16-asym", method="awq-gptq", scale_search=True, sequential=True),
    "seqa-gptq-w4a16-asym-ss": dict(scheme="w4a16-asym", method="gptq", scale_search=True, sequential=True,
                                    asymmetric=True),
    "seqa-awq-gptq-w4a16-asym-ss": dict(scheme="w4a16-asym", method="awq-gptq", scale_search=True, sequential=True,
                                        asymmetric=True),
    "seq-gptq-fp8-block-g128-ss": dict(scheme="fp8-block-g128", method="gptq", scale_search=True, sequential=True),
    "seqa-gptq-fp8-block-g128-ss": dict(scheme="fp8-block-g128", method="gptq", scale_search=True, sequential=True,
                                        asymmetric=True),
    # the float target's ridge at 10x, 100x and 1,000x GPTQ's 1% (--asymmetric-damp)
    "seqa-gptq-fp8-block-g128-ss-t0.1": dict(scheme="fp8-block-g128", method="gptq", scale_search=True,
                                             sequential=True, asymmetric=True, asymmetric_damp=0.1),
    "seqa-gptq-fp8-block-g128-ss-t1": dict(scheme="fp8-block-g128", method="gptq", scale_search=True,
                                           sequential=True, asymmetric=True, asymmetric_damp=1.0),
    "seqa-gptq-fp8-g16-ss-t1": dict(scheme="fp8-g16", method="gptq", scale_search=True, sequential=True,
                                    asymmetric=True, asymmetric_damp=1.0),
    "seq-gptq-fp8-g16-ss": dict(scheme="fp8-g16", method="gptq", scale_search=True, sequential=True),
    # the W4 float target's ridge F (--asymmetric-damp) at 0.1, 1, 3, 10 and 30 times the mean Hessian diagonal
    **{f"seqa-awq-gptq-w4a16-asym-ss-t{f:g}": dict(scheme="w4a16-asym", method="awq-gptq", scale_search=True,
                                                  sequential=True, asymmetric=True, asymmetric_damp=f)
       for f in (0.1, 1.0, 3.0, 10.0, 30.0)},
    "seqa-gptq-fp8-ss": dict(scheme="fp8", method="gptq", scale_search=True, sequential=True, asymmetric=True),
    "seqa-gptq-fp8-a16-ss": dict(scheme="fp8-a16", method="gptq", scale_search=True, sequential=True,
                                 asymmetric=True),
    # per-channel E4M3 weights, E4M3 activations per 1 x 32 / 1 x 16 tile (schemes fp8-g32, fp8-g16)
    "gptq-fp8-g32-ss": dict(scheme="fp8-g32", method="gptq", scale_search=True),
    "gptq-fp8-g16-ss": dict(scheme="fp8-g16", method="gptq", scale_search=True),
    "seqa-gptq-fp8-g32-ss": dict(scheme="fp8-g32", method="gptq", scale_search=True, sequential=True,
                                 asymmetric=True),
    "seqa-gptq-fp8-g16-ss": dict(scheme="fp8-g16", method="gptq", scale_search=True, sequential=True,
                                 asymmetric=True),
    # W4 g32 with a float16 minimum per group (w4a16-fmin: w = s * q + m, GGUF Q4_1's form) beside the integer zero
    # point's rows: on the unrotated model (every linear weight Q4_1 dequantized) round to nearest reproduces the
    # source grid, so only the rotated (--rotate) or perturbed (--perturb) model measures a genuine 4-bit rounding
    "rtn-w4a16-fmin": dict(scheme="w4a16-fmin"),
    "rtn-w4a16-fmin-ss": dict(scheme="w4a16-fmin", scale_search=True),
    "gptq-w4a16-fmin-ss": dict(scheme="w4a16-fmin", method="gptq", scale_search=True),
    "awq-gptq-w4a16-fmin-ss": dict(scheme="w4a16-fmin", method="awq-gptq", scale_search=True),
    "seqa-awq-gptq-w4a16-fmin-ss-t10": dict(scheme="w4a16-fmin", method="awq-gptq", scale_search=True,
                                            sequential=True, asymmetric=True, asymmetric_damp=10.0),
    "nvfp4": dict(scheme="nvfp4"),
    "rtn-w4a16": dict(scheme="w4a16"),
    "rtn-w4a16-asym": dict(scheme="w4a16-asym"),
    "rtn-w4a16-g64": dict(scheme="w4a16-g64"),
    "rtn-w4a16-asym-g64": dict(scheme="w4a16-asym-g64"),
    "gptq-w4a16": dict(scheme="w4a16", method="gptq"),
    "gptq-w4a16-asym": dict(scheme="w4a16-asym", method="gptq"),
    "gptq-w4a16-asym-d0.1": dict(scheme="w4a16-asym", method="gptq", gptq_damp=0.1),
    "awq-w4a16": dict(scheme="w4a16", method="awq"),
    "awq-w4a16-asym": dict(scheme="w4a16-asym", method="awq"),
    "awq-gptq-w4a16-asym": dict(scheme="w4a16-asym", method="awq-gptq"),
    # the budget of uniform w4a16 (sym g32, 4.5 bits): compare with the rtn-w4a16 row and the best uniform row
    # at or below it (rtn-w4a16-asym-g64, 4.31 bits)
    "mixed-sensitivity": dict(bits_budget="w4a16", candidates="w4a16-asym-g64,w4a16-asym,int8",
                              sensitivity="fisher"),
    "seeds-recipe": dict(recipe=str(ROOT / "examples/quant/seeds_mixed.yaml")),
    "gptq-seeds-recipe": dict(recipe=str(ROOT / "examples/quant/seeds_mixed.yaml"), method="gptq"),
    "gptq-seeds-recipe-budget": dict(recipe=str(ROOT / "examples/quant/seeds_mixed_budget.yaml"), method="gptq"),
    "seeds-recipe-sq": dict(recipe=str(ROOT / "examples/quant/seeds_mixed.yaml"), smooth=0.5),
}


def _windows(tokenizer, files: list[str], seq_len: int, tokens: int):
    """An equal share of `tokens` from each file (English and Chinese)."""
    return [w for f in files for w in token_windows(tokenizer, Path(f).read_text(encoding="utf-8"), seq_len,
                                                     tokens // len(files))]


@torch.no_grad()
def _evaluate(model: torch.nn.Module, windows, reference: list[torch.Tensor] | None, keep: bool = False):
    """(perplexity, mean KL(reference || model) per predicted token or None, the log-probs in float16 (with a
    reference, only if `keep`; else None))."""
    nll, kl, count, logprobs = 0.0, 0.0, 0, []
    for i, ids in enumerate(windows):
        lp = F.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        nll -= lp.gather(1, ids[0, 1:, None]).sum().item()
        count += ids.shape[1] - 1
        if reference is None or keep:
            logprobs.append(lp.half())
        if reference is not None:
            ref = reference[i].float()
            kl += (ref.exp() * (ref - lp)).sum().item()
    return math.exp(nll / count), None if reference is None else kl / count, logprobs or None


class _Applied:
    """The float model running a configuration's weights (and activation rounding) until exit."""

    def __init__(self, model: torch.nn.Module, weights: dict[str, torch.Tensor], activations: dict,
                 float_tensors: dict[str, torch.Tensor], kept: dict[str, torch.Tensor] | None = None):
        self.model, self.weights, self.activations, self.float_tensors = model, weights, activations, float_tensors
        self.kept = kept or {}  # layer -> input columns kept in float (outlier columns): not rounded either

    def __enter__(self):
        layers = dict(self.model.named_modules())
        state = self.model.state_dict()
        self.saved = {n: layers[n].weight.data for n in self.weights}
        self.saved_float = {k: state[k].clone() for k in self.float_tensors if k in state}
        for n, w in self.weights.items():
            layers[n].weight.data = w
        self.model.load_state_dict({k: v for k, v in self.float_tensors.items() if k in state}, strict=False)
        self.hooks = [layers[n].register_forward_pre_hook(
            lambda _m, args, spec=spec, kept=self.kept.get(n): (fake_quantize_inputs(args[0], spec, kept),) + args[1:])
            for n, spec in self.activations.items() if spec is not None]
        return self

    def __exit__(self, *exc):
        layers = dict(self.model.named_modules())
        for h in self.hooks:
            h.remove()
        for n, w in self.saved.items():
            layers[n].weight.data = w
        self.model.load_state_dict(self.saved_float, strict=False)


def _run(ckpt, options: dict, args, stats: dict, hidden: int):
    """(_Applied context, pipeline Result or None, GGUF spec or None, the folder's (modules, float tensors) or
    None) of one configuration; writes and reads back its folder. `stats`: calibration statistics shared by the
    configurations (collected on first use)."""
    if "gguf" in options:
        spec = scheme(options["gguf"]).weight
        layers = {n: m for n, m in linear_layers(ckpt.model).items() if n != "lm_head"}
        weights = {n: dequantize(quantize(m.weight.data, spec)) for n, m in layers.items()}
        return _Applied(ckpt.model, weights, {}, {}), None, spec, None
    options = dict(options)
    if "bits_budget" in options:
        options["bits_budget"] = bits_per_weight(scheme_specs(options["bits_budget"])[0], hidden)
    if not stats and not options.get("sequential"):  # sequential calibration collects its own, layer by layer
        windows = _windows(ckpt.tokenizer, args.calib, args.seq_len, args.calib_tokens)
        names = [n for n in linear_layers(ckpt.model) if n != "lm_head"]
        stats.update(collect_stats(ckpt.model, windows, names))
    with tempfile.TemporaryDirectory() as out:
        _, result = run_quantize(ckpt, out, calib=args.calib, calib_tokens=args.calib_tokens, seq_len=args.seq_len,
                                 stats=stats, **options)
        _, modules, rest = load_checkpoint(Path(out))
    return _applied(ckpt.model, modules, rest), result, None, (modules, rest)


def _applied(model: torch.nn.Module, modules: dict, rest: dict[str, torch.Tensor]) -> _Applied:
    """The float model running a checkpoint's modules and float tensors."""
    weights = {n: dense_weight(m) for n, m in modules.items()}
    kept = {n: m.outliers.columns for n, m in modules.items() if m.outliers is not None}
    return _Applied(model, weights, {n: m.input_activations for n, m in modules.items()}, rest, kept)


@torch.no_grad()
def _online_down_rotation(model: torch.nn.Module, seed: int = 1) -> None:
    """QuaRot's R4 (arXiv 2404.00456, section 4: the online Hadamard before down_proj) on every down_proj: weight
    W -> W Q4 and input x -> x Q4 in a pre-hook, Q4 orthogonal, so x Q4 (W Q4)^T = x W^T."""
    for name, m in linear_layers(model).items():
        if name.endswith("mlp.down_proj"):
            q4 = rotation(m.in_features, "auto", seed).float()
            m.weight.data = (m.weight.data.double() @ q4.double()).float()
            m.register_forward_pre_hook(lambda _m, args, q4=q4: (args[0] @ q4,) + args[1:])


@torch.no_grad()
def _perturb(model: torch.nn.Module, sigma: float, seed: int = 0) -> None:
    """Every linear layer but lm_head moved off its 4-bit source grid: w += sigma * d * N(0, 1), d = (max - min)
    / 15 of each row's block of 32 inputs (the Q4_1 step it was stored with), seeded."""
    g = torch.Generator().manual_seed(seed)
    for name, m in linear_layers(model).items():
        if name == "lm_head":
            continue
        w = m.weight.data
        blocks = w.float().reshape(w.shape[0], -1, 32)
        step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
        noise = torch.randn(blocks.shape, generator=g) * step * sigma
        m.weight.data = (blocks + noise).reshape(w.shape).to(w.dtype)


def _row(name: str, applied: _Applied, result, gguf_spec, model: torch.nn.Module, evals: dict, reference: dict,
         base: dict, bf16: float, t0: float) -> dict:
    """One configuration's row: perplexity, increase and KL on each evaluation set, weight memory; printed."""
    ppl, kl = {}, {}
    with applied:
        for k, ws in evals.items():
            ppl[k], kl[k], _ = _evaluate(model, ws, reference[k])
    if result is None:  # a GGUF block format on every linear layer
        layers = {n: m for n, m in linear_layers(model).items() if n != "lm_head"}
        served = bf16 - sum(m.weight.numel() * (2 - bits_per_weight(gguf_spec, m.in_features) / 8)
                            for m in layers.values())
        counts, notes = {gguf_spec.gguf_type: len(layers)}, []
    else:
        served, _ = weight_bytes(model, result)
        counts, notes = {}, result.notes
        for s in result.schemes.values():
            counts[s] = counts.get(s, 0) + 1
    row = {"config": name, "ppl": ppl, "increase": {k: ppl[k] / base[k] - 1 for k in ppl}, "kl": kl,
           "weights_mib": served / 2**20, "vs_bf16": 1 - served / bf16, "layers": counts,
           "seconds": time.time() - t0, "notes": notes}
    print(f"{name}: calib ppl {ppl['calib']:.3f} ({row['increase']['calib']:+.2%}), held-out ppl "
          f"{ppl['heldout']:.3f} ({row['increase']['heldout']:+.2%}, KL {kl['heldout']:.4f}, calib KL "
          f"{kl['calib']:.4f}), weights "
          f"{row['weights_mib']:.1f} MiB ({row['vs_bf16']:.1%} below bf16), layers {counts}, "
          f"{row['seconds']:.0f} s", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--calib", nargs="+", required=True)
    p.add_argument("--heldout", nargs="+", required=True)
    p.add_argument("--calib-eval", nargs="+", default=None, help="the text of the \"calib ppl\" column (default: "
                   "--calib); lets extra calibration files join --calib while that column stays comparable")
    p.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens (GPTQ, AWQ, outlier "
                   "channels, Fisher sensitivity), an equal share from each file")
    p.add_argument("--eval-tokens", type=int, default=2048, help="tokens of each evaluation set")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--rotate", default=None, choices=KINDS, help="rotate the residual stream first; the rotated "
                   "float model is the reference")
    p.add_argument("--perturb", type=float, default=None, metavar="SIGMA", help="add Gaussian noise of SIGMA "
                   "Q4_1 steps to every linear weight but lm_head (after --rotate, if given); the perturbed float "
                   "model is the reference (see the docstring)")
    p.add_argument("--online-down-rotation", action="store_true", help="with --rotate: also QuaRot's R4, an online "
                   "Hadamard on every down_proj input (evaluation only; see the docstring)")
    p.add_argument("--tune-steps", type=int, default=0, metavar="N", help="also report each configuration tuned "
                   "end to end for N steps on the calibration windows (quant/tune.py; row name CONFIG+tuneN), from "
                   "the same quantization")
    p.add_argument("--tune-lr", type=float, default=1e-3)
    p.add_argument("--tune-samples", type=int, default=0, metavar="N", help="tune on N more windows the float "
                   "model writes after pieces of the calibration text (row name CONFIG+tuneN+sampledN)")
    p.add_argument("--tune-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    if args.online_down_rotation and not args.rotate:
        p.error("--online-down-rotation goes with --rotate")
    torch.set_num_threads(args.threads)
    ckpt = load_float(args.model)
    evals = {"calib": _windows(ckpt.tokenizer, args.calib_eval or args.calib, args.seq_len, args.eval_tokens),
             "heldout": _windows(ckpt.tokenizer, args.heldout, args.seq_len, args.eval_tokens)}
    t0 = time.time()
    base, reference = {}, {}
    for k, ws in evals.items():
        base[k], _, reference[k] = _evaluate(ckpt.model, ws, None)
    _, bf16 = weight_bytes(ckpt.model, None)
    rows = [{"config": "float32", "ppl": base, "increase": {k: 0.0 for k in base}, "kl": {k: 0.0 for k in base},
             "weights_mib": bf16 / 2**20, "vs_bf16": 0.0, "seconds": time.time() - t0}]
    print(f"float32: ppl {base} ({ {k: sum(w.shape[1] for w in ws) for k, ws in evals.items()} } tokens)", flush=True)
    if args.rotate or args.perturb:
        t0 = time.time()
        label = []
        if args.rotate:
            rotate_model(ckpt.model, args.rotate)
            label.append(f"rotated-{args.rotate}" + ("-r4" if args.online_down_rotation else ""))
            if args.online_down_rotation:
                _online_down_rotation(ckpt.model)
        if args.perturb:
            _perturb(ckpt.model, args.perturb)
            label.append(f"perturbed-{args.perturb:g}")
        changed, kl, logprobs = {}, {}, {}
        for k, ws in evals.items():
            changed[k], kl[k], logprobs[k] = _evaluate(ckpt.model, ws, reference[k], keep=True)
        served, _ = weight_bytes(ckpt.model, None)
        rows.append({"config": "float32-" + "-".join(label), "ppl": changed,
                     "increase": {k: changed[k] / base[k] - 1 for k in base}, "kl": kl, "weights_mib": served / 2**20,
                     "vs_bf16": 1 - served / bf16, "seconds": time.time() - t0})
        print(f"float32 {' '.join(label)}: ppl {changed}, vs the embedded model "
              f"{ {k: f'{changed[k] / base[k] - 1:+.2e}' for k in base} }, KL {kl}", flush=True)
        base, reference = changed, logprobs  # every row below is measured against this float model
    hidden = ckpt.model.config.hidden_size
    stats: dict = {}
    calib = _windows(ckpt.tokenizer, args.calib, args.seq_len, args.calib_tokens) if args.tune_steps else None
    options = TuneOptions(steps=args.tune_steps, lr=args.tune_lr, dtype=getattr(torch, args.tune_dtype),
                          samples=args.tune_samples)
    # written once: every configuration is tuned on the same samples of the float model
    sampled = sampled_windows(ckpt.model, calib, options.samples, options.prompt_tokens, options.seed) \
        if calib and options.samples else None
    for name in args.configs.split(","):
        t0 = time.time()
        applied, result, gguf_spec, folder = _run(ckpt, CONFIGS[name], args, stats, hidden)
        rows.append(_row(name, applied, result, gguf_spec, ckpt.model, evals, reference, base, bf16, t0))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        if calib is None or folder is None:
            continue
        t0 = time.time()  # the same quantization tuned end to end (quant/tune.py) on the calibration windows
        modules, rest, losses = tune(ckpt.model, *folder, calib, options, sampled)
        tuned = f"{name}+tune{args.tune_steps}" + (f"+sampled{args.tune_samples}" if args.tune_samples else "")
        row = _row(tuned, _applied(ckpt.model, modules, rest), result, gguf_spec,
                   ckpt.model, evals, reference, base, bf16, t0)
        row["tune_losses"] = losses
        rows.append(row)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
    print("\n| config | calib ppl | vs float32 | held-out ppl | vs float32 | KL held-out | KL calib | weight MiB | "
          "below bf16 |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['ppl']['calib']:.3f} | {r['increase']['calib']:+.2%} | "
              f"{r['ppl']['heldout']:.3f} | {r['increase']['heldout']:+.2%} | {r['kl']['heldout']:.4f} | "
              f"{r['kl']['calib']:.4f} | "
              f"{r['weights_mib']:.1f} | {r['vs_bf16']:.1%} |")


if __name__ == "__main__":
    main()
