"""Sequential calibration (glmserve/quant/sequential.py) against plain references: the statistics each unit gets
equal collect_stats on a copy of the model whose earlier units (in execution order) hold the quantized weights;
the asymmetric (GPTAQ) cross Gram equals X~^T X from the two models' inputs; the float-output target is the
ridge least-squares solution and W itself when the served inputs are the float ones; the model is left
unchanged; `glmserve quantize --sequential [--asymmetric]` folders round trip and run on the reference backend as
the fake-quantized float model computes."""

from __future__ import annotations

import copy
import re

import pytest
import test_quant_scale_search
import torch
from test_quant_loading import _engine, _worst_error
from test_quantize_cli import _same_module, fake_quantized_model
from transformers import AutoModelForCausalLM

from glmserve.cli import main, run_quantize
from glmserve.errors import InvalidRequestError
from glmserve.layers.linear import QuantizedLinear
from glmserve.quant.calibrate import InputStats, collect_stats, linear_layers
from glmserve.quant.compressed_tensors import load_checkpoint
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize, fake_quantize_activations, fake_quantize_inputs
from glmserve.quant.schemes import FP8_TOKENS, scheme
from glmserve.quant.sensitivity import units
from glmserve.quant.sequential import Served, float_target, quantize_sequential

W4 = scheme("w4a16-asym").weight
tiny, calib = test_quant_scale_search.tiny, test_quant_scale_search.calib  # fixtures: the tiny llama, a calib file


def _model(tiny):
    return AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()


def _windows(n=3, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (1, length), generator=g) for _ in range(n)]


def _rtn(w):
    return dequantize(quantize(w.float(), W4))


def test_float_target_is_ridge_least_squares_and_w_when_inputs_are_float():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(400, 24, generator=g, dtype=torch.float64)
    # a systematic error of the served inputs (as quantized layers below leave), which weights can undo
    noisy = x + 0.1 * x @ torch.randn(24, 24, generator=g, dtype=torch.float64)
    w = torch.randn(10, 24, generator=g)
    same = InputStats.empty(24, cross=True)
    same.add(x, x)
    assert torch.allclose(float_target(w, same, 0.01), w, atol=1e-6)
    stats = InputStats.empty(24, cross=True)
    stats.add(noisy, x)
    damp = 1e-3
    v = float_target(w, stats, damp).double()
    # plain reference: argmin_V ||x W^T - noisy V^T||^2 / n + lam ||V - W||^2, lam = damp * mean diag(noisy^T noisy / n)
    n, lam = x.shape[0], damp * (noisy.square().sum(0) / x.shape[0]).mean()
    lhs = noisy.T @ noisy / n + lam * torch.eye(24, dtype=torch.float64)
    rhs = noisy.T @ x @ w.double().T / n + lam * w.double().T
    assert torch.allclose(v, torch.linalg.solve(lhs, rhs).T, atol=1e-5)
    out_err = lambda m: ((x @ w.double().T - noisy @ m.T) ** 2).mean().item()  # noqa: E731
    assert out_err(v) < 0.01 * out_err(w.double())
    with pytest.raises(ValueError, match="cross Gram"):
        float_target(w, InputStats.empty(24), 0.01)


def test_cross_gram_accumulates_and_rescales():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 5, 8, generator=g), torch.randn(10, 8, generator=g)
    s = InputStats.empty(8, cross=True)
    s.add(a, b)
    assert torch.allclose(s.cross, a.reshape(-1, 8).double().T @ b.double())
    scale = torch.rand(8, generator=g) + 0.5
    d = s.divided(scale)
    ref = (a.reshape(-1, 8) / scale).double().T @ (b / scale).double()
    assert torch.allclose(d.cross, ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(d.gram, s.gram / (scale[:, None] * scale).double(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cross Gram"):
        InputStats.empty(8).add(a, b)
    with pytest.raises(ValueError, match="cross Gram"):
        InputStats.empty(8, cross=True).add(a)


def test_fake_quantize_inputs_keeps_columns_out_of_rounding_and_scale():
    x = torch.randn(3, 7, 16)
    x[..., 4] *= 500.0
    kept = torch.tensor([4, 9])
    got = fake_quantize_inputs(x, FP8_TOKENS, kept)
    rest = [c for c in range(16) if c not in (4, 9)]
    assert torch.equal(got[..., kept], x[..., kept])
    assert torch.equal(got[..., rest], fake_quantize_activations(x[..., rest], FP8_TOKENS))
    assert torch.equal(fake_quantize_inputs(x, FP8_TOKENS, None), fake_quantize_activations(x, FP8_TOKENS))


@pytest.mark.parametrize("asymmetric", [False, True])
def test_each_unit_sees_the_model_quantized_before_it(tiny, asymmetric):
    """The driver's statistics for every unit equal collect_stats (plain hooks, one full forward per window) on a
    copy whose units before it hold the dense quantized weights; the cross Gram pairs them with the float model's
    inputs of the same layer."""
    model, windows = _model(tiny), _windows()
    names = [n for n in linear_layers(model) if n != "lm_head"]
    unit_list = units(names)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen, order = {}, []

    def step(unit, collect):
        seen[unit] = collect(list(unit), {})
        order.append(unit)
        return Served({n: _rtn(dict(model.named_modules())[n].weight) for n in unit}, {}, {})

    quantize_sequential(model, windows, unit_list, step, asymmetric=asymmetric)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # restored
    assert [u[0].rpartition(".")[2] for u in order[:4]] == ["q_proj", "o_proj", "gate_proj", "down_proj"]
    reference, float_model = _model(tiny), _model(tiny)
    ref_layers = dict(reference.named_modules())
    for unit in order:
        want = collect_stats(reference, windows, unit)
        got = seen[unit][unit[0]]
        assert got.tokens == want[unit[0]].tokens
        assert torch.allclose(got.gram, want[unit[0]].gram, rtol=1e-5, atol=1e-6), unit
        assert torch.allclose(got.absmax, want[unit[0]].absmax, rtol=1e-5, atol=1e-6)
        if asymmetric:  # sum over windows of X~^T X: served inputs (this copy) times the float model's
            xs, xf = [], []
            h1 = ref_layers[unit[0]].register_forward_pre_hook(lambda _m, a, xs=xs: xs.append(a[0][0]))
            h2 = dict(float_model.named_modules())[unit[0]].register_forward_pre_hook(
                lambda _m, a, xf=xf: xf.append(a[0][0]))
            with torch.no_grad():
                for ids in windows:
                    reference(ids)
                    float_model(ids)
            h1.remove()
            h2.remove()
            cross = sum(a.double().T @ b.double() for a, b in zip(xs, xf, strict=True))
            assert torch.allclose(got.cross, cross, rtol=1e-5, atol=1e-6), unit
        else:
            assert got.cross is None
        with torch.no_grad():
            for n in unit:
                ref_layers[n].weight.copy_(_rtn(ref_layers[n].weight))
    first = seen[order[0]][order[0][0]]
    if asymmetric:  # nothing quantized below the first unit: served inputs are the float ones
        assert torch.allclose(first.cross, first.gram)


def test_own_activation_rounding_is_in_the_statistics(tiny):
    model, windows = _model(tiny), _windows(2)
    unit = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")
    got = {}

    def step(u, collect):
        got[u] = collect(list(u), {n: FP8_TOKENS for n in u})
        return Served({}, {}, {})

    quantize_sequential(model, windows, [unit], step, asymmetric=True)
    xs = []
    h = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda _m, a: xs.append(a[0][0]))
    with torch.no_grad():
        for ids in windows:
            model(ids)
    h.remove()
    served = [fake_quantize_activations(x, FP8_TOKENS).double() for x in xs]
    stats = got[unit][unit[0]]
    assert torch.allclose(stats.gram, sum(s.T @ s for s in served), rtol=1e-6)
    assert torch.allclose(stats.cross, sum(s.T @ x.double() for s, x in zip(served, xs, strict=True)), rtol=1e-6)


@pytest.mark.parametrize("name, method, asymmetric", [("w4a16-asym", "gptq", False), ("w4a16", "awq-gptq", False),
                                                      ("w4a16-asym", "awq-gptq", True), ("fp8", "gptq", True)])
def test_sequential_folders_round_trip_and_run_on_the_reference_backend(tiny, tmp_path, calib, name, method,
                                                                        asymmetric, monkeypatch):
    monkeypatch.setenv("GLMSERVE_QUANT_BACKEND", "reference")
    out = tmp_path / "q"
    _, result = run_quantize(str(tiny), str(out), scheme=name, method=method, calib=[calib], seq_len=32,
                             scale_search=True, sequential=True, asymmetric=asymmetric)
    _, one_pass = run_quantize(str(tiny), str(tmp_path / "p"), scheme=name, method=method, calib=[calib],
                               seq_len=32, scale_search=True)
    _, modules, rest = load_checkpoint(out)
    assert set(modules) == set(result.modules) == set(one_pass.modules)
    for n in modules:
        _same_module(result.modules[n], modules[n])
    assert any(not torch.equal(result.modules[n].weight.codes, one_pass.modules[n].weight.codes) for n in modules)
    if method == "awq-gptq":  # AWQ's scales: norms rescaled in the folder
        assert set(result.float_tensors) <= set(rest) and result.float_tensors
    llm = _engine(out)
    assert any(isinstance(m, QuantizedLinear) for m in llm.engine.runner.model.modules())
    if scheme(name).activations is None:  # weight-only: the engine computes what the fake-quantized model does
        assert _worst_error(llm, fake_quantized_model(tiny, out), list(range(5, 30))) < 1e-4


def test_sequential_leaves_the_model_unchanged(tiny, tmp_path, calib):
    from glmserve.models.hf_float import load_float

    ckpt = load_float(str(tiny))
    before = copy.deepcopy(ckpt.model.state_dict())
    run_quantize(ckpt, str(tmp_path / "q"), scheme="w4a16-asym", method="awq-gptq", calib=[calib], seq_len=32,
                 sequential=True, asymmetric=True)
    assert all(torch.equal(before[k], v) for k, v in ckpt.model.state_dict().items())


def test_cli_flags_and_errors(tiny, tmp_path, calib, capsys):
    out = tmp_path / "q"
    main(["quantize", str(tiny), "--scheme", "w4a16-asym", "--method", "gptq", "--sequential", "--asymmetric",
          "--calib", calib, "--seq-len", "32", "--out", str(out)])
    assert "MiB in bf16" in capsys.readouterr().out
    assert load_checkpoint(out)[1]["model.layers.0.mlp.down_proj"].weight.spec == W4
    with pytest.raises(InvalidRequestError, match=re.escape("give --sequential and --method gptq")):
        run_quantize(str(tiny), str(tmp_path / "e"), scheme="w4a16", method="gptq", calib=[calib], seq_len=32,
                     asymmetric=True)
    with pytest.raises(InvalidRequestError, match=re.escape("give --sequential and --method gptq")):
        run_quantize(str(tiny), str(tmp_path / "e"), scheme="w4a16", method="awq", calib=[calib], seq_len=32,
                     sequential=True, asymmetric=True)
    with pytest.raises(InvalidRequestError, match="give --calib"):
        run_quantize(str(tiny), str(tmp_path / "e"), scheme="w4a16", sequential=True)


def test_awq_asymmetric_target_is_the_folded_weight_when_nothing_is_lost(tiny, calib, tmp_path, monkeypatch):
    """AWQ + GPTQ, sequential, asymmetric, with every unit served in float (its folded weight W s, no rounding):
    the served model computes the float function, so each unit's float-output target must be its folded weight
    itself, down_proj too, whose scales are folded into up_proj's rows before its statistics are taken (its
    float inputs must be put in the folded coordinates)."""
    from glmserve.quant import pipeline

    served, targets = {}, []
    original_unit, original_target = pipeline._quantize_unit, pipeline.float_target

    def unit(u, weights, *args):
        out = original_unit(u, weights, *args)
        served.update({id(out[n]): weights[n].clone() for n in u})
        return out

    def target(w, stats, damp):
        v = original_target(w, stats, damp)
        targets.append((w, v))
        return v

    monkeypatch.setattr(pipeline, "_quantize_unit", unit)
    monkeypatch.setattr(pipeline, "float_target", target)
    monkeypatch.setattr(pipeline, "dense_weight", lambda m: served[id(m)])
    _, result = run_quantize(str(tiny), str(tmp_path / "q"), scheme="w4a16-asym", method="awq-gptq",
                             calib=[calib], seq_len=32, sequential=True, asymmetric=True)
    model = _model(tiny)
    folded_down = [n for n in result.modules if n.endswith("down_proj")
                   and not torch.allclose(served[id(result.modules[n])], dict(model.named_modules())[n].weight)]
    assert folded_down  # AWQ rescaled some down_proj: the case under test is present
    assert len(targets) == len(result.modules)
    for w, v in targets:
        assert torch.allclose(v, w, rtol=1e-3, atol=1e-4 * w.abs().max().item())


def test_asymmetric_damp_is_the_target_ridge(tiny, calib, tmp_path, monkeypatch):
    """--asymmetric-damp reaches float_target (GPTQ's own damping unchanged); it needs --asymmetric."""
    from glmserve.quant import pipeline

    seen = []
    original = pipeline.float_target
    monkeypatch.setattr(pipeline, "float_target", lambda w, s, d: seen.append(d) or original(w, s, d))
    run_quantize(str(tiny), str(tmp_path / "q"), scheme="w4a16-asym", method="gptq", calib=[calib], seq_len=32,
                 sequential=True, asymmetric=True, asymmetric_damp=0.5)
    assert seen and set(seen) == {0.5}
    with pytest.raises(InvalidRequestError, match="give --asymmetric"):
        run_quantize(str(tiny), str(tmp_path / "e"), scheme="w4a16-asym", method="gptq", calib=[calib],
                     seq_len=32, sequential=True, asymmetric_damp=0.5)
