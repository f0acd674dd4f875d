"""GPTQ, layer sensitivity and recipes: checks that fail when the method does not do its job."""

from __future__ import annotations

import json

import pytest
import torch

from glmserve.errors import InvalidRequestError
from glmserve.quant.calibrate import collect_stats, gptq
from glmserve.quant.quantize import quantize
from glmserve.quant.recipe import load_recipe, parse_recipe, uniform
from glmserve.quant.reference import dequantize
from glmserve.quant.sensitivity import allocate, bits_per_weight, measure, units
from glmserve.quant.spec import QuantSpec

W4G32 = QuantSpec(4, "int", True, "group", group_size=32)
W4G32_ASYM = QuantSpec(4, "int", False, "group", group_size=32)
W8 = QuantSpec(8, "int", True, "channel")


def _correlated_inputs(tokens: int, dim: int, seed: int) -> torch.Tensor:
    """Samples of one distribution (fixed mixing; `seed` draws the samples): strongly correlated channels (a
    low-rank signal plus noise) of different magnitude, as real activations have."""
    mix = torch.randn(16, dim, generator=torch.Generator().manual_seed(1234)) * torch.logspace(-0.5, 0.5, dim)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 16, generator=g) @ mix + 0.1 * torch.randn(tokens, dim, generator=g)


@pytest.mark.parametrize("spec", [W4G32, W4G32_ASYM, QuantSpec(4, "int", True, "channel"),
                                  QuantSpec(8, "float", True, "channel"),
                                  # 64x48 blocks: 96 rows in 2 row blocks, 128 inputs in 48 + 48 + a last 32
                                  QuantSpec(8, "float", True, "block", block_structure=(64, 48)),
                                  # NVFP4: E2M1 codes under its round-to-nearest scales (E4M3 per 16, fp32 global)
                                  QuantSpec(4, "float", True, "tensor_group", group_size=16)])
def test_gptq_reduces_layer_output_error_vs_rtn(spec):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    layer = torch.nn.Sequential(torch.nn.Linear(128, 96, bias=False))
    layer[0].weight.data = w
    x_calib, x_test = _correlated_inputs(2048, 128, 1), _correlated_inputs(1024, 128, 2)
    stats = collect_stats(layer, [x_calib], ["0"])["0"]
    assert stats.tokens == 2048
    torch.testing.assert_close(stats.hessian, (x_calib.double().T @ x_calib.double()) / 2048)
    q = gptq(w, stats.hessian, spec)
    rtn = quantize(w, spec)
    assert q.codes.dtype == rtn.codes.dtype and q.scales.shape == rtn.scales.shape
    if spec.strategy == "tensor_group":
        assert torch.equal(q.scales.view(torch.uint8), rtn.scales.view(torch.uint8))
        assert torch.equal(q.global_scale, rtn.global_scale)

    def err(qw):
        return ((x_test @ dequantize(qw).T - x_test @ w.T) ** 2).mean().item()

    assert err(q) < 0.5 * err(quantize(w, spec))  # held-out samples, not the calibration ones


def test_shared_inputs_share_one_accumulator():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.a(x) + self.b(x)

    stats = collect_stats(Two(), [torch.randn(1, 5, 8)], ["a", "b"])
    assert stats["a"] is stats["b"] and stats["a"].tokens == 5


def test_inputs_that_only_reuse_freed_memory_are_not_shared():
    class Seq(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

        def forward(self, x):  # b's input is a new tensor, possibly at the address a's freed input had
            h = self.a(x * 2.0)  # the temporary x * 2 is freed here
            return self.b(h + 1.0)

    x = torch.randn(1, 64, 8)
    model = Seq()
    stats = collect_stats(model, [x], ["a", "b"])
    assert stats["a"] is not stats["b"]
    with torch.no_grad():
        hb = (model.a(x * 2.0) + 1.0).reshape(-1, 8).double()
    torch.testing.assert_close(stats["b"].gram, hb.T @ hb)


class _Stack(torch.nn.Module):
    """Three near-identity linear layers; the middle one has a column of huge weights on an input channel that
    is always zero: harmless in float, but its per-row scale rounds every other weight of the row away."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.l1, self.l2 = (torch.nn.Linear(64, 64, bias=False) for _ in range(3))
        for layer in (self.l0, self.l1, self.l2):
            layer.weight.data = torch.eye(64) + 0.02 * torch.randn(64, 64)
        self.l0.weight.data[0] = 0.0
        self.l1.weight.data[:, 0] = 50.0

    def forward(self, x):
        return self.l2(self.l1(self.l0(x)))


def test_sensitivity_ranks_the_damaged_layer_first_and_gives_it_the_bits():
    model = _Stack()
    x = torch.randn(256, 64)
    x[:, 0] = 0.0
    target = model(x).detach()

    def loss(m):
        return ((m(x) - target) ** 2).mean().item()

    names = ["l0", "l1", "l2"]
    cands = {"w8": W8, "w4": QuantSpec(4, "int", True, "channel")}
    deltas = measure(model, loss, units(names), cands)
    assert max(deltas, key=lambda u: deltas[u]["w4"]) == ("l1",)
    assert all(d["w8"] < d["w4"] for d in deltas.values())
    bits = {u: {c: bits_per_weight(s, 64) for c, s in cands.items()} for u in deltas}
    params = {u: 64 * 64 for u in deltas}
    budget = (bits_per_weight(W8, 64) + 2 * bits_per_weight(cands["w4"], 64)) / 3  # one unit may have 8 bits
    choice = allocate(deltas, bits, params, budget)
    assert choice == {("l0",): "w4", ("l1",): "w8", ("l2",): "w4"}
    with pytest.raises(InvalidRequestError, match="below the cheapest"):
        allocate(deltas, bits, params, 3.0)


def test_units_fuse_qkv_and_gate_up():
    names = ["m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj",
             "m.layers.0.self_attn.o_proj", "m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj",
             "m.layers.0.mlp.down_proj"]
    assert [len(u) for u in units(names)] == [3, 1, 2, 1]


def test_bits_per_weight():
    assert bits_per_weight(W4G32, 576) == 4.5
    assert bits_per_weight(W4G32_ASYM, 576) == 4 + 20 / 32
    assert bits_per_weight(QuantSpec(4, "float", True, "tensor_group", group_size=16), 64, 64) == 4.5 + 32 / 4096
    assert bits_per_weight(None, 10) == 16


LLAMA = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj",
         "model.layers.0.mlp.down_proj", "lm_head"]
KNOWN = ["fp8", "nvfp4", "w4a16", "int8", "w8a8"]


def test_seeds_recipe_file_as_written():
    recipe = load_recipe("examples/quant/seeds_mixed.yaml")
    assert recipe.activation_threshold == 6.0
    assert recipe.assign(LLAMA, KNOWN) == {
        "model.layers.0.self_attn.q_proj": "fp8", "model.layers.0.self_attn.o_proj": "fp8",
        "model.layers.0.mlp.gate_proj": "nvfp4", "model.layers.0.mlp.down_proj": "nvfp4"}
    assert any("group_size 128" in n for n in recipe.notes)


def test_rules_recipe_json(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rules": [{"pattern": "*.mlp.down_proj", "scheme": "int8"},
                                          {"pattern": "re:.*layers\\.0\\..*", "scheme": "w4a16"},
                                          {"pattern": "lm_head", "scheme": "int8"}], "default": "none"}))
    assert load_recipe(path).assign(LLAMA, KNOWN) == {
        "model.layers.0.self_attn.q_proj": "w4a16", "model.layers.0.self_attn.o_proj": "w4a16",
        "model.layers.0.mlp.gate_proj": "w4a16", "model.layers.0.mlp.down_proj": "int8", "lm_head": "int8"}
    assert uniform("w8a8").assign(LLAMA, KNOWN) == {n: "w8a8" for n in LLAMA if n != "lm_head"}


@pytest.mark.parametrize("bad, message", [
    ({"rules": [{"pattern": "*"}]}, "needs 'pattern' and 'scheme'"),
    ({"attention_layers": {"type": "fp8", "scheme": "E5M2"}}, "unsupported type/scheme"),
    ({"activation_threshold": -1}, "positive number"),
    ({"atention_layers": {}}, "unknown keys"),
    ([1, 2], "a recipe is a mapping"),
    ({"default": "fp8", "bits_budget": 0}, "bits_budget must be a positive"),
    ({"default": "fp8", "bits_budget": True}, "bits_budget must be a positive"),
    ({"default": "fp8", "bits_budget": 6, "candidates": [8]}, "list of scheme names"),
    ({"default": "fp8", "candidates": ["int8"]}, "give bits_budget"),
    ({"default": "fp8", "bits_budget": 6, "sensitivity": "exact"}, "sensitivity is one of measured, fisher"),
    ({"default": "fp8", "sensitivity": "fisher"}, "goes with a bits_budget"),
])
def test_bad_recipes_are_typed_errors(bad, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_recipe(bad)


def test_unknown_scheme_in_recipe():
    with pytest.raises(InvalidRequestError, match="unknown scheme 'int3'"):
        parse_recipe({"rules": [{"pattern": "*", "scheme": "int3"}]}).assign(LLAMA, KNOWN)
    with pytest.raises(InvalidRequestError, match="unknown scheme 'fp6'"):
        parse_recipe({"default": "fp8", "bits_budget": 6, "candidates": ["fp6"]}).assign(LLAMA, KNOWN)


def test_budget_recipe_file():
    recipe = load_recipe("examples/quant/seeds_mixed_budget.yaml")
    assert (recipe.bits_budget, recipe.candidates, recipe.sensitivity) == (6.5, ("fp8",), "fisher")
    assert recipe.assign(LLAMA, KNOWN) == load_recipe("examples/quant/seeds_mixed.yaml").assign(LLAMA, KNOWN)
    assert parse_recipe({"default": "fp8", "bits_budget": 6, "candidates": "int8, none"}).candidates == ("int8", "none")


def test_mean_nll_batches_windows_without_changing_the_result():
    from types import SimpleNamespace

    from glmserve.quant.perplexity import mean_nll

    emb = torch.nn.Embedding(50, 50)

    def model(ids):
        return SimpleNamespace(logits=emb(ids))

    windows = [torch.randint(0, 50, (1, 7)) for _ in range(5)] + [torch.randint(0, 50, (1, 4))]
    with torch.no_grad():
        by_hand = [torch.nn.functional.cross_entropy(emb(w[0, :-1]), w[0, 1:], reduction="sum") for w in windows]
    expected = sum(by_hand).item() / sum(w.shape[1] - 1 for w in windows)
    assert abs(mean_nll(model, windows, batch=1) - expected) < 1e-5
    assert abs(mean_nll(model, windows, batch=4) - expected) < 1e-5


def _salient_inputs(tokens: int, dim: int, seed: int) -> torch.Tensor:
    """Correlated inputs where a few channels carry activations 30x the rest (SmolLM2's inputs have such)."""
    x = _correlated_inputs(tokens, dim, seed)
    x[:, :4] *= 30.0
    return x


@pytest.mark.parametrize("spec", [W4G32, W4G32_ASYM])
def test_awq_scale_and_clip_reduce_held_out_error_vs_rtn(spec):
    from glmserve.quant import awq

    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    x_calib, x_test = _salient_inputs(2048, 128, 1), _salient_inputs(1024, 128, 2)
    h = (x_calib.double().T @ x_calib.double() / 2048)
    s = awq.search_scale([w], h, x_calib.abs().mean(dim=0), spec)
    assert s.shape == (128,) and s[:4].mean() > s[4:].mean()  # the salient channels are scaled up
    awq_w = dequantize(awq.clip_quantize(w * s, h, spec)) / s

    def err(wq):
        return ((x_test @ wq.T - x_test @ w.T) ** 2).mean().item()

    assert err(awq_w) < 0.7 * err(dequantize(quantize(w, spec)))


def test_gptq_act_order_keeps_contiguous_groups_and_beats_natural_order_on_salient_inputs():
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    x_calib, x_test = _salient_inputs(2048, 128, 1), _salient_inputs(1024, 128, 2)
    h = x_calib.double().T @ x_calib.double() / 2048

    def err(q):
        return ((x_test @ dequantize(q).T - x_test @ w.T) ** 2).mean().item()

    ordered, natural = gptq(w, h, W4G32_ASYM), gptq(w, h, W4G32_ASYM, act_order=False)
    assert ordered.scales.shape == (96, 4) and ordered.zeros.shape == (96, 4)
    rtn = quantize(w, W4G32_ASYM)  # static groups: each group's scale and zero point from its own columns of w
    assert torch.equal(ordered.scales, rtn.scales) and torch.equal(ordered.zeros, rtn.zeros)
    assert err(ordered) < err(natural) < err(quantize(w, W4G32_ASYM))


def test_fisher_estimate_ranks_the_damaged_layer_like_the_measurement():
    from glmserve.quant.sensitivity import fisher_deltas

    model = _Stack()
    x = torch.randn(256, 64)
    x[:, 0] = 0.0
    target = model(x).detach() + 0.3 * torch.randn(256, 64)  # a loss with gradients at the float weights
    windows = list(x.split(32))
    targets = dict(zip((id(w) for w in windows), target.split(32), strict=True))

    def loss(m, xs):
        return ((m(xs) - targets[id(xs)]) ** 2).mean()

    cands = {"w8": W8, "w4": QuantSpec(4, "int", True, "channel")}
    est = fisher_deltas(model, loss, windows, units(["l0", "l1", "l2"]), cands)
    assert max(est, key=lambda u: est[u]["w4"]) == ("l1",)
    assert all(0 <= d["w8"] < d["w4"] for d in est.values())
    assert all(not p.requires_grad or p.grad is None for p in model.parameters())


def test_smoothquant_scale_flattens_activation_outliers_and_cuts_w8a8_error():
    """Inputs with a few channels 50x the rest (as LLMs' activations): per-token int8 activations lose the ordinary
    channels; SmoothQuant's migration (alpha 0.5) keeps the float product and cuts the W8A8 output error."""
    from glmserve.quant.reference import fake_quantize_activations
    from glmserve.quant.schemes import INT8_TOKENS
    from glmserve.quant.smoothquant import smooth_scale

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g)
    x[:, :4] *= 50.0
    w = torch.randn(64, 128, generator=g) * 0.05
    s = smooth_scale([w], x.abs().amax(dim=0), 0.5)
    torch.testing.assert_close((x / s) @ (w * s).T, x @ w.T, rtol=1e-4, atol=1e-4)  # the float function kept
    assert (x / s).abs().amax(dim=0)[:4].max() < x.abs().amax(dim=0)[:4].min()  # outlier channels shrunk

    def w8a8_error(x_in, w_in):
        y = fake_quantize_activations(x_in, INT8_TOKENS) @ dequantize(quantize(w_in, W8)).T
        return ((y - x @ w.T) ** 2).mean().item()

    assert w8a8_error(x / s, w * s) < 0.5 * w8a8_error(x, w)
