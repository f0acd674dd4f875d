"""The `cpu_block` backend (quant/cpu_backend.py, kernels/csrc/quant_matmul.cpp) on every instruction-set
variant this CPU runs (fixture cpu_isa: the avx512 build needs VNNI; the avx2 build is compiled once with
-mavx2 -mfma -mf16c, no -march, so it is the build an AVX2-only AMD EPYC runs; scalar is the compiler's baseline),
for every format it supports, at batch sizes 1, 3, 8, 33, 63 and SmolLM2's shapes (576 -> 49152 is the
lm_head: batch 1 by default, batch 3 with -m slow; `grid` says which of the others run by default).
Batches from DENSE_MIN_ROWS rows on CPUs with AMX take the bf16 GEMM path instead (tests at the end: our
AMX bf16 GEMM, kernel amx_bf16_linear, against a float64 reference; the int8 batches stay below that).
Batches of 6 rows or more (int8 blocks; 10 for int4) run on the AMX int8 tiles where the avx512 build finds them
(`set_amx`): the batched cases run on both tile kinds (fixture `tiles`), and the AMX sums equal the VNNI and AVX2
ones bit for bit (`test_amx_tiles_equal_every_variant`).

Two checks per case:
- vs an emulation: the kernel's own int8 activations (tested against their formula separately) times the
  weight as the backend stores it (fp16 d and m), summed in float64. The integer dot products are exact, so
  the only difference is the kernel's fp32 sum over blocks: relative 2e-6 of the sum of |terms| (measured: 1e-7).
- vs `reference` (float activations for weight-only formats, its own per-token fake quantization for W8A8):
  within the error the activation quantization and fp16 scales can make. Per output, the rounding error of
  each activation is uniform in +-dx/2 and independent, so the output error has standard deviation
  sigma = sqrt(sum_i w_i^2 dx_i^2 / 12); the bound is 7 sigma plus 2^-10 of sum |x_i w_i| for fp16 scales
  and mins (2^-11 relative each). In relative norm that is about 0.5% for per-block activations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from glmserve import kernels
from glmserve.errors import InvalidRequestError
from glmserve.layers.embedding import QuantizedEmbedding
from glmserve.layers.linear import QuantizedLinear
from glmserve.layers.param_loading import WHOLE
from glmserve.quant import backend as registry
from glmserve.quant.cpu_backend import (
    AMX_GEMM_ENV,
    AVX512_BF16_ROWS_ENV,
    DENSE_MIN_ROWS,
    PREPACK_ENV,
    CpuBlockBackend,
    block_form,
    dense_apply,
    dense_path_for,
    pack,
    pack_two_bit,
)
from glmserve.quant.gguf_mapped import IQ4_VALUES, MXFP4_VALUES, TableCodesWeight
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize, fake_quantize_activations
from glmserve.quant.schemes import Scheme, gguf_spec
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight

CPU = torch.device("cpu")
TOKEN = QuantSpec(8, strategy="token", dynamic=True)
# name -> (weight spec, activation spec); GGUF formats are built by hand (quant-core converts the files)
FORMATS = {
    "int8_channel": (QuantSpec(8, strategy="channel"), None),
    "int8_tensor": (QuantSpec(8, strategy="tensor"), None),
    "int8_group32": (QuantSpec(8, strategy="group", group_size=32), None),
    "int8_group64_asym": (QuantSpec(8, symmetric=False, strategy="group", group_size=64), None),
    "int8_channel_asym": (QuantSpec(8, symmetric=False, strategy="channel"), None),
    "int4_group32": (QuantSpec(4, strategy="group", group_size=32), None),
    "int4_group32_asym": (QuantSpec(4, symmetric=False, strategy="group", group_size=32), None),
    "int4_group64": (QuantSpec(4, strategy="group", group_size=64), None),
    "int4_group64_asym": (QuantSpec(4, symmetric=False, strategy="group", group_size=64), None),
    "int4_group32_fmin": (QuantSpec(4, symmetric=False, strategy="group", group_size=32, zero_point="float"), None),
    "w8a8": (QuantSpec(8, strategy="channel"), TOKEN),
    "gguf_q8_0": (QuantSpec(8, strategy="group", group_size=32, gguf_type="Q8_0"), None),
    "gguf_q4_0": (QuantSpec(4, strategy="group", group_size=32, gguf_type="Q4_0"), None),
    "gguf_q4_1": (QuantSpec(4, symmetric=False, strategy="group", group_size=32, gguf_type="Q4_1"), None),
    "gguf_q5_0": (QuantSpec(5, strategy="group", group_size=32, gguf_type="Q5_0"), None),
    "gguf_q5_1": (QuantSpec(5, symmetric=False, strategy="group", group_size=32, gguf_type="Q5_1"), None),
    # IQ4_NL / IQ4_XS as gguf_mapped.py reads them: Q8_0 codes from a 16-value table, run as nibble indices (t4)
    "gguf_iq4": (QuantSpec(8, strategy="group", group_size=32, gguf_type="Q8_0"), None),
    # MXFP4 likewise: a table of values in [-32, 31] (the AVX2 tiles take them as unsigned codes v + 32)
    "gguf_mxfp4": (QuantSpec(8, strategy="group", group_size=32, gguf_type="Q8_0"), None),
    # Q6_K / Q3_K as gguf_mapped.py reads them: codes in [-32, 31] / [-8, 7] (Q3_K's: [-4, 3]), a scale per 16 (q6 /
    # s4 blocks: two sums a block)
    "gguf_q6_k": (QuantSpec(6, strategy="group", group_size=16, gguf_type="Q6_K"), None),
    "gguf_q3_k": (QuantSpec(4, strategy="group", group_size=16, gguf_type="Q3_K"), None),
    # NVFP4 as gguf_mapped.py reads it: the doubled E2M1 values from a table, a scale per 16 (f4 blocks)
    "gguf_nvfp4": (QuantSpec(6, strategy="group", group_size=16, gguf_type="Q6_K"), None),
    # Q2_K as gguf_mapped.py reads it: codes 0..3, a scale and a min per 16 (q2 blocks)
    "gguf_q2_k": (gguf_spec("Q2_K"), None),
}
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # (out, in)
LM_HEAD = (49152, 576)
BATCHES = [1, 3, 8, 33, DENSE_MIN_ROWS - 1]  # the int8 kernel's batches (from DENSE_MIN_ROWS on AMX: bf16 GEMM)
INV127 = torch.tensor(1.0 / 127.0, dtype=torch.float32)


@functools.lru_cache(maxsize=16)
def weight(fmt: str, out: int, inp: int) -> QuantizedWeight:
    spec, _ = FORMATS[fmt]
    g = torch.Generator().manual_seed(out * 7 + inp)
    if spec.gguf_type is None:
        w = torch.randn(out, inp, generator=g) * 0.02
        w[:, ::97] *= 8  # a few outlier input channels, as real layers have
        return quantize(w, spec)
    blocks = inp // spec.group_size
    scales = (torch.rand(out, blocks, generator=g) * 0.01 + 1e-3).half()
    if fmt in ("gguf_iq4", "gguf_mxfp4", "gguf_nvfp4"):
        table = torch.from_numpy(IQ4_VALUES if fmt == "gguf_iq4" else MXFP4_VALUES)
        return TableCodesWeight(spec, table[torch.randint(0, 16, (out, inp), generator=g)], scales, table)
    if spec.gguf_type == "Q8_0":
        return QuantizedWeight(spec, torch.randint(-128, 128, (out, inp), generator=g, dtype=torch.int8), scales)
    if spec.symmetric:  # Q4_0 / Q3_K codes in [-8, 7], Q5_0 / Q6_K (as gguf_mapped.py reads them) [-16, 15] / [-32, 31]
        half = 1 << (spec.num_bits - 1)
        return QuantizedWeight(spec, torch.randint(-half, half, (out, inp), generator=g, dtype=torch.int8), scales)
    top = 1 << spec.num_bits  # Q4_1 codes 0..15, Q5_1 0..31, Q2_K 0..3, with a minimum per block
    mins = (-(top // 2) * scales.float() * (0.5 + torch.rand(out, blocks, generator=g))).half()
    return QuantizedWeight(spec, torch.randint(0, top, (out, inp), generator=g, dtype=torch.int8), scales, mins=mins)


@functools.lru_cache(maxsize=3)  # an lm_head-sized entry is ~0.5 GB
def stored_weight(fmt: str, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in rounded up to 32] float64: d * c + m as the backend stores them, and its absolute value (a scale per
    16: the codes and fp16 scales as they are)."""
    w = weight(fmt, out, inp)
    c, d, m = block_form(w) if w.spec.group_size != 16 else (w.codes, w.scales, w.mins)
    per = -(-inp // 32) * 32 // d.shape[1]  # inputs per scale: 32, or 16
    c = F.pad(c, (0, d.shape[1] * per - inp)).double()
    w = c * d.double().repeat_interleave(per, dim=1)
    w = w if m is None else w + m.double().repeat_interleave(per, dim=1)
    return w, w.abs().float()


@functools.lru_cache(maxsize=3)
def reference_weight(fmt: str, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.dequantize's float32 weight, its absolute value and its square (for the bounds)."""
    w = dequantize(weight(fmt, out, inp))
    return w, w.abs(), w ** 2


def emulated_activations(x: torch.Tensor, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization replicated in float32: (codes, dx) [N, blocks, 32] / [N, blocks, 1]."""
    n, k = x.shape
    blocks = -(-k // 32)
    xb = F.pad(x, (0, blocks * 32 - k)).reshape(n, blocks, 32)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    if per_token:
        amax = amax.amax(dim=1, keepdim=True).expand(n, blocks, 1)
    dx = amax * INV127
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return torch.round(xb * inv).clamp(-127, 127), dx


def kernel_activations(x: torch.Tensor, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's own int8 activations (codes, dx) as emulated_activations shapes them."""
    q, d, _, _ = kernels.op("quantize_activations", CPU, torch.float32)(x, per_token)
    return q.reshape(x.shape[0], -1, 32).float(), d.unsqueeze(-1)


def activations(batch: int, inp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch * 1000 + inp)
    x = torch.randn(batch, inp, generator=g)
    x[:, 5] *= 20  # an outlier channel (it sets its block's scale)
    return x


def check(fmt: str, batch: int, out: int, inp: int) -> None:
    spec, act = FORMATS[fmt]
    backend = CpuBlockBackend()
    assert backend.supports(spec, act, CPU)
    w = weight(fmt, out, inp)
    prepared = backend.prepare(w, act, CPU)
    x = activations(batch, inp)
    y = backend.apply(prepared, x, None)
    assert y.shape == (batch, out) and y.dtype == torch.float32

    q, dx = kernel_activations(x, act is not None)
    xq = (q * dx).reshape(batch, -1).double()
    w_stored, w_stored_abs = stored_weight(fmt, out, inp)
    emulation = xq @ w_stored.T
    abs_sum = (xq.abs().float() @ w_stored_abs.T).double()
    assert ((y.double() - emulation).abs() <= 2e-6 * abs_sum + 1e-7).all()

    w_ref, w_ref_abs, w_ref_sq = reference_weight(fmt, out, inp)
    ref = F.linear(x if act is None else fake_quantize_activations(x, act), w_ref).double()
    step2 = (dx.expand(batch, dx.shape[1], 32).reshape(batch, -1)[:, :inp].double() ** 2) / 12
    sigma = (step2.float() @ w_ref_sq.T).double().sqrt()
    bound = 7 * sigma + 2 ** -10 * (x.abs() @ w_ref_abs.T).double() + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("per_token", [False, True])
def test_activation_quantization_matches_its_formula(cpu_isa, per_token):
    """Scales exactly; codes round(x / dx) except at a tie, where -ffast-math may divide instead of multiplying
    by the reciprocal (one step off, at most); the block sums are the codes' sums."""
    x = activations(64, 1536)
    x[3, :40] = 0  # an all-zero block: dx = 0, codes 0
    q, d, s, isum = kernels.op("quantize_activations", CPU, torch.float32)(x, per_token)
    q_py, dx = emulated_activations(x, per_token)
    assert torch.equal(d, dx.squeeze(-1))
    off = q.reshape(q_py.shape).float() - q_py
    exact = x.reshape(q_py.shape) / dx.clamp_min(1e-30)
    near_tie = ((exact - exact.floor()) - 0.5).abs() < 1e-4
    assert off.abs().max() <= 1 and (near_tie | (off == 0)).all()
    assert torch.equal(isum, q.reshape(64, -1, 32).sum(-1, dtype=torch.int32))
    assert torch.allclose(s, d * isum.float(), rtol=0, atol=0)


@pytest.mark.parametrize("per_token", [False, True])
def test_activation_quantization_is_the_same_on_every_variant(per_token):
    """The AVX-512 and AVX2 forms of quantize_activations run the scalar form's float operations per element: the
    same codes, scales and sums bit for bit, on whole blocks, a partial last block (100 inputs) and a zero block."""
    from glmserve.kernels.build import load
    from glmserve.kernels.isa import available_isas

    modules = {isa: load("quant_matmul", isa) for isa in available_isas()}
    if any(m is None for m in modules.values()):
        pytest.skip(f"C++ kernels unavailable: {[isa for isa, m in modules.items() if m is None]}")
    for batch, inp in ((33, 576), (5, 100), (2, 1536)):
        x = activations(batch, inp)
        x[1, :32] = 0
        results = {isa: m.quantize_activations(x, per_token) for isa, m in modules.items()}
        first = next(iter(results.values()))
        for isa, got in results.items():
            assert all(torch.equal(a, b) for a, b in zip(got, first)), (isa, batch, inp)


def grid() -> list:
    """Every format x shape x batch; by default all batches on the smallest shape and batch 33 (four tiles of
    8 rows and a remainder of 1) on every shape, the rest with -m slow."""
    cases = []
    for fmt in FORMATS:
        for out, inp in SHAPES:
            for batch in BATCHES:
                fast = (out, inp) == (192, 576) or batch == 33
                cases.append(pytest.param(fmt, out, inp, batch, id=f"{fmt}-{inp}to{out}-b{batch}",
                                          marks=() if fast else pytest.mark.slow))
    return cases


@pytest.mark.parametrize("fmt, out, inp, batch", grid())
def test_formats_against_emulation_and_reference(cpu_isa, fmt, out, inp, batch):
    check(fmt, batch, out, inp)


@pytest.fixture(params=["amx", "vnni"])
def tiles(request, cpu_isa):
    """Batches of 6+ rows (int8; 10+ for int4) on the AMX int8 tiles, or on the variant's own (VNNI / AVX2 /
    scalar) tiles; the AMX case skips where the build or the CPU has none."""
    set_amx = kernels.op("set_amx", CPU, torch.float32)
    on = set_amx(request.param == "amx")
    if request.param == "amx" and not on:
        pytest.skip(f"no AMX int8 tiles on {cpu_isa} here")
    yield request.param
    set_amx(True)


@pytest.mark.parametrize("batch", [8, 16, 33])
@pytest.mark.parametrize("fmt", ["int8_group32", "int8_channel_asym", "int4_group32", "int4_group64_asym", "w8a8",
                                 "gguf_q8_0", "gguf_q4_1", "gguf_q6_k", "gguf_nvfp4", "gguf_q2_k"])
def test_batches_on_both_tile_kinds(tiles, fmt, batch):
    check(fmt, batch, 576, 1536)


# decode batches around the AMX paths' boundaries: a group of 16 rows, a last group of 1-15 rows (on AMX padded with
# zero rows, or on the VNNI tiles under 6 rows for int8 blocks and 10 for u4 ones), whole batches under 16
AMX_BATCHES = [6, 8, 9, 10, 16, 17, 21, 26, 31, 32, 33, 48, 64, 100]


@pytest.mark.parametrize("out, inp", [(200, 576), (176, 1536), (40, 64)])  # 18 / 48 / 2 blocks; 12.5 / 11 / 2.5 tiles
@pytest.mark.parametrize("fmt", ["gguf_q8_0", "gguf_q4_1", "int4_group64_asym", "int8_channel_asym", "w8a8",
                                 "gguf_q6_k", "gguf_nvfp4", "gguf_iq4", "gguf_mxfp4",
                                 "gguf_q2_k"])
def test_amx_tiles_equal_every_variant(fmt, out, inp):
    """On the same quantized activations, the AMX tiles, the avx512 VNNI tiles and the avx2 tiles compute the same
    integer sums per block and scale and sum them in the same order: the same floats, at every decode batch size
    (out_features not a multiple of 32 or 16: partial weight tiles). The scalar build (no FMA instruction) rounds
    each product before adding: within 2e-6 of the sum of |terms|, as the emulation bound above."""
    from glmserve.kernels.build import load
    from glmserve.kernels.isa import available_isas

    modules = {isa: load("quant_matmul", isa) for isa in available_isas()}
    if any(m is None for m in modules.values()):
        pytest.skip(f"C++ kernels unavailable: {[isa for isa, m in modules.items() if m is None]}")
    spec, act = FORMATS[fmt]
    p = CpuBlockBackend().prepare(weight(fmt, out, inp), act, CPU)
    packed = (p.codes, p.scales, p.mins, p.u4, out)
    w_abs = p_weight_abs(p)
    amx = "avx512" in modules and modules["avx512"].set_amx(True)
    try:
        for batch in AMX_BATCHES:
            x = activations(batch, inp)
            acts = modules["scalar"].quantize_activations(x, act is not None)
            results = {isa: m.quant_matmul(*acts, *packed) for isa, m in modules.items()}
            if amx:
                modules["avx512"].set_amx(False)
                results["avx512 VNNI"] = modules["avx512"].quant_matmul(*acts, *packed)
                modules["avx512"].set_amx(True)
            exact = [isa for isa in results if isa != "scalar"]
            for isa in exact[1:]:
                assert torch.equal(results[isa], results[exact[0]]), (isa, exact[0], batch)
            xq = (acts[0].float().reshape(batch, -1, 32) * acts[1].unsqueeze(-1)).reshape(batch, -1)[:, :inp]
            sums = xq.abs() @ w_abs.T
            assert ((results["scalar"] - results[exact[0]]).abs() <= 2e-6 * sums + 1e-7).all(), batch
    finally:
        if "avx512" in modules:
            modules["avx512"].set_amx(True)


@pytest.mark.parametrize("fmt", ["gguf_q8_0", "gguf_q4_1", "gguf_q6_k", "gguf_nvfp4", "gguf_q2_k"])
def test_tiles_split_across_threads_give_the_same_floats(cpu_isa, fmt):
    """Two intra-op threads split the weight tiles (each thread configures its own AMX tiles): the same outputs
    as one thread, at decode batch sizes, AMX on where the build and CPU have it."""
    backend = CpuBlockBackend()
    prepared = backend.prepare(weight(fmt, 200, 576), None, CPU)
    threads = torch.get_num_threads()
    try:
        for batch in (8, 17, 32):
            x = activations(batch, 576)
            torch.set_num_threads(1)
            one = backend.apply(prepared, x, None)
            torch.set_num_threads(2)
            assert torch.equal(backend.apply(prepared, x, None), one), batch
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["gguf_q8_0", "gguf_q4_1", "gguf_q6_k", "gguf_nvfp4", "gguf_q2_k"])
def test_long_batches_in_row_chunks_give_the_same_floats(cpu_isa, fmt, monkeypatch):
    """Prefill-sized batches on the SIMD tiles run in chunks of rows (about 256 KB of int8 activations: 168 rows of
    1,536 inputs), each swept by all of a thread's weight tiles: every row the same floats as the row alone, for a
    batch of several chunks and a partial last one, on one and two threads. (AMX CPUs run such batches as the bf16
    GEMM: turned off here, read when the weight is prepared.)"""
    monkeypatch.setattr(kernels, "amx_bf16", lambda: False)
    backend = CpuBlockBackend()
    prepared = backend.prepare(weight(fmt, 72, 1536), None, CPU)
    x = activations(400, 1536)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = backend.apply(prepared, x, None)
        torch.set_num_threads(2)
        assert torch.equal(backend.apply(prepared, x, None), whole)
    finally:
        torch.set_num_threads(threads)
    for rows in (slice(0, 1), slice(167, 169), slice(336, 337), slice(399, 400)):
        assert torch.equal(backend.apply(prepared, x[rows], None), whole[rows]), rows


@pytest.mark.parametrize("fmt", ["gguf_q4_1", "int8_group32", "w8a8", "gguf_q6_k", "gguf_nvfp4", "gguf_q2_k"])
def test_quant_linear_is_quant_matmul_of_quantize_activations(tiles, fmt):
    """quant_linear (on the VNNI tiles: each row quantized straight into the tiles' activation groups) gives the floats
    of quant_matmul on quantize_activations' tensors (regrouped by pack_groups), at decode and prefill batch sizes."""
    _, act = FORMATS[fmt]
    p = CpuBlockBackend().prepare(weight(fmt, 200, 1536), act, CPU)
    packed = (p.codes, p.scales, p.mins, p.u4, p.out_features)
    linear = kernels.op("quant_linear", CPU, torch.float32)
    matmul = kernels.op("quant_matmul", CPU, torch.float32)
    quantize_acts = kernels.op("quantize_activations", CPU, torch.float32)
    for batch in (1, 9, 64, 300):
        x = activations(batch, 1536)
        assert torch.equal(linear(x, p.per_token, *packed), matmul(*quantize_acts(x, p.per_token), *packed)), batch


@pytest.mark.parametrize("fmt", ["gguf_q4_1", "gguf_q8_0", "int4_group32", "w8a8", "gguf_q6_k", "gguf_nvfp4",
                                 "gguf_q2_k"])
def test_fused_swiglu_is_silu_and_mul_of_the_product(tiles, fmt):
    """quant_linear_swiglu (a gated MLP's merged gate-up weight: silu(gate) * up without the product written out)
    gives the floats of silu_and_mul after quant_linear, at decode batches and at a prefill batch of several row
    chunks, on one and two threads, on each variant's tiles and on AMX where there are AMX tiles (which compute the
    product, then silu): both run vec_math.h's silu_mul. Halves that are not whole tiles are refused."""
    _, act = FORMATS[fmt]
    p = CpuBlockBackend().prepare(weight(fmt, 2 * 1536, 576), act, CPU)
    args = (p.per_token, p.codes, p.scales, p.mins, p.u4, p.out_features)
    linear = kernels.op("quant_linear", CPU, torch.float32)
    fused = kernels.op("quant_linear_swiglu", CPU, torch.float32)
    silu_and_mul = kernels.op("silu_and_mul", CPU, torch.float32)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for batch in (1, 9, 33, 400):
                x = activations(batch, 576)
                want, got = silu_and_mul(linear(x, *args)), fused(x, *args)
                assert got.shape == (batch, 1536) and torch.equal(got, want), (n_threads, batch)
    finally:
        torch.set_num_threads(threads)
    odd = CpuBlockBackend().prepare(weight(fmt, 2 * 200, 576), act, CPU)  # 200 = 12.5 tiles
    assert CpuBlockBackend().small_batch_swiglu(odd) is None
    with pytest.raises(RuntimeError, match="not gate and up halves"):
        fused(activations(2, 576), odd.per_token, odd.codes, odd.scales, odd.mins, odd.u4, odd.out_features)


@pytest.mark.parametrize("batch", [1, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_lm_head_shape(cpu_isa, fmt, batch):
    check(fmt, batch, *LM_HEAD)


def test_lm_head_batch_past_the_streaming_size(tiles):
    """44 rows of the lm_head (8.7 MB of logits): written with non-temporal stores (AMX and VNNI tiles); both against
    the emulation and the reference. W8A8 (per-token activations): batches of that size in other formats take the
    bf16 GEMM on AMX (DENSE_MIN_ROWS)."""
    check("w8a8", 44, *LM_HEAD)


def test_odd_shapes_pad_to_blocks_and_tiles(cpu_isa):
    """in_features not a multiple of 32 (per-channel int8) and out_features not a multiple of 16."""
    w = quantize(torch.randn(21, 100), QuantSpec(8, strategy="channel"))
    backend = CpuBlockBackend()
    x = torch.randn(5, 100)
    y = backend.apply(backend.prepare(w, None, CPU), x, None)
    ref = F.linear(x, dequantize(w))
    assert y.shape == (5, 21)
    assert torch.allclose(y, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())


def test_bias_dtype_and_leading_dims(cpu_isa):
    spec, _ = FORMATS["int4_group32"]
    backend = CpuBlockBackend()
    prepared = backend.prepare(weight("int4_group32", 192, 576), None, CPU)
    x = activations(6, 576)
    bias = torch.randn(192)
    flat = backend.apply(prepared, x, None)
    y = backend.apply(prepared, x.reshape(2, 3, 576).bfloat16(), bias)
    assert y.shape == (2, 3, 192) and y.dtype == torch.bfloat16
    expected = backend.apply(prepared, x.bfloat16().float(), bias)
    assert torch.allclose(y.float().reshape(6, 192), expected, rtol=1e-2, atol=1e-2)
    assert not torch.equal(flat, expected)


def test_wrong_input_width_is_a_clear_error(cpu_isa):
    backend = CpuBlockBackend()
    prepared = backend.prepare(weight("gguf_q4_1", 192, 576), None, CPU)
    with pytest.raises(InvalidRequestError, match="576"):
        backend.apply(prepared, torch.randn(2, 512), None)


def test_codes_outside_their_range_are_refused(cpu_isa):
    spec = QuantSpec(4, strategy="group", group_size=32)
    bad = QuantizedWeight(spec, torch.full((16, 32), -9, dtype=torch.int8), torch.ones(16, 1))
    with pytest.raises(InvalidRequestError, match="range"):
        CpuBlockBackend().prepare(bad, None, CPU)
    six_bit = FORMATS["gguf_q6_k"][0]
    bad = QuantizedWeight(six_bit, torch.full((16, 32), 32, dtype=torch.int8), torch.ones(16, 2))
    with pytest.raises(InvalidRequestError, match="range"):
        CpuBlockBackend().prepare(bad, None, CPU)
    with pytest.raises(InvalidRequestError, match="blocks of 32"):  # 6-bit codes need whole blocks
        CpuBlockBackend().prepare(QuantizedWeight(six_bit, torch.zeros(16, 48, dtype=torch.int8), torch.ones(16, 3)),
                                  None, CPU)


@pytest.mark.parametrize("spec, act", [
    (QuantSpec(8, type="float", strategy="channel"), None),  # FP8: reference (or the GPU backends)
    (QuantSpec(4, type="float", strategy="tensor_group", group_size=16), None),  # NVFP4: not yet here
    (QuantSpec(8, type="float", strategy="block", block_structure=(128, 128)), None),
    (QuantSpec(4, strategy="group", group_size=16), None),
    (QuantSpec(4, strategy="channel"), None),
    (QuantSpec(8, strategy="group", group_size=32, gguf_type="Q4_K"), None),
    (QuantSpec(8, strategy="channel"), QuantSpec(8, type="float", strategy="token", dynamic=True)),
])
def test_unsupported_formats_are_left_to_other_backends(cpu_isa, spec, act):
    assert not CpuBlockBackend().supports(spec, act, CPU)
    assert not CpuBlockBackend().supports(FORMATS["int4_group32"][0], None, torch.device("meta"))


def test_registry_picks_the_kernel_on_cpu_and_reference_without_it(cpu_isa, monkeypatch):
    monkeypatch.delenv(registry.BACKEND_ENV, raising=False)
    for spec, act in FORMATS.values():
        assert registry.select(spec, act, CPU).name == "cpu_block"
    monkeypatch.setenv("GLMSERVE_TORCH_ONLY", "1")
    assert registry.select(FORMATS["gguf_q4_1"][0], None, CPU).name == "reference"


def test_prepare_keeps_only_the_packed_layout(cpu_isa):
    w = weight("gguf_q4_1", 192, 576)
    prepared = CpuBlockBackend().prepare(w, None, CPU)
    assert prepared.nbytes == 192 * 576 // 2 + 2 * 2 * 192 * 576 // 32  # nibbles + fp16 d and m per block
    assert all(t.data_ptr() not in (w.codes.data_ptr(), w.scales.data_ptr())
               for t in (prepared.codes, prepared.scales, prepared.mins))


@pytest.mark.parametrize("fmt", ["gguf_q4_1", "gguf_q8_0", "int4_group32", "int8_channel_asym", "gguf_q5_1",
                                 "gguf_iq4", "gguf_mxfp4", "gguf_q6_k", "gguf_nvfp4", "gguf_q2_k"])
def test_dequantize_packed_is_the_stored_weight(cpu_isa, fmt):
    """The dense form of the packed layout: d * c + m in float32 (one rounding of the sum), and that value
    rounded to bfloat16 as torch rounds it (nearest even)."""
    out, inp = 192, 576
    p = CpuBlockBackend().prepare(weight(fmt, out, inp), None, CPU)
    op = kernels.op("dequantize_packed", CPU, torch.float32)
    w_stored, w_abs = stored_weight(fmt, out, inp)
    f32 = op(p.codes, p.scales, p.mins, p.u4, out, False, torch.empty(out * inp))
    assert f32.shape == (out, inp)
    assert ((f32.double() - w_stored).abs() <= 2 ** -23 * w_abs.double() + 1e-12).all()
    bf16 = op(p.codes, p.scales, p.mins, p.u4, out, True, torch.empty(out * inp + 7, dtype=torch.bfloat16))
    assert torch.equal(bf16, f32.bfloat16())


def p_weight_abs(p) -> torch.Tensor:
    """|w| of a prepared cpu_block weight, read back from its packed layout."""
    return CpuBlockBackend().dequantize_rows(p, torch.arange(p.out_features), torch.float32).abs()


@pytest.mark.parametrize("fmt", ["gguf_q4_1", "gguf_q8_0", "int4_group64_asym", "gguf_q6_k", "gguf_nvfp4", "gguf_q2_k"])
def test_large_batches_take_the_bf16_gemm(cpu_isa, fmt, monkeypatch):
    """From DENSE_MIN_ROWS rows (prefill) on AMX, and on CPUs with AVX512-BF16 but no AMX from the rows
    GLMSERVE_AVX512_BF16_ROWS gives (here DENSE_MIN_ROWS): bfloat16 activations, weights and outputs with float32
    sums, so each output is within 2^-8 of sum |x w| (two roundings of 2^-9 per product) plus 2^-8 of itself
    (the output's rounding) of `reference`. Our GEMM (AMX or AVX512-BF16) by default; oneDNN on the prepacked
    weight (GLMSERVE_BF16_PREPACK=1) and on the weight dequantized per call (GLMSERVE_AMX_GEMM=0) as options, each
    within one bf16 step of it. Other CPUs and builds keep the int8 path (checked above)."""
    backend = CpuBlockBackend()
    monkeypatch.setenv(AVX512_BF16_ROWS_ENV, str(DENSE_MIN_ROWS))  # read by CPUs without AMX only
    p = backend.prepare(weight(fmt, 192, 576), None, CPU)
    if dense_path_for(CPU) is None:
        assert p.dequantize is None and p.gemm is None
        pytest.skip(f"no bf16 GEMM path on {cpu_isa} here (needs AMX or AVX512-BF16 and the avx512 build)")
    x = activations(DENSE_MIN_ROWS + 3, 576)
    y = backend.apply(p, x, None)
    assert y.dtype == torch.float32 and torch.equal(y, dense_apply(p, x).float())
    assert torch.equal(y, p.gemm(x, p.codes, p.scales, p.mins, p.u4, 192).float())  # our kernel's result
    assert backend.bf16_rows(p, DENSE_MIN_ROWS) and not backend.bf16_rows(p, DENSE_MIN_ROWS - 1)
    y16 = backend.apply(p, x.bfloat16(), None)  # bf16 activations stay bf16 (layers/linear.py bf16_between)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y.bfloat16())
    monkeypatch.setenv(PREPACK_ENV, "1")  # opt-in: oneDNN-prepacked bf16 copies of the weights
    prepacked = dense_apply(p, x).float()
    packed = p.dense
    assert packed is not None and packed.is_mkldnn  # oneDNN's prepacked copy, made by the first dense call
    dense_apply(p, x)
    assert p.dense is packed  # and kept
    monkeypatch.delenv(PREPACK_ENV)
    monkeypatch.setenv(AMX_GEMM_ENV, "0")
    per_call = dense_apply(p, x).float()  # the weight dequantized at this call, a plain oneDNN matmul
    assert p.dense is packed
    # all sum in float32 (in their own order) and round once to bf16: at most one bf16 step apart
    sums = (x.abs() @ p_weight_abs(p).T)
    for other in (prepacked, per_call):
        assert ((y - other).abs() <= 2 ** -7 * other.abs() + 1e-5 * sums).all()
    w_ref, w_ref_abs, _ = reference_weight(fmt, 192, 576)
    ref = F.linear(x, w_ref).double()
    bound = 2 ** -8 * (x.abs() @ w_ref_abs.T).double() + 2 ** -8 * ref.abs() + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()
    w8a8 = backend.prepare(weight("w8a8", 192, 576), TOKEN, CPU)
    assert w8a8.dequantize is None and w8a8.gemm is None  # int8 activations are W8A8's spec: never the bf16 path


def random_packed(out: int, inp: int, bits: int, with_mins: bool, g: torch.Generator,
                  per16: bool | str = False) -> tuple[tuple, torch.Tensor]:
    """A random weight packed directly (`pack` of codes, d and m drawn, no quantization: `bits` 8 (int8 codes), 4
    (nibbles), 5 (nibbles and fifth bits) or 6, with or without mins; `per16`: a d per 16 inputs and no mins, codes q
    standing for q - 32 (6 bits: q6) or q - 8 (4 bits: s4), or "table": 4-bit indices into NVFP4's table of values
    c + 32 (f4); 2 bits: q2, codes 0..3 with a d and an m per 16), and w = d c + m [out, inp] in float64."""
    blocks = -(-inp // 32)
    low, high = (-128, 128) if bits == 8 else (0, 1 << bits)
    codes = torch.randint(low, high, (out, inp), generator=g)
    per = 16 if per16 else 32  # inputs per d
    d = (torch.rand(out, blocks * 32 // per, generator=g) * 0.02 + 1e-3).half()
    if bits == 2:  # pack_two_bit takes whole blocks: the padded inputs' weight is their m
        m = (torch.randn(out, blocks * 2, generator=g) * 0.05).half()
        codes = F.pad(codes, (0, blocks * 32 - inp))
        w = codes.double() * d.double().repeat_interleave(16, dim=1) + m.double().repeat_interleave(16, dim=1)
        return pack_two_bit(QuantizedWeight(gguf_spec("Q2_K"), codes.to(torch.int8), d, mins=m)), w[:, :inp]
    m = (torch.randn(out, blocks, generator=g) * 0.05).half() if with_mins else None
    table = torch.from_numpy(MXFP4_VALUES) + 32 if per16 == "table" else None
    offset = 32 if table is not None else {6: 32, 4: 8}[bits] if per16 else 0
    values = codes if table is None else table[codes]
    w = (values - offset).double() * d.double().repeat_interleave(per, dim=1)[:, :inp]
    if m is not None:
        w = w + m.double().repeat_interleave(32, dim=1)[:, :inp]
    return pack(codes.to(torch.int8), d, m, bits, table), w


# our bf16 GEMMs on the packed weight, one contract: op -> the kernels.isa check of the CPU and build that run it
BF16_GEMMS = {"amx_bf16_linear": "amx_bf16", "avx512_bf16_linear": "avx512_bf16"}


@pytest.fixture(params=list(BF16_GEMMS))
def bf16_gemm(request) -> Callable:
    """Each bf16 GEMM op (AMX tiles; vdpbf16ps without AMX: csrc/bf16_gemm.cpp) this CPU and build run (skips the
    others)."""
    op = kernels.op(request.param, CPU, torch.float32)
    if not getattr(kernels, BF16_GEMMS[request.param])() or op is None:
        pytest.skip(f"{request.param}: not on this CPU (or not the avx512 build)")
    return op


@pytest.mark.parametrize("inp", [576, 1536, 100])
@pytest.mark.parametrize("bits, with_mins, per16", [(8, False, False), (8, True, False), (4, False, False),
                                                    (4, True, False), (5, False, False), (5, True, False),
                                                    (6, False, True), (4, False, True), (4, False, "table"),
                                                    (2, True, True)])
def test_bf16_gemm_against_the_reference(bf16_gemm, bits, with_mins, per16, inp):
    """Our bf16 GEMMs (amx_bf16_linear, avx512_bf16_linear) on random packed weights (`pack` of codes, d and m
    drawn directly: int8 codes, nibbles, nibbles and fifth bits, with and without mins, or 6-bit codes), 600 outputs
    (38 tiles, the last padded: several panels; tiles not a multiple of the register block's 3), odd batches (1, and
    rows past multiples of 8 and 16), inputs padded to 32 (100: the padded inputs' weight is m, the kernel must zero
    their activations). Each output is within 2^-8 of sum |x w| (the weight's bf16 rounding, 2^-9 each) plus 2^-8 of
    itself (its own rounding) of the float64 product of the bf16 activations and w = d c + m; float32 activations are
    rounded to bf16 first (the same result)."""
    op = bf16_gemm
    out, blocks, u4 = 600, -(-inp // 32), bits < 8
    g = torch.Generator().manual_seed(inp + 2 * bits + with_mins)
    packed, w = random_packed(out, inp, bits, with_mins, g, per16)
    for batch in (1, 7, 15, 17, 130):
        x = torch.randn(batch, inp, generator=g)
        y = op(x.bfloat16(), *packed, u4, out)
        assert y.dtype == torch.bfloat16 and y.shape == (batch, out)
        xb = x.bfloat16().double()
        ref = xb @ w.T
        bound = 2 ** -8 * (xb.abs() @ w.abs().T) + 2 ** -8 * ref.abs() + 1e-6
        assert ((y.double() - ref).abs() <= bound).all(), (batch, (y.double() - ref).abs().max())
        assert torch.equal(op(x, *packed, u4, out), y)
        if batch == 17:  # a strided (non-contiguous) input is copied, with the same result
            wide = torch.zeros(batch, inp + 8, dtype=torch.bfloat16)
            wide[:, :inp] = x.bfloat16()
            assert torch.equal(op(wide[:, :inp], *packed, u4, out), y)
    with pytest.raises(RuntimeError, match="features"):
        op(torch.randn(3, blocks * 32 + 32), *packed, u4, out)


@pytest.mark.parametrize("out, inp", [(600, 1536), (600, 576), (40, 576), (16, 100)])
def test_bf16_gemm_threads_give_the_same_floats(bf16_gemm, out, inp):
    """The bf16 GEMMs' split over threads (one contiguous share of output tile pairs, or groups of 3 tiles, per
    thread, each share in panels of its own): 2, 3 and 5 threads give one thread's outputs bit for bit, whether the
    tiles split evenly or not (600 outputs: 38 tiles; 1,536 inputs: several panels per share), fewer tile groups
    than threads (40: 3 tiles; 16: one) or a last tile past the outputs; and the one-thread outputs match the
    float64 reference."""
    op = bf16_gemm
    g = torch.Generator().manual_seed(out + inp)
    packed, w = random_packed(out, inp, 4, True, g)
    threads = torch.get_num_threads()
    try:
        for batch in (17, 130):
            x = torch.randn(batch, inp, generator=g).bfloat16()
            torch.set_num_threads(1)
            one = op(x, *packed, True, out)
            ref = x.double() @ w.T
            bound = 2 ** -8 * (x.double().abs() @ w.abs().T) + 2 ** -8 * ref.abs() + 1e-6
            assert ((one.double() - ref).abs() <= bound).all(), batch
            for n in (2, 3, 5):
                torch.set_num_threads(n)
                assert torch.equal(op(x, *packed, True, out), one), (batch, n)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("inp", [576, 1536, 100])
@pytest.mark.parametrize("bits, with_mins, per16", [(8, False, False), (8, True, False), (4, True, False),
                                                    (5, True, False), (6, False, True), (4, False, True),
                                                    (4, False, "table"), (2, True, True)])
def test_amx_swiglu_gemm_is_the_gemm_then_silu_and_mul(cpu_isa, bits, with_mins, per16, inp, monkeypatch):
    """amx_bf16_linear_swiglu (SwiGLU in the AMX GEMM's store: gate tile i and up tile i as one tile pair) gives
    silu_and_mul(amx_bf16_linear(x)) bit for bit: 2 x 304 outputs (19 gate tiles: an odd count, several panels),
    batches with partial tiles, 1, 2 and 3 threads; the backend's bound call is that op, and under
    GLMSERVE_BF16_PREPACK=1 the oneDNN product then silu_and_mul. Outputs that are not two halves of a multiple of
    16 are refused."""
    if not kernels.amx_bf16():
        pytest.skip(f"no AMX-BF16 tiles here ({cpu_isa})")
    gemm, fused = (kernels.op(name, CPU, torch.float32) for name in ("amx_bf16_linear", "amx_bf16_linear_swiglu"))
    silu = kernels.op("silu_and_mul", CPU, torch.bfloat16)
    out, u4 = 2 * 304, bits < 8
    g = torch.Generator().manual_seed(inp + 2 * bits + with_mins)
    packed, _ = random_packed(out, inp, bits, with_mins, g, per16)
    threads = torch.get_num_threads()
    try:
        for batch in (1, 17, 130):
            x = torch.randn(batch, inp, generator=g).bfloat16()
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                expected = silu(gemm(x, *packed, u4, out))
                assert torch.equal(fused(x, *packed, u4, out), expected), (batch, n)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="halves"):
        fused(x, *packed, u4, out - 16)
    backend = CpuBlockBackend()
    prepared = backend.prepare(weight("gguf_q4_1", 2 * 48, 576), None, CPU)
    call, rows = backend.dense_batch_swiglu(prepared)
    assert rows == backend.dense_batch(prepared)[1]
    x = torch.randn(rows, 576, generator=g).bfloat16()
    assert torch.equal(call(x), silu(backend.dense_batch(prepared)[0](x)))
    monkeypatch.setenv(PREPACK_ENV, "1")
    assert torch.equal(call(x), silu(dense_apply(prepared, x)))
    assert backend.dense_batch_swiglu(backend.prepare(weight("gguf_q4_1", 2 * 40, 576), None, CPU)) is None


@pytest.mark.parametrize("name", list(BF16_GEMMS))
def test_bf16_gemm_is_an_error_where_the_cpu_lacks_it(cpu_isa, name):
    """Where a bf16 GEMM cannot run (no AMX, no AVX512-BF16, or the avx2 / scalar build) its op is a clear error,
    never a silent wrong result."""
    if getattr(kernels, BF16_GEMMS[name])():
        pytest.skip(f"{cpu_isa} runs {name} here")
    op = kernels.op(name, CPU, torch.float32)
    packed = pack(torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, 1).half(), None, 8)
    if op is not None:
        with pytest.raises(RuntimeError, match="AMX|AVX512-BF16|avx512"):
            op(torch.randn(2, 32), *packed, False, 16)


def test_avx512_bf16_rows_must_be_a_positive_count(cpu_isa, monkeypatch):
    """GLMSERVE_AVX512_BF16_ROWS (the rows from which CPUs with AVX512-BF16 but no AMX take the bf16 GEMM) is
    refused unless a positive number; unset, such CPUs keep the int8 tiles for every batch."""
    if kernels.amx_bf16() or not kernels.avx512_bf16():
        pytest.skip(f"the variable is read on CPUs with AVX512-BF16 and no AMX ({cpu_isa} here)")
    assert dense_path_for(CPU) is None
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(AVX512_BF16_ROWS_ENV, bad)
        with pytest.raises(InvalidRequestError, match=AVX512_BF16_ROWS_ENV):
            dense_path_for(CPU)
    monkeypatch.setenv(AVX512_BF16_ROWS_ENV, "512")
    assert dense_path_for(CPU).min_rows == 512


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_rows_reads_the_packed_layout_back(cpu_isa, fmt):
    """Rows of d * c + m from the tiles (ids across tiles, the last one padded), one float32 rounding of the
    stored weight; Q8_0 (a product only) equals reference.dequantize exactly."""
    out, inp = 200, 640  # 13 tiles, 20 blocks
    w = weight(fmt, out, inp)
    backend = CpuBlockBackend()
    ids = torch.tensor([0, 15, 16, 129, 199, 3, 16])
    rows = backend.dequantize_rows(backend.prepare(w, FORMATS[fmt][1], CPU), ids, torch.float32)
    w_stored, w_abs = stored_weight(fmt, out, inp)
    assert rows.shape == (len(ids), inp)
    assert ((rows.double() - w_stored[ids, :inp]).abs() <= 2 ** -24 * w_abs[ids, :inp].double() + 1e-12).all()
    if fmt == "gguf_q8_0":
        assert torch.equal(rows, dequantize(w)[ids])


def test_cpu_block_layers_keep_no_canonical_copy(cpu_isa):
    """The packed tiles serve a tied embedding's rows, so neither the head nor the embedding keeps the
    canonical codes (int4 codes one byte each: more than the packed weight itself)."""
    vocab, dim = 96, 64
    q = weight("gguf_q8_0", vocab, dim)
    native = Scheme("checkpoint", None)
    embed = QuantizedEmbedding(vocab, dim, native, CPU, torch.float32)
    head = QuantizedLinear(dim, [vocab], native, False, CPU, torch.float32)
    embed.tie(head)
    embed.load_weight("weight", q, WHOLE)
    embed.finalize()
    assert head._segments[0].canonical is None and embed.weight_bytes() == 0
    ids = torch.tensor([[3, 17, 3], [95, 0, 1]])
    assert torch.equal(embed(ids), dequantize(q)[ids])
    assert head.weight_bytes() == CpuBlockBackend().prepare(q, None, CPU).nbytes


def test_dequantize_rows_drops_the_input_padding(cpu_isa):
    """in_features not a multiple of 32: the padded inputs of the last block are not returned."""
    w = quantize(torch.randn(21, 100), QuantSpec(8, strategy="channel"))
    backend = CpuBlockBackend()
    ids = torch.tensor([20, 0, 16])
    rows = backend.dequantize_rows(backend.prepare(w, None, CPU), ids, torch.float32)
    torch.testing.assert_close(rows, dequantize(w)[ids], rtol=1e-3, atol=0)  # d rounded to fp16 by the packing


def test_embedded_model_decodes_a_batch_of_32_the_same_on_amx_and_vnni_tiles(cpu_isa):
    """Greedy decode of 32 prompts at once on the default model (Q4_1 / Q8_0 blocks): the AMX tiles give the
    VNNI tiles' tokens and logprobs exactly (the batched linears, the Q8_0 lm_head included, at M = 32). No
    prefix caching: the second run recomputes the same prompts in the same steps."""
    from glmserve import LLM, SamplingParams

    set_amx = kernels.op("set_amx", CPU, torch.float32)
    if not set_amx(True):
        pytest.skip(f"no AMX int8 tiles on {cpu_isa} here")
    llm = LLM(model=None, dtype="float32", max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=256,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 20000, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 24, (32,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    try:
        amx = llm.generate(prompts, params)
        set_amx(False)
        vnni = llm.generate(prompts, params)
    finally:
        set_amx(True)
    for a, v in zip(amx, vnni):
        assert a.outputs[0].token_ids == v.outputs[0].token_ids
        assert a.outputs[0].logprobs == v.outputs[0].logprobs
