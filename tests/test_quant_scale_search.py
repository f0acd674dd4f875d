"""The scale search (glmserve/quant/scale_search.py): per (row, group) ranges chosen by weighted squared error, hand
checked on a group with an outlier, never worse than round to nearest on its objective, GPTQ keeping its scales
fixed, and `glmserve quantize --scale-search` end to end: folder written, read back equal, and run by the engine on
the reference backend as the fake-quantized float model computes; and bench/quant_quality.py's QuaRot R4 hook keeps
the model's function."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from test_quant_loading import _engine, _worst_error
from test_quantize_cli import CALIB, _same_module, fake_quantized_model
from transformers import AutoModelForCausalLM

from glmserve.cli import main, run_quantize
from glmserve.errors import InvalidRequestError
from glmserve.layers.linear import QuantizedLinear
from glmserve.quant.calibrate import gptq
from glmserve.quant.compressed_tensors import load_checkpoint
from glmserve.quant.quantize import FP8_MAX, quantize
from glmserve.quant.reference import dequantize
from glmserve.quant.scale_search import FP8_FACTORS, INT_FACTORS, search_quantize, supports
from glmserve.quant.schemes import scheme
from glmserve.quant.spec import QuantSpec

W4G32 = QuantSpec(4, "int", True, "group", group_size=32)
W4G32_ASYM = QuantSpec(4, "int", False, "group", group_size=32)
SPECS = [W4G32, W4G32_ASYM, QuantSpec(8, "int", True, "channel"), QuantSpec(8, "float", True, "channel"),
         QuantSpec(8, "float", True, "group", group_size=32),
         QuantSpec(8, "float", True, "block", block_structure=(64, 48))]


def _weighted_error(q, w, importance):
    return (((dequantize(q) - w) ** 2) * importance).sum(dim=1)


@pytest.mark.parametrize("spec", SPECS)
def test_search_never_loses_to_round_to_nearest_and_wins_overall(spec):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    w[:, 7] *= 8  # a few large weights per row: absmax wastes range on them
    importance = torch.rand(128) + 0.1
    q, rtn = search_quantize(w, spec, importance), quantize(w, spec)
    assert q.spec == spec and q.codes.dtype == rtn.codes.dtype and q.scales.shape == rtn.scales.shape
    if spec.strategy == "channel":  # one range per row: each row's own objective never worse
        assert (_weighted_error(q, w, importance) <= _weighted_error(rtn, w, importance) * (1 + 1e-6)).all()
    margin = 0.995 if spec.num_bits == 8 and spec.type == "int" else 0.97  # int8's grid is already fine
    assert _weighted_error(q, w, importance).sum() < margin * _weighted_error(rtn, w, importance).sum()
    # the codes are round to nearest under the chosen scales: re-rounding with them gives the same weight
    assert torch.equal(dequantize(q), dequantize(quantize(w, spec, shrink=_factors(q, rtn, spec))))


def _factors(q, rtn, spec):
    """The range factor of each group, recovered from the scales (asymmetric too: (hi - lo) scaled by f)."""
    f = q.scales.float() / rtn.scales.float()
    grid = torch.tensor(FP8_FACTORS if spec.type == "float" else INT_FACTORS)
    nearest = grid[(f.unsqueeze(-1) - grid).abs().argmin(dim=-1)]
    assert torch.allclose(nearest, f, rtol=1e-5), "every scale is absmax times a factor of the grid"
    if spec.strategy == "block":
        return nearest.unsqueeze(-1)
    return nearest.reshape(q.scales.shape[0], -1, 1)


def test_hand_checked_outlier_group():
    """int4 symmetric, one group: 31 weights at +-1 and one at 10. Absmax puts the step at 10/7, rounding every
    +-1 to +-1.43; with every weight equally important the search clips the outlier (a smaller step); when only
    the outlier's input matters it keeps absmax, which represents 10 exactly."""
    w = torch.tensor([[10.0] + [1.0, -1.0] * 15 + [1.0]])
    flat = search_quantize(w, W4G32)
    assert flat.scales.item() < 10 / 7 * 0.9
    assert _weighted_error(flat, w, torch.ones(32)) < _weighted_error(quantize(w, W4G32), w, torch.ones(32))
    only_outlier = torch.zeros(32)
    only_outlier[0] = 1.0
    kept = search_quantize(w, W4G32, only_outlier)
    assert kept.scales.item() == pytest.approx(10 / 7)
    assert dequantize(kept)[0, 0].item() == pytest.approx(10.0)


def test_fp8_scale_may_grow_beyond_absmax_without_clipping():
    """E4M3's error is relative: a scale above amax / 448 shifts the grid against the weights. 0.3 * 448 / 1.0625
    lies on no E4M3 value under absmax's scale; a factor 2^(k/32) > 1 puts it (nearly) on one."""
    torch.manual_seed(1)
    w = torch.randn(256, 64) * 0.02
    q = search_quantize(w, QuantSpec(8, "float", True, "channel"))
    grown = q.scales.float().squeeze(1) > w.abs().amax(dim=1) / FP8_MAX * (1 + 1e-6)
    assert grown.any()
    assert (dequantize(q).abs() <= w.abs().amax(dim=1, keepdim=True) * 1.07).all()  # nothing blown up


@pytest.mark.parametrize("spec", [scheme("nvfp4").weight, scheme("q4_0").weight,
                                  QuantSpec(8, "int", True, "tensor")])
def test_unsupported_formats_are_clear_errors(spec):
    assert not supports(spec)
    with pytest.raises(ValueError, match="scale search"):
        search_quantize(torch.randn(8, 64), spec)


def test_bad_importance_shape():
    with pytest.raises(ValueError, match="importance has shape"):
        search_quantize(torch.randn(8, 64), W4G32, torch.ones(32))


@pytest.mark.parametrize("spec", [W4G32_ASYM, QuantSpec(8, "float", True, "channel")])
def test_gptq_keeps_the_searched_scales_and_beats_them(spec):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    mix = torch.randn(16, 128) * torch.logspace(-0.5, 0.5, 128)
    x = torch.randn(3072, 16) @ mix + 0.1 * torch.randn(3072, 128)
    x_calib, x_test = x[:2048], x[2048:]
    hessian = (x_calib.double().T @ x_calib.double()) / len(x_calib)
    searched = search_quantize(w, spec, torch.diagonal(hessian).float())
    q = gptq(w, hessian, spec, initial=searched)
    assert torch.equal(q.scales, searched.scales)
    if q.zeros is not None:
        assert torch.equal(q.zeros, searched.zeros)

    def err(qw):
        return ((x_test @ dequantize(qw).T - x_test @ w.T) ** 2).mean().item()

    assert err(q) < 0.6 * err(searched)  # held-out samples
    with pytest.raises(ValueError, match="initial weight"):
        gptq(w, hessian, W4G32, initial=searched)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture
def calib(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(CALIB)
    return str(path)


@pytest.mark.parametrize("name, method", [("w4a16-asym", "rtn"), ("w4a16-asym", "gptq"), ("fp8-a16", "gptq"),
                                          ("w4a16", "awq-gptq")])
def test_scale_search_round_trips_and_runs_on_the_reference_backend(tiny, tmp_path, calib, name, method,
                                                                    monkeypatch):
    monkeypatch.setenv("GLMSERVE_QUANT_BACKEND", "reference")
    out = tmp_path / "q"
    _, result = run_quantize(str(tiny), str(out), scheme=name, method=method, calib=[calib], seq_len=32,
                             scale_search=True)
    _, plain = run_quantize(str(tiny), str(tmp_path / "plain"), scheme=name, method=method, calib=[calib],
                            seq_len=32)
    _, modules, _ = load_checkpoint(out)
    assert set(modules) == set(result.modules)
    for n in modules:
        _same_module(result.modules[n], modules[n])
    assert any(not torch.equal(result.modules[n].weight.scales, plain.modules[n].weight.scales) for n in modules)
    llm = _engine(out)
    assert any(isinstance(m, QuantizedLinear) for m in llm.engine.runner.model.modules())
    # weight-only: the engine's reference backend computes what the fake-quantized float model does
    assert _worst_error(llm, fake_quantized_model(tiny, out), list(range(5, 30))) < 1e-4


def test_cli_flag_and_errors(tiny, tmp_path, calib, capsys):
    out = tmp_path / "q"
    main(["quantize", str(tiny), "--scheme", "fp8-a16", "--scale-search", "--calib", calib, "--seq-len", "32",
          "--out", str(out)])
    assert "MiB in bf16" in capsys.readouterr().out
    _, modules, _ = load_checkpoint(out)
    w = modules["model.layers.0.mlp.down_proj"].weight
    assert w.spec == scheme("fp8-a16").weight
    with pytest.raises(InvalidRequestError, match=re.escape("does not combine with --method awq")):
        run_quantize(str(tiny), str(tmp_path / "e"), scheme="w4a16", method="awq", calib=[calib], seq_len=32,
                     scale_search=True)
    _, result = run_quantize(str(tiny), str(tmp_path / "n"), scheme="nvfp4", scale_search=True)
    assert any("keep round to nearest's scales" in n for n in result.notes)


def test_bench_online_down_rotation_keeps_the_function(tiny):
    """bench/quant_quality.py's QuaRot R4 evaluation: down_proj's weight W Q4 and input x Q4 give the same logits,
    and down_proj's weight really changed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import quant_quality

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    ids = torch.tensor([[0, 5, 17, 42, 99, 7, 3, 250]])
    down = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        before, w = model(ids).logits, down.weight.detach().clone()
        quant_quality._online_down_rotation(model)
        after = model(ids).logits
    assert not torch.allclose(down.weight, w, atol=1e-3)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
