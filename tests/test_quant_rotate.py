"""The residual-stream rotation (glmserve/quant/rotate.py): Hadamard matrices and rotations are orthogonal; a rotated
model computes the same function (tiny random models with random norm weights, tied or not, with biases or q/k
norms; the embedded SmolLM2's first layers); `glmserve quantize --rotate` writes an untied, norm-folded
compressed-tensors folder that reads back to the rotated weights and runs in the engine, greedily as the reference
backend does."""

from __future__ import annotations

import pytest
import torch
from parity import reference_logprobs
from test_quantize_cli import fake_quantized_model
from transformers import AutoConfig, AutoModelForCausalLM

from glmserve import LLM, SamplingParams
from glmserve.cli import main, run_quantize
from glmserve.errors import InvalidRequestError, UnsupportedModelError
from glmserve.models.hf_float import load_float
from glmserve.quant.compressed_tensors import dense_weight, load_checkpoint
from glmserve.quant.quantize import quantize
from glmserve.quant.recipe import parse_recipe
from glmserve.quant.reference import dequantize
from glmserve.quant.rotate import hadamard, rotate_model, rotation


@pytest.mark.parametrize("n", [1, 2, 12, 64, 72, 576])
def test_hadamard_is_a_hadamard_matrix(n):
    h = hadamard(n)
    assert h.shape == (n, n) and bool((h.abs() == 1).all())
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_rotations_are_orthogonal_and_seeded():
    for kind, n in (("hadamard", 576), ("random", 96), ("auto", 36)):  # no Hadamard of order 36 built: random
        q = rotation(n, kind, seed=3)
        assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
        assert torch.equal(q, rotation(n, kind, seed=3)) and not torch.equal(q, rotation(n, kind, seed=4))
    assert torch.equal(rotation(64, "auto"), rotation(64, "hadamard"))
    with pytest.raises(InvalidRequestError, match="no Hadamard matrix of order 36"):
        rotation(36, "hadamard")
    with pytest.raises(InvalidRequestError, match="not one of"):
        rotation(64, "givens")


def _with_random_norms(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.mark.parametrize(("arch", "kind"), [("llama", "auto"), ("llama", "random"), ("llama3-scaled", "auto"),
                                            ("qwen2", "auto"), ("qwen3", "hadamard")])
def test_rotation_preserves_the_function(arch, kind, tiny_model_dir):
    model = _with_random_norms(AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32))
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        want = model(ids).logits
        rotate_model(model, kind)
        got = model(ids).logits
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            assert bool((p == 1).all()), name
        elif p.dim() == 2 and name in before:  # every matrix moved (a tied lm_head was not a parameter of its own)
            assert not torch.allclose(p, before[name]), name


def test_rotation_rejects_post_norm_decoders(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("glm4"), dtype=torch.float32)
    with pytest.raises(UnsupportedModelError, match="pre-norm"):
        rotate_model(model)


def test_recipe_rotate_key():
    assert parse_recipe({"default": "int8", "rotate": True}).rotate == "auto"
    assert parse_recipe({"default": "int8", "rotate": "random"}).rotate == "random"
    assert parse_recipe({"default": "int8", "rotate": False}).rotate is None
    assert parse_recipe({"default": "int8"}).rotate is None
    with pytest.raises(InvalidRequestError, match="rotate must be"):
        parse_recipe({"default": "int8", "rotate": "yes"})


def test_rotated_quantized_folder_round_trips(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    out = tmp_path / "rot-w4"
    rotated, result = run_quantize(str(src), str(out), scheme="w4a16", rotate="auto")
    config, modules, rest = load_checkpoint(out)
    assert config["tie_word_embeddings"] is False and len(modules) == 14
    assert AutoConfig.from_pretrained(out).tie_word_embeddings is False
    params = dict(rotated.named_parameters())
    assert torch.equal(rest["lm_head.weight"], params["lm_head.weight"])
    assert torch.equal(rest["model.embed_tokens.weight"], params["model.embed_tokens.weight"])
    assert all(bool((t == 1).all()) for k, t in rest.items() if k.endswith("norm.weight"))
    for name, m in modules.items():  # the folder holds the rotated weights, rounded
        assert torch.equal(dense_weight(m), dequantize(quantize(params[f"{name}.weight"], m.weight.spec))), name
    ids = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        floats = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
        fake = fake_quantized_model(src, out)(ids).logits
    assert 0 < (fake - floats).abs().max() < 0.25 * floats.abs().max()


def test_cli_rotate_with_a_recipe_and_the_callers_model_left_alone(tiny_model_dir, tmp_path, capsys):
    src = tiny_model_dir("llama")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rules: [{pattern: '*.mlp.*', scheme: int8}]\nrotate: random\n")
    main(["quantize", str(src), "--recipe", str(recipe), "--out", str(tmp_path / "a")])
    assert "layers: 6 int8" in capsys.readouterr().out
    _, modules, rest = load_checkpoint(tmp_path / "a")
    assert set(modules) == {f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")}
    assert "lm_head.weight" in rest
    ckpt = load_float(str(src))
    before = ckpt.model.model.embed_tokens.weight.clone()
    with pytest.raises(InvalidRequestError, match="unrotated"):
        run_quantize(ckpt, str(tmp_path / "b"), scheme="int8", rotate="auto", stats={})
    run_quantize(ckpt, str(tmp_path / "b"), scheme="int8", rotate="auto")
    assert torch.equal(ckpt.model.model.embed_tokens.weight, before) and ckpt.model.config.tie_word_embeddings is False
    with pytest.raises(SystemExit):
        main(["quantize", str(src), "--scheme", "int8", "--rotate", "givens", "--out", str(tmp_path / "c")])


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def _engine(path) -> LLM:
    return LLM(model=str(path), block_size=4, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20)


def test_engine_runs_a_rotated_tied_model_as_the_reference_backend_does(tiny_model_dir, tmp_path, monkeypatch):
    """A tied model (SmolLM2's case) rotated and quantized to int8: the engine loads the untied folder; its default
    backend choice agrees greedily with the reference backend, and both follow the float model they came from."""
    src = tiny_model_dir("llama3-scaled")
    out = tmp_path / "rot-int8"
    main(["quantize", str(src), "--scheme", "int8", "--rotate", "--out", str(out)])
    prompts = [list(range(5, 25)), list(range(40, 52))]
    native = [o.outputs[0] for o in _engine(out).generate(prompts, GREEDY)]
    monkeypatch.setenv("GLMSERVE_QUANT_BACKEND", "reference")
    llm = _engine(out)
    assert llm.engine.runner.model.lm_head.weight.data_ptr() != llm.engine.runner.model.embed_tokens.weight.data_ptr()
    reference = [o.outputs[0] for o in llm.generate(prompts, GREEDY)]
    floats = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    for prompt, got, want in zip(prompts, native, reference, strict=True):
        assert got.token_ids == want.token_ids
        ref = reference_logprobs(floats, prompt + want.token_ids)
        worst = max(abs(ref[len(prompt) - 1 + step, t].item() - v) for step, lp in enumerate(want.logprobs)
                    for t, v in lp.top)
        assert worst < 0.1, worst


@pytest.mark.slow  # loads the embedded model (a minute on a loaded machine)
def test_rotation_preserves_the_embedded_models_first_layers():
    model = load_float("default").model
    model.model.layers = model.model.layers[:3]
    model.config.num_hidden_layers = 3
    ids = torch.arange(100, 164)[None]
    with torch.no_grad():
        want = model(ids).logits
        rotate_model(model)
        got = model(ids).logits
    assert (got - want).abs().max() < 2e-5 * want.abs().max()


@pytest.mark.slow  # quantizes the embedded model and runs it twice in the engine (minutes on a loaded machine)
def test_engine_runs_the_rotated_embedded_model_as_the_reference_backend_does(tmp_path, monkeypatch):
    out = tmp_path / "smollm2-rot-int8"
    main(["quantize", "default", "--scheme", "int8", "--rotate", "--out", str(out)])
    prompts = ["The capital of France is", "长上下文推理需要"]
    options = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=256, max_model_len=256,
                   kv_cache_memory_bytes=16 << 20)
    native = LLM(model=str(out), **options)
    assert native.engine.runner.model.lm_head.weight.data_ptr() != \
        native.engine.runner.model.embed_tokens.weight.data_ptr()
    got = native.generate(prompts, GREEDY)
    monkeypatch.setenv("GLMSERVE_QUANT_BACKEND", "reference")
    want = LLM(model=str(out), **options).generate(prompts, GREEDY)
    floats = LLM(model=None, quantization="none", **options).generate(prompts, GREEDY)
    for g, w, f in zip(got, want, floats, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert w.outputs[0].token_ids[:4] == f.outputs[0].token_ids[:4]  # int8 of the rotated model: the float's start
