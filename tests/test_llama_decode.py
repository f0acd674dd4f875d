"""The decode step's straight line of C++ calls (models/llama_decode.py) against the module path it stands for
(GLMSERVE_FUSED_DECODE=0): the same tokens and the same logprobs bit for bit, for every kernel variant, on tiny
random-weight models (float and quantized linears, q/k/v bias, scaled rope, float32, bf16 and int8 KV pools, batches of
several decode rows) and on the embedded SmolLM2 GGUF; models it does not take (q/k norms, interleaved rope) and
steps it does not take (prefill rows) run the module path."""

from __future__ import annotations

import pytest
import torch

from glmserve import LLM, SamplingParams
from glmserve.layers.linear import BF16_ACTIVATIONS_ENV
from glmserve.models import llama_decode
from glmserve.models.llama_decode import FUSED_DECODE_ENV

GREEDY = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2)
FRESH = {"enable_prefix_caching": False}  # both sides prefill alike (a cache hit attends over gathered context)
PROMPTS = [list(range(5, 30)), list(range(40, 47)), [3, 9, 27, 81]]


def _outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, GREEDY)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def fused_and_module_outputs(llm: LLM, prompts: list[list[int]], monkeypatch) -> tuple[list, list, list[int]]:
    """Outputs with the fused decode, with the module path, and the rows of each step the fused decode ran."""
    ran = []
    real = llama_decode.run_decode

    def counted(model, x, step):
        done = real(model, x, step)
        if done:
            ran.append(x.shape[0])
        return done

    monkeypatch.setattr("glmserve.models.llama.run_decode", counted)
    fused = _outputs(llm, prompts)
    monkeypatch.setenv(FUSED_DECODE_ENV, "0")
    modules = _outputs(llm, prompts)
    monkeypatch.delenv(FUSED_DECODE_ENV)
    return fused, modules, ran


@pytest.mark.parametrize(("arch", "quantization", "kv"), [
    ("llama", "none", "float32"),
    ("llama", "int8", "bfloat16"),
    ("llama", "int8", "int8"),  # int8 KV rows (the CPU default): quantized by rope_store_kv as store_kv does
    ("qwen2", "w8a8", "float32"),  # q/k/v bias on a quantized linear
    ("qwen2", "none", "bfloat16"),  # q/k/v bias on a float one
    ("llama3-scaled", "w4a16-asym", "float32"),  # scaled rope, tied head, int4 with mins
    ("llama", "fp8", "float32"),  # the float-code kernels (cpu_float_block): E4M3 weights and tokens
    ("llama", "fp8-g32", "int8"),  # E4M3 activation tiles of 32, rounded before the kernel
    ("llama", "nvfp4", "float32"),
])
def test_fused_decode_equals_module_path(arch, quantization, kv, tiny_model_dir, cpu_isa, monkeypatch):
    llm = LLM(model=str(tiny_model_dir(arch)), block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
              kv_cache_memory_bytes=4 << 20, kv_cache_dtype=kv, quantization=quantization, **FRESH)
    fused, modules, ran = fused_and_module_outputs(llm, PROMPTS, monkeypatch)
    assert fused == modules
    assert len(ran) >= GREEDY.max_tokens - 1  # every decode-only step took the fused path


@pytest.mark.parametrize(("quantization", "kv"), [("int8", "bfloat16"), ("w4a16-asym", "float32"), ("int8", "int8")])
def test_bf16_gemm_rows_equal_module_path(quantization, kv, tiny_model_dir, bf16_gemm_from_two_rows, monkeypatch):
    """Decode batches on the bf16 GEMMs run the module path's bf16 flow as a straight line: the same floats; with
    GLMSERVE_BF16_ACTIVATIONS=0 (float32 activations between the GEMMs) they stay on the module path."""
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
              kv_cache_memory_bytes=4 << 20, kv_cache_dtype=kv, quantization=quantization, **FRESH)
    fused, modules, ran = fused_and_module_outputs(llm, PROMPTS, monkeypatch)
    assert fused == modules
    assert len(ran) >= GREEDY.max_tokens - 1 and max(ran) == len(PROMPTS)
    assert all(layer.dense is not None and layer.dense_rows == 2 for layer in llama_decode.decode_layers(
        llm.engine.runner.model))
    monkeypatch.setenv(BF16_ACTIVATIONS_ENV, "0")
    fused, modules, ran = fused_and_module_outputs(llm, PROMPTS, monkeypatch)
    assert fused == modules and set(ran) == {1}  # single rows still take the int8 tiles' calls


def test_embedded_gguf_bf16_gemm_rows_equal_module_path(bf16_gemm_from_two_rows, monkeypatch):
    """SmolLM2-135M's Q4_1 / Q8_0 blocks on the bf16 GEMM at three decode rows: the same tokens and logprobs."""
    llm = LLM(model=None, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, **FRESH)
    fused, modules, ran = fused_and_module_outputs(llm, PROMPTS, monkeypatch)
    assert fused == modules and len(ran) >= GREEDY.max_tokens - 1 and max(ran) == len(PROMPTS)


@pytest.mark.parametrize("arch", ["qwen3", "glm4"])
def test_models_it_does_not_take_run_the_module_path(arch, tiny_model_dir, monkeypatch):
    llm = LLM(model=str(tiny_model_dir(arch)), block_size=4, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20,
              **FRESH)
    fused, modules, ran = fused_and_module_outputs(llm, PROMPTS[:2], monkeypatch)
    assert fused == modules and not ran
    assert llama_decode.decode_layers(llm.engine.runner.model) is None


def test_embedded_gguf_fused_decode_equals_module_path(cpu_isa, monkeypatch):
    """SmolLM2-135M as served (Q4_1 / Q8_0 blocks on our int8 kernels, int8 KV): one row, then three."""
    llm = LLM(model=None, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, **FRESH)
    for prompts in (PROMPTS[:1], PROMPTS):
        fused, modules, ran = fused_and_module_outputs(llm, prompts, monkeypatch)
        assert fused == modules and len(ran) >= GREEDY.max_tokens - 1


def test_step_conditions(tiny_model_dir):
    """Too many rows for a linear's bound call (its forward takes the bf16 GEMM there) leave the step to the module
    path, as does a forward without attention metadata (the learned indexer's teacher runs)."""
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, max_num_batched_tokens=32,
              kv_cache_memory_bytes=4 << 20, quantization="int8")
    model = llm.engine.runner.model
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    layers = llama_decode.decode_layers(model)
    assert layers is not None and all(layer.ready(1, dense_ok=True) for layer in layers)
    layers[0].max_rows = 1
    assert not layers[0].ready(1, dense_ok=True)  # and one row is under every bf16 GEMM's rows
    x = torch.zeros(1, model.config.hidden_size)
    unused = torch.empty(0)
    step = llama_decode.DecodeStep(llama_decode.DecodeKernels.resolve(), *[unused] * 5, dense_ok=True)
    assert not llama_decode.run_decode(model, x, step) and torch.equal(x, torch.zeros_like(x))
    assert llama_decode.decode_step(model, x, torch.zeros(1, dtype=torch.long), None) is None  # no paged attention
