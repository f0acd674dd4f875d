"""End-to-end tuning (glmserve/quant/tune.py) on a tiny random-weight llama: the KL to the float model on the
calibration windows falls while every code, zero point and stored dtype stays; activation rounding (W8A8's) passes
gradients straight through; NVFP4's float8 scales step between float8 values; the float model is left
unchanged; windows the float model writes continue pieces of the calibration windows, the same for the same seed,
and tuning with them is tuning on them; `glmserve quantize --tune-steps` folders round trip and run on the engine as
the fake-quantized float model computes; bad settings are refused."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import test_quant_scale_search
import torch
import torch.nn.functional as F
from test_quant_loading import _engine, _worst_error
from test_quant_sequential import _model, _windows
from test_quantize_cli import _same_module, fake_quantized_model

import glmserve.quant.tune as tune_module
from glmserve.cli import main, run_quantize
from glmserve.errors import InvalidRequestError
from glmserve.quant.compressed_tensors import dense_weight, load_checkpoint
from glmserve.quant.pipeline import Plan, quantize_model
from glmserve.quant.recipe import uniform
from glmserve.quant.reference import fake_quantize_inputs
from glmserve.quant.schemes import scheme
from glmserve.quant.tune import TuneOptions, _draw, _straight_through, norm_weights, sampled_windows, tune

tiny, calib = test_quant_scale_search.tiny, test_quant_scale_search.calib  # fixtures: the tiny llama, a calib file


@torch.no_grad()
def _kl(model, modules, tensors, windows) -> float:
    """Mean KL(float || quantized) per token: the float model against itself with the modules' dense weights,
    `tensors` (norms) and each layer's activation rounding, in float32."""
    named = dict(model.named_modules())
    hooks = [named[n].register_forward_pre_hook(
        lambda _m, args, m=m: (fake_quantize_inputs(args[0], m.input_activations, None),) + args[1:])
        for n, m in modules.items() if m.input_activations is not None]
    weights = {f"{n}.weight": dense_weight(m) for n, m in modules.items()} | dict(tensors)
    total, count = 0.0, 0
    try:
        for ids in windows:
            ref = F.log_softmax(model(ids).logits[0], -1)
            got = F.log_softmax(torch.func.functional_call(model, weights, (ids,)).logits[0], -1)
            total += (ref.exp() * (ref - got)).sum().item()
            count += ids.shape[1]
    finally:
        for h in hooks:
            h.remove()
    return total / count


# bfloat16 compute where the format's KL is far above bfloat16's own error; int8's is not (float32, and a
# learning rate for changes of about its rounding's relative size)
@pytest.mark.parametrize(("name", "dtype", "lr"), [
    ("w4a16-asym", torch.bfloat16, 1e-2), ("w4a16-fmin", torch.bfloat16, 1e-2), ("int8-g32", torch.float32, 1e-3),
    ("fp8-a16", torch.bfloat16, 3e-3), ("nvfp4", torch.bfloat16, 1e-2)])
def test_tuning_lowers_the_kl_and_keeps_the_codes(tiny, name, dtype, lr):
    model = _model(tiny)
    before_state = copy.deepcopy(model.state_dict())
    windows = _windows(n=4, length=32)
    result = quantize_model(model, Plan(recipe=uniform(name)), windows)
    tuned, tensors, losses = tune(model, result.modules, result.float_tensors, windows,
                                  TuneOptions(steps=25, lr=lr, windows_per_step=2, dtype=dtype))
    assert len(losses) == 25
    untuned_kl = _kl(model, result.modules, result.float_tensors, windows)
    tuned_kl = _kl(model, tuned, tensors, windows)
    assert tuned_kl < 0.8 * untuned_kl, (untuned_kl, tuned_kl)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before_state.values(), strict=True))
    assert set(tensors) == set(norm_weights(model))
    assert any(not torch.equal(tensors[k], w) for k, w in norm_weights(model).items())
    moved = 0
    for n, m in tuned.items():
        old = result.modules[n]
        assert torch.equal(m.weight.codes.view(torch.uint8), old.weight.codes.view(torch.uint8))
        assert m.weight.scales.dtype == old.weight.scales.dtype and m.input_activations == old.input_activations
        for part in ("zeros", "global_scale"):
            a, b = getattr(m.weight, part), getattr(old.weight, part)
            assert (a is None and b is None) or torch.equal(a, b)
        if m.weight.mins is not None:
            assert m.weight.mins.dtype == old.weight.mins.dtype
        moved += not torch.equal(m.weight.scales.view(torch.uint8), old.weight.scales.view(torch.uint8))
    assert moved == len(tuned)  # NVFP4's too: E4M3 scales step to neighbouring E4M3 values


def test_activation_rounding_passes_gradients_straight_through(tiny):
    model = _model(tiny)
    result = quantize_model(model, Plan(recipe=uniform("w8a8")), _windows(n=2, length=16))
    module = result.modules["model.layers.0.self_attn.q_proj"]
    x = torch.randn(3, module.weight.shape[1], requires_grad=True)
    (rounded,) = _straight_through(module)(None, (x,))
    assert torch.equal(rounded, fake_quantize_inputs(x.detach(), scheme("w8a8").activations, None))
    assert not torch.equal(rounded, x)
    (rounded * torch.arange(3.0)[:, None]).sum().backward()
    assert torch.equal(x.grad, torch.arange(3.0)[:, None].expand_as(x))


def test_tuned_folder_round_trips_and_runs_on_the_engine(tiny, tmp_path, calib, capsys, monkeypatch):
    monkeypatch.setenv("GLMSERVE_QUANT_BACKEND", "reference")  # the folder's arithmetic, not the int8 kernels'
    out = tmp_path / "q"
    main(["quantize", str(tiny), "--scheme", "w4a16-asym", "--calib", calib, "--seq-len", "32", "--tune-steps", "8",
          "--tune-lr", "0.01", "--tune-samples", "2", "--out", str(out)])
    assert "MiB in bf16" in capsys.readouterr().out
    _, result = run_quantize(str(tiny), str(tmp_path / "again"), scheme="w4a16-asym", calib=[calib], seq_len=32,
                             tune_steps=8, tune_lr=0.01, tune_samples=2)
    assert any(note.startswith("tuned 8 steps end to end") for note in result.notes)
    _, modules, rest = load_checkpoint(out)
    for n in modules:  # the same seed, the same windows: the command and the function write the same weights
        _same_module(result.modules[n], modules[n])
    for k, w in result.float_tensors.items():
        assert torch.equal(rest[k], w.to(rest[k].dtype))
    _, untuned = run_quantize(str(tiny), str(tmp_path / "plain"), scheme="w4a16-asym")
    assert any(not torch.equal(modules[n].weight.scales, untuned.modules[n].weight.scales) for n in modules)
    assert _worst_error(_engine(out), fake_quantized_model(tiny, out), list(range(5, 30))) < 1e-4


def test_bad_settings_are_refused(tiny, tmp_path, calib):
    with pytest.raises(InvalidRequestError, match="give --calib"):
        run_quantize(str(tiny), str(tmp_path / "e"), scheme="w4a16", tune_steps=4)
    with pytest.raises(InvalidRequestError, match="--tune-samples must be >= 0"):
        run_quantize(str(tiny), str(tmp_path / "e"), scheme="w4a16", calib=[calib], tune_steps=-1)
    with pytest.raises(InvalidRequestError, match="--tune-samples must be >= 0"):
        run_quantize(str(tiny), str(tmp_path / "e"), scheme="w4a16", calib=[calib], tune_steps=2, tune_samples=-1)
    with pytest.raises(InvalidRequestError, match="give --tune-steps as well"):
        run_quantize(str(tiny), str(tmp_path / "e"), scheme="w4a16", calib=[calib], tune_samples=2)
    with pytest.raises(InvalidRequestError, match="--tune-lr > 0"):
        run_quantize(str(tiny), str(tmp_path / "e"), scheme="w4a16", calib=[calib], tune_steps=4, tune_lr=0)
    model = _model(tiny)
    with pytest.raises(ValueError, match="calibration windows"):
        tune(model, {}, {}, [], TuneOptions())


def test_sampled_windows_continue_calibration_pieces_deterministically(tiny):
    model = _model(tiny)
    windows = _windows(n=3, length=24)
    rng_state = torch.get_rng_state()
    got = sampled_windows(model, windows, count=5, prompt_tokens=6, seed=1, batch=2)
    assert torch.equal(torch.get_rng_state(), rng_state)  # the caller's random stream is left as it was
    assert [w.shape for w in got] == [torch.Size([1, 24])] * 5
    for i, w in enumerate(got):  # the first 6 tokens: a contiguous piece of calibration window i mod 3
        source = windows[i % 3][0]
        assert any(torch.equal(w[0, :6], source[j:j + 6]) for j in range(source.numel() - 5))
    assert all(torch.equal(a, b) for a, b in zip(got, sampled_windows(model, windows, 5, 6, seed=1, batch=2),
                                                 strict=True))
    other = sampled_windows(model, windows, count=5, prompt_tokens=6, seed=2, batch=2)
    assert any(not torch.equal(a[0, 6:], b[0, 6:]) for a, b in zip(got, other, strict=True))
    short = _windows(n=2, length=6)  # prompts of at most half the shortest window
    assert all(any(torch.equal(w[0, :3], s[0, j:j + 3]) for s in short for j in range(4))
               for w in sampled_windows(model, short, count=2, prompt_tokens=6, seed=0))
    with pytest.raises(ValueError, match="windows of 2 or more"):
        sampled_windows(model, _windows(n=2, length=1), count=1, prompt_tokens=6, seed=0)


def test_tuning_with_samples_tunes_on_them_too(tiny, monkeypatch):
    model = _model(tiny)
    windows = _windows(n=2, length=16)
    result = quantize_model(model, Plan(recipe=uniform("w4a16-asym")), windows)
    options = TuneOptions(steps=4, lr=1e-2, windows_per_step=2, samples=3, prompt_tokens=4)
    calls, real = [], tune_module.sampled_windows

    def spy(*args, **kwargs):
        calls.append(args[2:])
        return real(*args, **kwargs)

    monkeypatch.setattr(tune_module, "sampled_windows", spy, raising=True)
    with_samples = tune(model, result.modules, result.float_tensors, windows, options)
    assert calls == [(3, 4, options.seed)]
    again = tune(model, result.modules, result.float_tensors, windows, options)
    without = tune(model, result.modules, result.float_tensors, windows, replace(options, samples=0))
    assert with_samples[2] == again[2]  # the same windows, the same steps
    assert with_samples[2][0] != without[2][0]  # each step has a sampled window in its batch


def test_each_step_draws_half_its_windows_from_the_text():
    order = torch.Generator().manual_seed(0)
    assert sorted(_draw(order, 4, 4, 4)) == [0, 1, 2, 3]  # no sampled windows: the text's only
    for count in (1, 3, 4):
        for _ in range(20):
            picks = _draw(order, 5, 12, count)
            text = [i for i in picks if i < 5]
            assert len(text) == (count + 1) // 2 and len(set(picks)) == count and max(picks) < 12
