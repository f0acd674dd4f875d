"""QuantizedLinear and QuantizedEmbedding against F.linear / indexing on the dequantized weights: merged
parts (float quantized on load, checkpoint QuantizedWeights, mixed formats, fused checkpoint tensors),
bias, a tied embedding + head sharing one copy, and the loader's errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glmserve.layers.embedding import QuantizedEmbedding
from glmserve.layers.linear import QuantizedLinear
from glmserve.layers.param_loading import WHOLE, Shard
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize, fake_quantize_activations
from glmserve.quant.schemes import SCHEMES, Scheme, scheme
from glmserve.quant.weight import OutlierColumns, QuantizedWeight, WeightWithFloatColumns

CPU = torch.device("cpu")
SIZES = [128, 64, 64]
IN = 256


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    """The layer's logic on the oracle (the CPU kernels are tested against it in test_quant_kernels.py)."""
    monkeypatch.setenv("GLMSERVE_QUANT_BACKEND", "reference")


def _parts(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, IN, generator=g) * 0.1 for n in SIZES]


def _layer(name: str, bias: bool = False) -> QuantizedLinear:
    return QuantizedLinear(IN, SIZES, scheme(name), bias, CPU, torch.float32)


@pytest.mark.parametrize("name", [n for n in SCHEMES if n != "none"])
def test_merged_parts_equal_f_linear_on_the_dequantized_weight(name, monkeypatch):
    monkeypatch.setenv("GLMSERVE_QUANT_BACKEND", "reference")
    parts = _parts()
    layer = _layer(name, bias=True)
    for i, p in enumerate(parts):
        layer.load_weight("weight", p, Shard(part=i))
    bias = torch.randn(sum(SIZES))
    layer.load_parameter(layer.bias, bias, WHOLE)
    layer.finalize()
    spec = scheme(name).weight
    whole = torch.cat(parts)
    expected_w = dequantize(quantize(whole, spec))  # merged: quantized as one matrix (one NVFP4 global)
    x = torch.randn(5, IN)
    acts = scheme(name).activations
    xq = x if acts is None else fake_quantize_activations(x, acts)  # W8A8 / FP8: dynamic per-token
    torch.testing.assert_close(layer(x), F.linear(xq, expected_w, bias), rtol=1e-5, atol=1e-5)
    q, k, v = layer.split(layer(x))
    assert q.shape == (5, 128) and v.shape == (5, 64)


def test_checkpoint_parts_of_mixed_formats_run_as_segments():
    parts = _parts(1)
    layer = QuantizedLinear(IN, SIZES, Scheme("checkpoint", None), False, CPU, torch.float32)
    q40 = quantize(parts[0], scheme("q4_0").weight)
    q80 = quantize(parts[1], scheme("q8_0").weight)
    layer.load_weight("weight", q40, Shard(part=0))
    layer.load_weight("weight", q80, Shard(part=1))
    layer.load_weight("weight", parts[2], Shard(part=2))  # e.g. a K-quant dequantized to float
    layer.finalize()
    x = torch.randn(3, IN)
    w = torch.cat([dequantize(q40), dequantize(q80), parts[2]])
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert len(layer._segments) == 3


def test_same_format_checkpoint_parts_stack_into_one_matmul_and_a_fused_tensor_loads_whole():
    parts = _parts(2)
    spec = scheme("q4_1").weight
    split = QuantizedLinear(IN, SIZES, Scheme("checkpoint", None), False, CPU, torch.float32)
    for i, p in enumerate(parts):
        split.load_weight("weight", quantize(p, spec), Shard(part=i))
    split.finalize()
    fused = QuantizedLinear(IN, SIZES, Scheme("checkpoint", None), False, CPU, torch.float32)
    fused.load_weight("weight", quantize(torch.cat(parts), spec), WHOLE)
    fused.finalize()
    assert len(split._segments) == 1 and len(fused._segments) == 1
    x = torch.randn(4, 2, IN)  # any leading dims
    torch.testing.assert_close(split(x), fused(x))
    assert split(x).shape == (4, 2, sum(SIZES))


def test_float_parts_are_dropped_after_finalize():
    layer = _layer("int8")
    for i, p in enumerate(_parts()):
        layer.load_weight("weight", p, Shard(part=i))
    layer.finalize()
    assert all(p is None for p in layer._parts)
    # int8 codes (1 byte) + one fp32 scale per row: about a quarter of the float32 matrix
    assert layer.weight_bytes() == sum(SIZES) * IN + sum(SIZES) * 4


OUTLIERS = torch.tensor([5, 77, 200])


def _with_float_columns(name: str, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A q|k|v weight quantized whole with OUTLIERS zeroed, those columns kept in float; and the float weight."""
    whole = torch.cat(_parts(seed))
    float_part = torch.randn(whole.shape[0], len(OUTLIERS), generator=torch.Generator().manual_seed(seed)) * 0.5
    whole[:, OUTLIERS] = 0.0
    q = quantize(whole, scheme(name).weight)
    dense = dequantize(q)
    assert torch.count_nonzero(dense[:, OUTLIERS]) == 0  # the codes hold nothing there
    dense[:, OUTLIERS] = float_part
    return WeightWithFloatColumns.of(q, OutlierColumns(OUTLIERS, float_part)), dense


@pytest.mark.parametrize("backend", ["reference", "default"])
@pytest.mark.parametrize("name", ["int8", "w8a8", "w4a16-asym", "fp8", "nvfp4"])
def test_float_outlier_columns_join_the_quantized_product(name, backend, monkeypatch):
    """A module with float outlier columns (the seeds' activation_threshold) runs natively: the codes' product on
    inputs with those columns zeroed (so large outlier activations set no activation scale) plus the float columns'
    product; the bound small-batch call is the same, the fused SwiGLU / bf16 GEMM calls step aside."""
    if backend == "default":
        monkeypatch.delenv("GLMSERVE_QUANT_BACKEND")
    weight, dense = _with_float_columns(name, 4)
    layer = _layer(name)
    layer.load_weight("weight", weight, WHOLE)
    layer.finalize()
    x = torch.randn(5, IN)
    x[:, OUTLIERS] *= 300.0  # LLM.int8()'s outlier features
    inliers = x.index_fill(1, OUTLIERS, 0.0)
    acts = scheme(name).activations
    xq = inliers if acts is None else fake_quantize_activations(inliers, acts)
    expected = F.linear(xq, dense) + F.linear(x[:, OUTLIERS], dense[:, OUTLIERS])
    got = layer(x)
    if backend == "reference":
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    else:  # the CPU kernels round A16 activations to int8 per block of 32 as well: small beside the inliers' part
        assert (got - expected).abs().max() < 0.02 * F.linear(inliers, dense).abs().max()
    matmul, _ = layer.small_batch() or (layer, 0)
    torch.testing.assert_close(matmul(x.contiguous()), got, rtol=1e-5, atol=1e-4)
    assert layer.small_batch_swiglu() is None and layer.dense_batch() is None and not layer.takes_bf16(64)
    torch.testing.assert_close(layer.weight, dense, rtol=1e-3, atol=1e-3)  # the kernels' fp16 scales
    assert torch.equal(layer.weight[:, OUTLIERS], dense[:, OUTLIERS])
    codes_only = QuantizedLinear(IN, SIZES, scheme(name), False, CPU, torch.float32)
    codes_only.load_weight("weight", quantize(torch.cat(_parts(4)), scheme(name).weight), WHOLE)
    codes_only.finalize()
    assert layer.weight_bytes() >= codes_only.weight_bytes() + sum(SIZES) * len(OUTLIERS) * 4


def test_outlier_columns_decide_what_stacks():
    """Parts with the same float columns stack into one segment; parts without them, or with others, do not."""
    weight, dense = _with_float_columns("int8", 5)
    rows = torch.arange(sum(SIZES)).split(SIZES)
    same = QuantizedLinear(IN, SIZES, scheme("int8"), False, CPU, torch.float32)
    for i, r in enumerate(rows):
        same.load_weight("weight", weight.take_rows(r), Shard(part=i))
    same.finalize()
    mixed = QuantizedLinear(IN, SIZES, scheme("int8"), False, CPU, torch.float32)
    mixed.load_weight("weight", weight.take_rows(rows[0]), Shard(part=0))
    plain = quantize(dense[rows[1]].index_fill(1, OUTLIERS, 0.0), scheme("int8").weight)
    mixed.load_weight("weight", plain, Shard(part=1))
    mixed.load_weight("weight", weight.take_rows(rows[2]), Shard(part=2))
    mixed.finalize()
    assert len(same._segments) == 1 and len(mixed._segments) == 3
    x = torch.randn(3, IN)
    torch.testing.assert_close(same(x), F.linear(x, dense), rtol=1e-5, atol=1e-4)
    expected = F.linear(x, dense)
    expected[:, SIZES[0]:SIZES[0] + SIZES[1]] = F.linear(x, dequantize(plain))
    torch.testing.assert_close(mixed(x), expected, rtol=1e-5, atol=1e-4)


def test_load_errors():
    layer = _layer("int8")
    with pytest.raises(ValueError, match="checkpoint shape"):
        layer.load_weight("weight", torch.zeros(64, IN), Shard(part=0))
    layer.load_weight("weight", torch.zeros(128, IN), Shard(part=0))
    with pytest.raises(ValueError, match="loaded twice"):
        layer.load_weight("weight", torch.zeros(128, IN), Shard(part=0))
    with pytest.raises(ValueError, match="before all of its parts"):
        layer.finalize()


def test_tied_embedding_and_head_share_one_copy(monkeypatch):
    monkeypatch.setenv("GLMSERVE_QUANT_BACKEND", "reference")
    vocab, dim = 96, 64
    w = torch.randn(vocab, dim)
    q = quantize(w, scheme("q8_0").weight)
    native = Scheme("checkpoint", None)
    embed = QuantizedEmbedding(vocab, dim, native, CPU, torch.float32)
    head = QuantizedLinear(dim, [vocab], native, False, CPU, torch.float32)
    embed.tie(head)
    assert head.weight_slots() == {} and embed.weight_slots() == {"weight": vocab * dim}
    embed.load_weight("weight", q, WHOLE)
    embed.finalize()
    head.finalize()
    ids = torch.tensor([[3, 7, 3], [95, 0, 1]])
    dq = dequantize(q)
    assert torch.equal(embed(ids), dq[ids])
    x = torch.randn(2, dim)
    torch.testing.assert_close(head(x), x @ dq.T)
    assert embed.weight_bytes() == 0  # the rows come from the head's prepared weight


def test_untied_embedding_quantizes_a_float_matrix():
    w = torch.randn(40, 64)
    embed = QuantizedEmbedding(40, 64, scheme("int8"), CPU, torch.float32)
    embed.load_weight("weight", w, WHOLE)
    embed.finalize()
    ids = torch.tensor([5, 5, 39])
    torch.testing.assert_close(embed(ids), w[ids], atol=0.02, rtol=0)
    assert embed.weight_bytes() == 40 * 64 + 40 * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["int8", "w8a8", "w4a16-asym", "fp8", "nvfp4", "q4_1"])
def test_reference_backend_on_cuda(name, monkeypatch):
    monkeypatch.setenv("GLMSERVE_QUANT_BACKEND", "reference")
    cuda = torch.device("cuda")
    parts = _parts()
    layer = QuantizedLinear(IN, SIZES, scheme(name), False, cuda, torch.float32)
    for i, p in enumerate(parts):
        layer.load_weight("weight", p, Shard(part=i))
    layer.finalize()
    x = torch.randn(3, IN)
    cpu = _layer(name)
    for i, p in enumerate(parts):
        cpu.load_weight("weight", p, Shard(part=i))
    cpu.finalize()
    torch.testing.assert_close(layer(x.to(cuda)).cpu(), cpu(x), rtol=1e-4, atol=1e-4)
