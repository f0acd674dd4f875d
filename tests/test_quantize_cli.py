"""`glmserve quantize` on tiny random-weight models: every scheme -> save -> reload equals what was written and
computes close to the float model; recipes with outlier columns, GPTQ and a bits budget end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from glmserve.cli import main, run_quantize
from glmserve.errors import InvalidRequestError
from glmserve.quant.compressed_tensors import dense_weight, load_checkpoint
from glmserve.quant.pipeline import WRITABLE_SCHEMES, scheme_specs
from glmserve.quant.sensitivity import bits_per_weight
from tests.tiny_models import CORPUS, make_tiny_model

CALIB = "\n".join(CORPUS[:8])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def _float_logits(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def fake_quantized_model(model_dir, out_dir):
    """The float transformers model with each layer's weight replaced by what the checkpoint `out_dir`
    computes with (dequantized, outlier columns put back)."""
    _, modules, rest = load_checkpoint(out_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    names = dict(model.named_modules())
    with torch.no_grad():
        for name, m in modules.items():
            names[name].weight.copy_(dense_weight(m))
        params = dict(model.named_parameters())
        for name, t in rest.items():
            params[name].copy_(t)
    return model


def _quantized_logits(model_dir, out_dir, ids):
    with torch.no_grad():
        return fake_quantized_model(model_dir, out_dir)(ids).logits


def _same_module(a, b):
    assert a.weight.spec == b.weight.spec and a.input_activations == b.input_activations
    for field in ("codes", "scales", "zeros", "global_scale"):
        x, y = getattr(a.weight, field), getattr(b.weight, field)
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dtype == torch.float8_e4m3fn \
                else torch.equal(x, y)


@pytest.mark.parametrize("scheme", sorted(WRITABLE_SCHEMES))
def test_each_scheme_round_trips_and_stays_close(tiny, tmp_path, scheme):
    out = tmp_path / "q"
    _, result = run_quantize(str(tiny), str(out), scheme=scheme)
    config, modules, rest = load_checkpoint(out)
    assert set(modules) == set(result.modules) and "lm_head" not in modules
    for name in modules:
        _same_module(result.modules[name], modules[name])
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    assert "lm_head.weight" in rest and "model.embed_tokens.weight" in rest
    assert (out / "tokenizer.json").exists()
    if scheme == "nvfp4":  # one global scale per fused layer (q|k|v, gate|up), as vLLM runs them
        att = [modules[f"model.layers.0.self_attn.{p}_proj"].weight.global_scale for p in "qkv"]
        assert torch.equal(att[0], att[1]) and torch.equal(att[0], att[2])
        assert not torch.equal(att[0], modules["model.layers.0.self_attn.o_proj"].weight.global_scale)
    ids = torch.tensor([[0, 5, 17, 42, 99, 7, 3, 250]])
    ref, got = _float_logits(tiny, ids), _quantized_logits(tiny, out, ids)
    rel = ((got - ref).norm() / ref.norm()).item()
    # int8 keeps ~8 bits, fp8 E4M3 3 mantissa bits, the 4-bit formats fewer (a random model amplifies them)
    bound = 0.03 if scheme.startswith("int8") or scheme == "w8a8" else 0.15 if scheme.startswith("fp8") else 0.35
    assert rel < bound, rel


def test_cli_recipe_with_outliers_gptq_end_to_end(tiny, tmp_path, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("attention_layers: {type: fp8, scheme: E4M3}\nffn_layers: {type: int4}\n"
                      "activation_threshold: 0.5\n")
    out = tmp_path / "q"
    main(["quantize", str(tiny), "--recipe", str(recipe), "--calib", str(calib), "--method", "gptq",
          "--seq-len", "32", "--out", str(out)])
    printed = capsys.readouterr()
    assert "MiB in bf16" in printed.out and "columns kept in float" in printed.err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    _, modules, _ = load_checkpoint(out)
    assert modules["model.layers.0.self_attn.q_proj"].weight.spec.type == "float"
    assert modules["model.layers.0.mlp.down_proj"].weight.spec.num_bits == 4
    with_outliers = [m for m in modules.values() if m.outliers is not None]
    assert with_outliers
    for m in with_outliers:  # the quantized part holds nothing in the float columns
        assert torch.count_nonzero(dense_weight(m)[:, m.outliers.columns] - m.outliers.weight) == 0


def test_cli_bits_budget_mixes_formats(tiny, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    out = tmp_path / "q"
    _, result = run_quantize(str(tiny), str(out), bits_budget=5.0, candidates="int8,w4a16", calib=[str(calib)],
                             seq_len=32)
    assert set(result.schemes.values()) == {"int8", "w4a16"}
    assert result.sensitivity is not None
    for unit in (("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                  "model.layers.0.self_attn.v_proj"), ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj")):
        assert len({result.schemes[n] for n in unit}) == 1  # fused layers share a format
    _, modules, _ = load_checkpoint(out)
    assert {n: m.weight.spec.num_bits for n, m in modules.items()} == {
        n: 8 if s == "int8" else 4 for n, s in result.schemes.items()}


def _budget_recipe(tmp_path, budget: float | None, candidates: str = "[fp8]"):
    path = tmp_path / "budget.yaml"
    extra = "" if budget is None else f"bits_budget: {budget}\ncandidates: {candidates}\n"
    path.write_text("attention_layers: {type: fp8, scheme: E4M3}\nffn_layers: {type: nvfp4}\n" + extra)
    return str(path)


def test_recipe_with_a_bits_budget_upgrades_the_most_sensitive_ffn_units(tiny, tmp_path):
    """The seeds' recipe as each unit's floor, FFN units upgraded to FP8 by their measured loss decrease per added
    bit, within the budget; the folder holds the chosen formats."""
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    kw = dict(calib=[str(calib)], seq_len=32, sensitivity="measured")
    _, floor = run_quantize(str(tiny), str(tmp_path / "f"), recipe=_budget_recipe(tmp_path, None), **kw)
    fp8, nvfp4 = (scheme_specs(s)[0] for s in ("fp8", "nvfp4"))
    shapes = {n: (m.weight.shape[1], m.weight.shape[0]) for n, m in _linears(tiny).items()}
    params = {n: shapes[n][0] * shapes[n][1] for n in floor.schemes}

    def avg_bits(schemes):
        return sum(bits_per_weight(fp8 if s == "fp8" else nvfp4, *shapes[n]) * params[n]
                   for n, s in schemes.items()) / sum(params.values())

    ffn_units = [("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"), ("model.layers.0.mlp.down_proj",),
                 ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"), ("model.layers.1.mlp.down_proj",)]
    all_fp8 = avg_bits({n: "fp8" for n in floor.schemes})
    budget = (avg_bits(floor.schemes) + all_fp8) / 2
    _, mixed = run_quantize(str(tiny), str(tmp_path / "m"), recipe=_budget_recipe(tmp_path, budget), **kw)
    assert avg_bits(mixed.schemes) <= budget + 1e-9 < all_fp8
    assert all(mixed.schemes[n] == "fp8" for n in floor.schemes if floor.schemes[n] == "fp8")  # attention: floor
    upgraded = [u for u in ffn_units if mixed.schemes[u[0]] == "fp8"]
    assert 0 < len(upgraded) < len(ffn_units)
    assert all(len({mixed.schemes[n] for n in u}) == 1 for u in ffn_units)

    def gain_per_bit(u):
        d = mixed.sensitivity[u]
        extra = sum((bits_per_weight(fp8, *shapes[n]) - bits_per_weight(nvfp4, *shapes[n])) * params[n] for n in u)
        return (d["nvfp4"] - d["fp8"]) / extra

    assert max(ffn_units, key=gain_per_bit) in upgraded  # the greedy's first pick: sensitivity chose it
    _, modules, _ = load_checkpoint(tmp_path / "m")
    assert {n: m.weight.spec.type for n, m in modules.items()} == {n: "float" for n in mixed.schemes}
    assert {n: m.weight.spec.num_bits for n, m in modules.items()} == {
        n: 8 if s == "fp8" else 4 for n, s in mixed.schemes.items()}

    # the floor's own bits: nothing to upgrade; the CLI's budget overrides the file's; below the floor: refused
    _, same = run_quantize(str(tiny), str(tmp_path / "s"), recipe=_budget_recipe(tmp_path, budget),
                           bits_budget=avg_bits(floor.schemes) + 1e-6, **kw)
    assert same.schemes == floor.schemes
    with pytest.raises(InvalidRequestError, match="below the cheapest"):
        run_quantize(str(tiny), str(tmp_path / "b"), recipe=_budget_recipe(tmp_path, 4.0), **kw)


def test_a_recipes_sensitivity_is_its_budgets_unless_the_command_says(tiny, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    recipe = tmp_path / "fisher.yaml"
    recipe.write_text(Path(_budget_recipe(tmp_path, 6.0)).read_text() + "sensitivity: fisher\n")
    kw = dict(calib=[str(calib)], seq_len=32)
    _, own = run_quantize(str(tiny), str(tmp_path / "a"), recipe=str(recipe), **kw)
    _, fisher = run_quantize(str(tiny), str(tmp_path / "b"), recipe=_budget_recipe(tmp_path, 6.0),
                             sensitivity="fisher", **kw)
    _, measured = run_quantize(str(tiny), str(tmp_path / "c"), recipe=str(recipe), sensitivity="measured", **kw)
    assert own.sensitivity == fisher.sensitivity != measured.sensitivity


def test_recipe_budget_may_keep_units_in_float(tiny, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    _, result = run_quantize(str(tiny), str(tmp_path / "q"), recipe=_budget_recipe(tmp_path, 8.5, "[none]"),
                             calib=[str(calib)], seq_len=32, sensitivity="fisher")
    kept = {n for n in _linears(tiny) if n != "lm_head" and n not in result.schemes}
    assert kept and all(d["none"] == 0.0 for d in result.sensitivity.values())
    assert all(set(u) <= kept or not set(u) & kept for u in result.sensitivity)  # whole units
    _, modules, rest = load_checkpoint(tmp_path / "q")
    assert set(modules) == set(result.schemes) and all(f"{n}.weight" in rest for n in kept)


def _linears(model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("argv, message", [
    (["--scheme", "int3"], "unknown quantization scheme 'int3'"),
    (["--scheme", "w4a16", "--method", "gptq"], "needs calibration text"),
    (["--scheme", "w4a16", "--bits-budget", "5"], "exactly one of"),
    (["--recipe", "examples/quant/seeds_mixed.yaml", "--scheme", "fp8"], "exactly one of"),
])
def test_cli_errors(tiny, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(tiny), "--out", str(tmp_path / "q"), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


# awq-gptq's bound is looser: GPTQ on these 8 windows of 32 tokens (fewer tokens than some layers' inputs) fits
# them rather than the test ids
@pytest.mark.parametrize("method, bound", [("awq", 0.35), ("awq-gptq", 0.4)])
def test_awq_folds_its_scales_into_the_norms_and_stays_close(tiny, tmp_path, method, bound):
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    out = tmp_path / "q"
    _, result = run_quantize(str(tiny), str(out), scheme="w4a16", method=method, calib=[str(calib)], seq_len=32)
    assert any(k.endswith("input_layernorm.weight") for k in result.float_tensors)
    _, _, rest = load_checkpoint(out)
    base = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).state_dict()
    for name, t in result.float_tensors.items():  # the checkpoint holds the rescaled norms, not the float ones
        assert torch.allclose(rest[name].float(), t) and not torch.allclose(t, base[name])
        assert not torch.allclose(rest[name].float(), base[name])
    ids = torch.tensor([[0, 5, 17, 42, 99, 7, 3, 250]])
    ref, got = _float_logits(tiny, ids), _quantized_logits(tiny, out, ids)
    assert ((got - ref).norm() / ref.norm()).item() < bound


def test_smoothquant_folds_into_norms_and_up_proj_and_round_trips(tiny, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    out = tmp_path / "q"
    _, result = run_quantize(str(tiny), str(out), scheme="w8a8", smooth=0.5, calib=[str(calib)], seq_len=32)
    assert any(k.endswith("post_attention_layernorm.weight") for k in result.float_tensors)
    assert any("SmoothQuant alpha 0.5: input scales folded into 4 norms and 2 linear layers" in n for n in result.notes)
    config, modules, rest = load_checkpoint(out)
    for name in modules:
        _same_module(result.modules[name], modules[name])
    base = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).state_dict()
    for name, t in result.float_tensors.items():
        assert torch.allclose(rest[name].float(), t) and not torch.allclose(t, base[name])
    # up_proj's rows carry down_proj's 1/s: its dequantized rows are no longer the float ones
    up = "model.layers.0.mlp.up_proj"
    assert not torch.allclose(dense_weight(modules[up]), base[f"{up}.weight"], rtol=0.05, atol=1e-3)
    ids = torch.tensor([[0, 5, 17, 42, 99, 7, 3, 250]])
    ref, got = _float_logits(tiny, ids), _quantized_logits(tiny, out, ids)
    assert ((got - ref).norm() / ref.norm()).item() < 0.03


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheme="w8a8", smooth=1.5), "alpha must be in [0, 1]"),
    (dict(scheme="w4a16", smooth=0.5, method="awq"), "does not combine"),
    (dict(scheme="w8a8", smooth=0.5, calib=None), "needs calibration text"),
    (dict(scheme="w4a16", method="gptq", gptq_damp=0.0), "--gptq-damp must be in (0, 1]"),
])
def test_smoothquant_errors(tiny, tmp_path, kwargs, message):
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    kwargs = {"calib": [str(calib)], **kwargs}
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        run_quantize(str(tiny), str(tmp_path / "q"), seq_len=32, **kwargs)
