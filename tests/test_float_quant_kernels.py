"""The `cpu_float_block` backend (quant/cpu_float_backend.py, kernels/csrc/float_quant_matmul.cpp) on every
instruction-set variant this CPU runs (fixture cpu_isa), against `reference`, for FP8 E4M3 weights (per
channel with the fp8 scheme's per-token fp8 activations, per channel weight-only, per tensor, 128x128 blocks)
and NVFP4, at batch 1, 4, 7 and 12 (registers only, in groups of up to 8 rows on AVX-512 and 4 on AVX2 and scalar:
12 is two groups on AVX-512, and the decoded-tile path on the others) and 33 (the decoded-tile path), on
SmolLM2's 576 / 1536 shapes (not multiples of 128) and odd ones.

Tolerance: the kernel multiplies by the reference's own weights (FP8: bit-identical; NVFP4: within one fp32
rounding of the scale and one of the product, 3 u relative, u = 2^-24), or at small batches by the codes' values
with each scale group's sum times its scale (one rounding of the product and one of the sum per group), and by
the reference's own fp8 activations (checked exactly below), so what remains is the order of the fp32 sums.
Any order of summing K products is within (K - 1) u sum |x_i w_i| of the exact sum (Higham, Accuracy and
Stability of Numerical Algorithms, 4.2), for the kernel and for F.linear alike: the bound is (2 K + 3) u
sum |x_i w_i| (measured: ~1e-3 of it). A decoding slip (one wrong code or scale) is ~1e-2 of a row's sum at least.
Exact checks: every E4M3 and E2M1 code decoded through the kernel (identity activations), the fp8 activation
rows, and dequantize_rows against reference.dequantize.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from glmserve import LLM, SamplingParams, kernels
from glmserve.errors import InvalidRequestError
from glmserve.layers.linear import QuantizedLinear
from glmserve.quant import backend as registry
from glmserve.quant.cpu_float_backend import CpuFloatBlockBackend
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize, fake_quantize_activations
from glmserve.quant.schemes import FP8_GROUP128, FP8_TOKENS, SCHEMES
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import OutlierColumns, QuantizedWeight, WeightWithFloatColumns, concat_rows

CPU = torch.device("cpu")
U = 2.0 ** -24
FP8_BLOCK = QuantSpec(8, type="float", strategy="block", block_structure=(128, 128))
NVFP4 = SCHEMES["nvfp4"].weight
FORMATS = {  # name -> (weight spec, activation spec)
    "fp8_channel_tokens": (SCHEMES["fp8"].weight, FP8_TOKENS),
    "fp8_channel": (SCHEMES["fp8"].weight, None),
    "fp8_tensor": (QuantSpec(8, type="float", strategy="tensor"), None),
    "fp8_block_tokens": (FP8_BLOCK, FP8_TOKENS),
    "fp8_block": (FP8_BLOCK, None),
    "fp8_block_g128": (FP8_BLOCK, FP8_GROUP128),  # activations per 1x128 tile (576: a last tile of 64)
    "fp8_channel_g32": (SCHEMES["fp8-g32"].weight, SCHEMES["fp8-g32"].activations),  # 1x32 / 1x16 tiles
    "fp8_channel_g16": (SCHEMES["fp8-g16"].weight, SCHEMES["fp8-g16"].activations),
    "nvfp4": (NVFP4, None),
}
SHAPES = [(1536, 576), (576, 1536)]  # (out, in)
BATCHES = [1, 4, 7, 12, 33]


@functools.cache  # a few MB each, reused by every variant
def weight(fmt: str, out: int, inp: int, magnitude: float = 0.02) -> QuantizedWeight:
    g = torch.Generator().manual_seed(out * 7 + inp)
    w = torch.randn(out, inp, generator=g) * magnitude
    w[:, ::97] *= 8  # outlier input channels
    return quantize(w, FORMATS[fmt][0])


def activations(batch: int, inp: int) -> torch.Tensor:
    x = torch.randn(batch, inp, generator=torch.Generator().manual_seed(batch * 1000 + inp))
    x[:, 5] *= 20
    return x


@functools.cache
def reference_weight(fmt: str, out: int, inp: int, magnitude: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.dequantize's weight and its absolute value."""
    w = dequantize(weight(fmt, out, inp, magnitude))
    return w, w.abs()


def check(fmt: str, shape: tuple[int, int], x: torch.Tensor, magnitude: float = 0.02) -> None:
    _, act = FORMATS[fmt]
    backend = CpuFloatBlockBackend()
    w = weight(fmt, *shape, magnitude)
    assert backend.supports(w.spec, act, CPU)
    y = backend.apply(backend.prepare(w, act, CPU), x, None)
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == torch.float32
    xa = x if act is None else fake_quantize_activations(x, act)
    w_ref, w_abs = reference_weight(fmt, *shape, magnitude)
    ref = F.linear(xa, w_ref)
    bound = (2 * w.shape[1] + 3) * U * (xa.abs() @ w_abs.T) + 1e-30
    assert ((y - ref).abs() <= bound).all(), ((y - ref).abs() / bound).max()


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("out, inp", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_formats_against_reference(cpu_isa, fmt, out, inp, batch):
    check(fmt, (out, inp), activations(batch, inp))


@pytest.mark.parametrize("fmt, out, inp", [
    ("fp8_channel", 21, 100),  # inputs padded to 16, rows to a tile
    ("fp8_block_tokens", 200, 300),  # a partial block of rows and of inputs
    ("fp8_block_g128", 200, 300),  # and a last activation tile of 44 inputs
    ("fp8_channel_g32", 21, 100),  # a last activation tile of 4 inputs
    ("nvfp4", 37, 176),
])
@pytest.mark.parametrize("batch", [2, 9])
def test_odd_shapes(cpu_isa, fmt, out, inp, batch):
    check(fmt, (out, inp), activations(batch, inp))


@pytest.mark.parametrize("fmt", ["fp8_channel_tokens", "fp8_channel", "nvfp4", "fp8_block_g128"])
@pytest.mark.parametrize("batch", [1, 4, 9, 33])
def test_float_outlier_columns_inside_the_kernel(cpu_isa, fmt, batch):
    """A weight with float input columns (the seeds' activation_threshold): the kernel call adds their product and
    multiplies the codes by rows with those columns zeroed (fp8 token scales set without them), as the layer's own
    path computes it; with fp8 activation tiles (rounded before the kernel) the layer keeps adding them itself."""
    spec, act = FORMATS[fmt]
    out, inp, columns = 200, 576, torch.tensor([3, 5, 300, 575])
    g = torch.Generator().manual_seed(batch)
    w = torch.randn(out, inp, generator=g) * 0.02
    w[:, columns] = 0.0
    float_part = torch.randn(out, len(columns), generator=g)
    weight = WeightWithFloatColumns.of(quantize(w, spec), OutlierColumns(columns, float_part))
    x = activations(batch, inp)
    x[:, columns] *= 100.0
    backend = CpuFloatBlockBackend()
    packed = backend.prepare(weight, act, CPU)
    assert backend.keeps_float_columns(packed) == (fmt != "fp8_block_g128")
    if fmt == "fp8_block_g128":
        return
    inliers = x.index_fill(1, columns, 0.0)
    xa = inliers if act is None else fake_quantize_activations(inliers, act)
    w_ref = dequantize(weight)
    ref = F.linear(xa, w_ref) + F.linear(x[:, columns], float_part)
    bound = (2 * inp + 3) * U * (xa.abs() @ w_ref.abs().T + x[:, columns].abs() @ float_part.abs().T)
    y = backend.apply(packed, x, None)
    assert ((y - ref).abs() <= bound).all(), ((y - ref).abs() / bound).max()
    rows = torch.tensor([0, 17, 199])
    expected_rows = w_ref[rows].index_copy(1, columns, float_part[rows])
    assert torch.equal(backend.dequantize_rows(packed, rows, torch.float32), expected_rows)


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block", "nvfp4"])
def test_huge_scales_keep_their_value(cpu_isa, fmt):
    """Weights of 1e6: the folded scales would pass fp32's range without the kernel's power-of-two `post`."""
    check(fmt, (192, 576), activations(9, 576), magnitude=1e6)


@pytest.mark.parametrize("batch", [4, 64])
def test_every_e4m3_code_decodes_exactly(cpu_isa, batch):
    """Identity activations read the weight back: every code but the NaNs (0x7F, 0xFF), subnormals included,
    times a scale per row, through the register path (batch 4) and the decoded-tile path (batch 40)."""
    bits = (torch.arange(256).unsqueeze(0) + 37 * torch.arange(16).unsqueeze(1)) % 256
    bits[(bits & 0x7F) == 0x7F] = 0
    codes = bits.to(torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.rand(16, 1, generator=torch.Generator().manual_seed(0)) + 0.5
    w = QuantizedWeight(FORMATS["fp8_channel"][0], codes, scales)
    backend = CpuFloatBlockBackend()
    p = backend.prepare(w, None, CPU)
    w_ref, eye = dequantize(w), torch.eye(256)
    for start in range(0, 256, batch):
        assert torch.equal(backend.apply(p, eye[start:start + batch], None), w_ref[:, start:start + batch].T)


@pytest.mark.parametrize("batch", [3, 40])
def test_every_e2m1_code_and_e4m3_scale_decodes_exactly(cpu_isa, batch):
    codes = ((torch.arange(64).unsqueeze(0) + 5 * torch.arange(16).unsqueeze(1)) % 16).to(torch.uint8)
    scale_bits = (torch.arange(4).unsqueeze(0) * 16 + 3 * torch.arange(16).unsqueeze(1) + 1) % 127  # incl. subnormal
    scales = scale_bits.to(torch.uint8).view(torch.float8_e4m3fn)
    w = QuantizedWeight(NVFP4, codes, scales, global_scale=torch.tensor(0.25))
    backend = CpuFloatBlockBackend()
    p = backend.prepare(w, None, CPU)
    x = torch.eye(64)[:batch]
    assert torch.equal(backend.apply(p, x, None), dequantize(w)[:, :batch].T)


def test_fp8_activation_rows_equal_the_reference(cpu_isa):
    x = activations(17, 576) * 3
    x[2] = 0  # an all-zero row: scale 1e-12
    x[3, :7] = torch.tensor([1e-9, -3e-3, 448.0, -5e4, 2.0 ** -10, 0.1, 7.0])
    rows = kernels.op("fp8_fake_quantize_rows", CPU, torch.float32)(x)
    assert torch.equal(rows, fake_quantize_activations(x, FP8_TOKENS))


def test_fp8_rounding_at_every_e4m3_boundary(cpu_isa):
    """Rows whose largest value is 448 (scale exactly 1, so the row's values are rounded as they are): every E4M3
    value, every midpoint between neighbours (ties go to the even code), one fp32 step either side of each, both
    signs, subnormals included: the kernel's bit arithmetic against torch's own E4M3 conversion."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, every code
    mids = (grid[:-1] + grid[1:]) / 2
    below, above = torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 500.0))
    values = torch.cat([grid, mids, below, above])
    values = torch.cat([values, -values])
    rows = values[: values.numel() // 63 * 63].reshape(-1, 63)
    rows = torch.cat([rows, torch.full((rows.shape[0], 1), 448.0)], dim=1)
    got = kernels.op("fp8_fake_quantize_rows", CPU, torch.float32)(rows)
    assert torch.equal(got, rows.to(torch.float8_e4m3fn).float())
    assert torch.equal(got, fake_quantize_activations(rows, FP8_TOKENS))


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block", "fp8_tensor", "nvfp4"])
def test_dequantize_rows_from_the_packed_layout(cpu_isa, fmt):
    w = weight(fmt, 200, 576)
    backend = CpuFloatBlockBackend()
    p = backend.prepare(w, None, CPU)
    ids = torch.tensor([0, 15, 16, 129, 199, 3])
    assert torch.equal(backend.dequantize_rows(p, ids, torch.float32), dequantize(w)[ids])


def test_bias_dtype_leading_dims_and_width(cpu_isa):
    backend = CpuFloatBlockBackend()
    p = backend.prepare(weight("nvfp4", 192, 576), None, CPU)
    x = activations(6, 576)
    bias = torch.randn(192)
    y = backend.apply(p, x.reshape(2, 3, 576).bfloat16(), bias)
    assert y.shape == (2, 3, 192) and y.dtype == torch.bfloat16
    expected = backend.apply(p, x.bfloat16().float(), None) + bias
    assert torch.allclose(y.float().reshape(6, 192), expected, rtol=1e-2, atol=1e-2)
    with pytest.raises(InvalidRequestError, match="576"):
        backend.apply(p, torch.randn(2, 512), None)


def test_fused_parts_of_one_format(cpu_isa):
    """q|k|v stacked (concat_rows): fp8 blocks of whole 128-row parts, NVFP4 parts of one global scale."""
    backend = CpuFloatBlockBackend()
    x = activations(5, 576)
    fp8_parts = [weight("fp8_block", rows, 576) for rows in (256, 128, 128)]
    w = weight("nvfp4", 1536, 576)
    nvfp4_parts = [QuantizedWeight(NVFP4, w.codes[a:b], w.scales[a:b], global_scale=w.global_scale)
                   for a, b in ((0, 576), (576, 768), (768, 1536))]
    for parts in (fp8_parts, nvfp4_parts):
        fused = concat_rows(parts)
        y = backend.apply(backend.prepare(fused, None, CPU), x, None)
        separate = torch.cat([backend.apply(backend.prepare(p, None, CPU), x, None) for p in parts], dim=1)
        assert torch.equal(y, separate)


@pytest.mark.parametrize("spec, act", [
    (QuantSpec(8, strategy="channel"), None),  # integer weights: cpu_block
    (QuantSpec(4, strategy="group", group_size=32), None),
    (QuantSpec(8, type="float", strategy="channel"), QuantSpec(8, strategy="token", dynamic=True)),  # int8 tokens
    (QuantSpec(8, type="float", strategy="group", group_size=8), None),
    (QuantSpec(8, type="float", strategy="block", block_structure=(128, 8)), None),
    (QuantSpec(4, type="float", strategy="tensor_group", group_size=8), None),
    (QuantSpec(4, type="float", strategy="group", group_size=16), None),
    (QuantSpec(8, type="float", strategy="channel"), QuantSpec(8, type="float", strategy="tensor", dynamic=True)),
])
def test_unsupported_formats_are_left_to_other_backends(cpu_isa, spec, act):
    backend = CpuFloatBlockBackend()
    assert not backend.supports(spec, act, CPU)
    assert not backend.supports(NVFP4, None, torch.device("meta"))
    with pytest.raises(InvalidRequestError, match="does not run"):
        backend.prepare(QuantizedWeight(spec, torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, 1)), act, CPU)


def test_registry_picks_the_kernel_on_cpu_and_reference_without_it(cpu_isa, monkeypatch):
    monkeypatch.delenv(registry.BACKEND_ENV, raising=False)
    for name in ("fp8", "fp8-a16", "fp8-block", "fp8-block-g128", "fp8-g32", "fp8-g16", "nvfp4"):
        s = SCHEMES[name]
        assert registry.select(s.weight, s.activations, CPU).name == "cpu_float_block"
    monkeypatch.setenv("GLMSERVE_TORCH_ONLY", "1")
    assert registry.select(NVFP4, None, CPU).name == "reference"


def test_prepare_keeps_only_the_packed_layout(cpu_isa):
    backend = CpuFloatBlockBackend()
    nvfp4 = backend.prepare(weight("nvfp4", 192, 576), None, CPU)
    assert nvfp4.nbytes == 192 * 576 // 2 + 192 * 576 // 16  # nibbles + an E4M3 scale per 16
    fp8 = backend.prepare(weight("fp8_block", 192, 576), None, CPU)
    assert fp8.nbytes == 192 * 576 + 4 * 192 * 5  # code bytes + a float32 scale per row and 128 inputs


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_tiny_model_picks_the_kernel_and_matches_the_reference_backend(name, tiny_model_dir, monkeypatch):
    """The tiny llama quantized on load: every linear (q|k|v and gate|up fused) on cpu_float_block, prompt
    logprobs within 1e-3 of the same model on the reference backend (measured: ~1e-6)."""
    if kernels.op("float_quant_linear", CPU, torch.float32) is None:
        pytest.skip("C++ kernels unavailable")
    path = tiny_model_dir("llama")
    ids = list(range(5, 30))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)

    def prompt_logprobs(backend: str | None) -> tuple[LLM, torch.Tensor]:
        if backend is None:
            monkeypatch.delenv(registry.BACKEND_ENV, raising=False)
        else:
            monkeypatch.setenv(registry.BACKEND_ENV, backend)
        llm = LLM(model=str(path), block_size=4, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20,
                  quantization=name)
        out = llm.generate([ids], params)[0]
        return llm, torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])

    llm, ours = prompt_logprobs(None)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and {s.backend.name for m in linears for s in m._segments} == {"cpu_float_block"}
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert [s.prepared_rows for s in qkv._segments] == [qkv.out_features]  # one fused matmul
    _, ref = prompt_logprobs("reference")
    assert (ours - ref).abs().max() < 1e-3
