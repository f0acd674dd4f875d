"""GPTQ and AWQ on real activations: layers of the embedded SmolLM2-135M, calibrated on bench/data/calib_*.txt (all
of it, ~8K tokens) and judged on the output error for held-out text's activations (bench/data/heldout_*.txt, ~7.7K
tokens), against round to nearest. Slow: it loads the model and runs its first two decoder layers on ~16K tokens.
(With 1,024 calibration tokens, fewer than down_proj's 1,536 inputs, GPTQ at 1% damping is no better than round to
nearest on held-out activations: it fits the calibration tokens' null space.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glmserve.quant import awq
from glmserve.quant.calibrate import InputStats, gptq
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize
from glmserve.quant.spec import QuantSpec

DATA = Path(__file__).resolve().parent.parent / "bench" / "data"
LAYERS = ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.down_proj")


class _Stop(Exception):
    pass


@pytest.fixture(scope="module")
def smollm2_stats():
    """(float weights, calibration stats, held-out stats) of LAYERS: up to 4,096 tokens per language (English and
    Chinese) of each text; the forward stops after decoder layer 1."""
    from glmserve.models.hf_float import load_float
    from glmserve.quant.perplexity import token_windows

    ckpt = load_float("default")
    model = ckpt.model
    modules = dict(model.named_modules())
    stop = model.model.layers[2].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(_Stop()))

    def stats(kind: str) -> dict[str, InputStats]:
        out = {n: InputStats.empty(modules[n].in_features) for n in LAYERS}
        hooks = [modules[n].register_forward_pre_hook(lambda _m, a, n=n: out[n].add(a[0])) for n in LAYERS]
        try:
            for lang in ("en", "zh"):
                text = (DATA / f"{kind}_{lang}.txt").read_text(encoding="utf-8")
                for ids in token_windows(ckpt.tokenizer, text, 512, 4096):
                    with torch.no_grad(), pytest.raises(_Stop):
                        model(ids)
        finally:
            for h in hooks:
                h.remove()
        return out

    try:
        return {n: modules[n].weight.detach().clone() for n in LAYERS}, stats("calib"), stats("heldout")
    finally:
        stop.remove()


def _error(w: torch.Tensor, wq: torch.Tensor, held: InputStats) -> float:
    return awq.output_error(wq - w, held.hessian.float()) / awq.output_error(w, held.hessian.float())


@pytest.mark.slow
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("layer", LAYERS)
def test_calibrated_w4_beats_rtn_on_held_out_smollm2_activations(smollm2_stats, layer, symmetric):
    weights, calib, held = smollm2_stats
    spec = QuantSpec(4, "int", symmetric, "group", group_size=32)
    w, c, h = weights[layer], calib[layer], held[layer]
    rtn = _error(w, dequantize(quantize(w, spec)), h)
    g = _error(w, dequantize(gptq(w, c.hessian, spec)), h)
    s = awq.search_scale([w], c.hessian, c.absmean, spec)
    a = _error(w, dequantize(awq.clip_quantize(w * s, c.hessian, spec)) / s, h)
    assert g < 0.6 * rtn, (g, rtn)  # measured 0.47-0.51x
    assert a < 0.9 * rtn, (a, rtn)  # measured 0.72-0.83x
