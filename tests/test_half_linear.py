"""A quantized model's float lm_head kept as 16-bit floats on CPU (layers/half_linear.py, the `half_linear` op of
kernels/csrc/float_quant_matmul.cpp, models/quantized.py `keep_head_in_half`).

The kernel multiplies float32 activations by the weight's own values (bf16 and fp16 widen to float32 exactly), so it
differs from F.linear on the float32 weight only in the order of the fp32 sums: within (2 K + 3) u sum |x_i w_i|
(Higham 4.2, as tests/test_float_quant_kernels.py bounds it; u = 2^-24). Rows read back are exact.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from glmserve import LLM, SamplingParams, kernels
from glmserve.cli import run_quantize
from glmserve.layers.half_linear import HalfLinear, TiedHalfEmbedding, exact_half_dtype
from glmserve.models import loader
from glmserve.models.gguf_loader import embedded_default_gguf, load_gguf
from glmserve.models.quantized import weight_bytes
from glmserve.quant.compressed_tensors import load_checkpoint
from tests.tiny_models import make_tiny_model

CPU = torch.device("cpu")
U = 2.0 ** -24


def half_weight(out: int, inp: int, dtype: torch.dtype) -> torch.Tensor:
    """A float32 weight whose values are `dtype` numbers, with outlier columns."""
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(out * 3 + inp)) * 0.05
    w[:, ::37] *= 16
    return w.to(dtype).float()


def matmul_op():
    op = kernels.op("half_linear", CPU, torch.float32)
    if op is None:
        pytest.skip("C++ kernels unavailable")
    return op


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out, inp", [(1000, 576), (37, 100), (16, 16)])
@pytest.mark.parametrize("batch", [1, 4, 7, 9, 33])
def test_kernel_against_f_linear(cpu_isa, dtype, out, inp, batch):
    """Batches in registers (1-8 rows on AVX-512, 1-4 on AVX2 and scalar) and through decoded chunks (more rows),
    out_features not a multiple of 16, in_features not one of 16."""
    w = half_weight(out, inp, dtype)
    x = torch.randn(batch, inp, generator=torch.Generator().manual_seed(batch))
    x[:, 3] *= 30
    y = HalfLinear(w, dtype, matmul_op())(x)
    bound = (2 * inp + 3) * U * (x.abs() @ w.abs().T)
    assert y.shape == (batch, out) and y.dtype == torch.float32
    assert ((y - F.linear(x, w)).abs() <= bound).all()


def test_every_bf16_and_fp16_value_widens_exactly(cpu_isa):
    """Every finite 16-bit pattern as one input's weight of 65,536 rows (the identity activation reads it back)."""
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        values = bits.view(dtype).float()
        values = values[values.isfinite()]
        w = torch.zeros(values.numel(), 16)
        w[:, 5] = values
        x = torch.zeros(1, 16)
        x[0, 5] = 1
        assert torch.equal(HalfLinear(w, dtype, matmul_op())(x)[0], values)


def test_rows_read_back_exactly_and_leading_dims(cpu_isa):
    w = half_weight(50, 40, torch.bfloat16)
    head = HalfLinear(w, torch.bfloat16, matmul_op())
    ids = torch.tensor([0, 17, 49, 17])
    assert torch.equal(head.dequantize_rows(ids, torch.float32), w[ids])
    assert torch.equal(head.weight, w)
    assert torch.equal(TiedHalfEmbedding(head)(ids.reshape(2, 2)), w[ids].reshape(2, 2, 40))
    x = torch.randn(2, 3, 40)
    assert head(x).shape == (2, 3, 50)
    assert head.weight_bytes() == 64 * 48 * 2  # rows to whole tiles, inputs to 16s, two bytes each


def test_exact_half_dtype_rounds_nothing():
    assert exact_half_dtype(half_weight(9, 8, torch.bfloat16)) == torch.bfloat16
    fp16 = half_weight(9, 8, torch.float16)
    assert exact_half_dtype(fp16) == torch.float16  # fp16's 10 mantissa bits: not bf16 numbers
    assert exact_half_dtype(fp16 + 1e-7) is None
    with pytest.raises(ValueError, match="bf16 or fp16"):
        HalfLinear(fp16, torch.float32, lambda *a: None)


@pytest.mark.parametrize("arch", ["llama", "llama3-scaled"])  # untied and tied lm_head
def test_quantized_folder_with_a_bf16_head(arch, tiny_model_dir, tmp_path, monkeypatch):
    """`glmserve quantize --dtype bfloat16` writes the head in bf16; the engine keeps it so (tied: the embedding
    reads its rows), at half the float32 bytes, and its prompt logprobs match those of the same folder loaded with
    the head left float32 (F.linear) within 1e-3 (measured: equal). A float32 folder, `--quantization none`, the
    scalar build and the torch-only path keep the float32 head."""
    matmul_op()
    folder, folder32 = tmp_path / "q16", tmp_path / "q32"
    run_quantize(str(tiny_model_dir(arch)), str(folder), scheme="fp8", dtype="bfloat16")
    run_quantize(str(tiny_model_dir(arch)), str(folder32), scheme="fp8")
    ids = list(range(5, 30))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)

    def load(path, **kw) -> tuple[torch.nn.Module, torch.Tensor]:
        llm = LLM(model=str(path), block_size=4, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20, **kw)
        out = llm.generate([ids], params)[0]
        return llm.engine.runner.model, torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])

    model, ours = load(folder)
    assert isinstance(model.lm_head, HalfLinear) and model.lm_head.codes.dtype == torch.bfloat16
    assert isinstance(model.embed_tokens, TiedHalfEmbedding) == (arch == "llama3-scaled")
    model32, _ = load(folder32)
    assert type(model32.lm_head) is torch.nn.Linear
    head_bytes = model32.lm_head.weight.numel() * 4
    assert weight_bytes(model32) - weight_bytes(model) >= head_bytes / 2 - 64 * 16 * 2  # less the tile padding
    assert type(load(folder, quantization="none")[0].lm_head) is torch.nn.Linear
    with monkeypatch.context() as patch:
        patch.setattr(loader, "keep_head_in_half", lambda *args: None)
        float_head, ref = load(folder)
    assert type(float_head.lm_head) is torch.nn.Linear
    assert (ours - ref).abs().max() < 1e-3
    monkeypatch.setenv("GLMSERVE_CPU_ISA", "scalar")  # no SIMD: MKL's sgemm is faster from 8 rows
    assert type(load(folder)[0].lm_head) is torch.nn.Linear
    monkeypatch.setenv("GLMSERVE_TORCH_ONLY", "1")
    assert type(load(folder)[0].lm_head) is torch.nn.Linear


def test_quantize_auto_keeps_each_float_tensor_as_the_source_stores_it(tmp_path):
    """`--dtype auto` writes the float tensors as the source stores them: a bf16 folder's in bf16 (not the float32 the
    model is quantized in); a GGUF's F32 norms in float32 and its block-quantized embedding in bf16
    (GGUFCheckpoint.stored_float_dtypes)."""
    source = make_tiny_model("llama", tmp_path / "f32")
    AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    shutil.copy(source / "tokenizer.json", tmp_path / "bf16")
    for name, want in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        run_quantize(str(tmp_path / name), str(tmp_path / f"q-{name}"), scheme="fp8")
        config, _, rest = load_checkpoint(tmp_path / f"q-{name}")
        assert {t.dtype for t in rest.values()} == {want} and config["torch_dtype"] == str(want)[6:]
    stored = load_gguf(embedded_default_gguf()).stored_float_dtypes()
    assert stored["model.embed_tokens.weight"] == torch.bfloat16  # Q8_0 blocks
    assert stored["model.norm.weight"] == stored["model.layers.0.input_layernorm.weight"] == torch.float32
