"""GGUF blocks packed straight into the CPU kernel's tiles (quant/cpu_backend.py `pack_gguf`) against the generic
path (canonical codes -> block_form -> pack): the packed codes, scales and mins bit for bit, on blocks of each native
type (edge cases included), on stacked and reordered parts as a fused q|k|v has them, and on every native tensor of
the embedded SmolLM2 GGUF."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from glmserve.errors import InvalidRequestError
from glmserve.layers.embedding import QuantizedEmbedding
from glmserve.layers.param_loading import WHOLE
from glmserve.models.gguf_loader import embedded_default_gguf, load_gguf
from glmserve.quant.cpu_backend import block_form, pack, pack_gguf
from glmserve.quant.gguf_blocks import NATIVE, GGUFBlockWeight, from_blocks
from glmserve.quant.reference import dequantize
from glmserve.quant.schemes import Scheme
from glmserve.quant.weight import QuantizedWeight, concat_rows


def _gguf(gguf_type: str, out: int, inp: int, seed: int = 0) -> GGUFBlockWeight:
    """llama.cpp's quantization of random weights, with an all-zero and a tiny-valued block."""
    w = np.random.default_rng(seed).standard_normal((out, inp), dtype=np.float32) * 0.05
    w[0, :32] = 0
    w[-1, -32:] *= 1e-4
    return from_blocks(gguf_quantize(w, GGMLQuantizationType[gguf_type]), gguf_type, (out, inp))


def _generic(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The path of every other weight: the canonical tensors (made from the blocks), block_form, pack."""
    canonical = QuantizedWeight(weight.spec, weight.codes, weight.scales, None, weight.mins)
    return pack(*block_form(canonical), weight.spec.num_bits)


def _assert_same_bits(fast: tuple[torch.Tensor, ...], generic: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(fast, generic, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert not a.numel() or a.data_ptr() % 64 == 0  # whole cache lines per 64-byte load, as pack's tiles
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else not b.numel()


@pytest.mark.parametrize("gguf_type", NATIVE)
@pytest.mark.parametrize("out", [48, 40, 5])  # whole tiles of 16 rows, then rows padded to a tile
def test_blocks_pack_like_the_canonical_path(gguf_type, out):
    weight = _gguf(gguf_type, out, 96)
    _assert_same_bits(pack_gguf(weight), _generic(weight))


@pytest.mark.parametrize("gguf_type", NATIVE)
def test_untied_embedding_unpacks_only_the_rows_it_looks_up(gguf_type):
    """An untied GGUF embedding keeps its blocks: a lookup gives the dequantized rows and never makes the whole
    matrix's canonical codes (49,152 x 576 int8, 28 MB, on a real vocabulary)."""
    weight = _gguf(gguf_type, 96, 64, seed=5)
    expected = dequantize(_gguf(gguf_type, 96, 64, seed=5))
    embed = QuantizedEmbedding(96, 64, Scheme("checkpoint", None), torch.device("cpu"), torch.float32)
    embed.load_weight("weight", weight, WHOLE)
    embed.finalize()
    ids = torch.tensor([[3, 95, 3], [0, 41, 7]])
    assert torch.equal(embed(ids), expected[ids])
    assert embed.weight_bytes() == weight.blocks.nbytes
    assert "codes" not in vars(weight) and "scales" not in vars(weight)


@pytest.mark.parametrize("gguf_type", NATIVE)
def test_fused_parts_reordered_and_stacked(gguf_type):
    """q (rows reordered as the rotary unpermute does), k and v stacked by rows into one tile layout, 40 + 24 + 24
    rows: the parts' boundaries fall inside tiles."""
    q = _gguf(gguf_type, 40, 64, seed=1).take_rows(np.random.default_rng(2).permutation(40))
    parts = [q, _gguf(gguf_type, 24, 64, seed=3), _gguf(gguf_type, 24, 64, seed=4)]
    fused = concat_rows(parts)
    assert isinstance(fused, GGUFBlockWeight) and fused.shape == (88, 64)
    assert torch.equal(fused.codes, torch.cat([p.codes for p in parts]))
    _assert_same_bits(pack_gguf(fused), _generic(fused))


def test_q4_0_without_negative_codes_keeps_them_unmoved():
    """Q4_0 whose nibbles are all >= 8 (codes q - 8 >= 0): block_form stores q - 8 with no mins."""
    weight = _gguf("Q4_0", 16, 64)
    weight.blocks[..., 2:] |= 0x88
    fast = pack_gguf(weight)
    assert not fast[2].numel()
    _assert_same_bits(fast, _generic(weight))


def test_q4_1_negative_zero_min_under_a_negative_scale():
    """m = -d * 0 + min in float32 (block_form): a -0.0 min under a negative d comes out +0.0."""
    weight = _gguf("Q4_1", 16, 64)
    fields = weight.blocks.view(np.uint16)  # d, m: the first two fp16 words of each 20-byte block
    fields[:, :, 0] |= 0x8000
    fields[:, :, 1] = 0x8000
    _assert_same_bits(pack_gguf(weight), _generic(weight))


@pytest.mark.parametrize("gguf_type", NATIVE)
def test_non_finite_scale_is_refused(gguf_type):
    weight = _gguf(gguf_type, 16, 64)
    weight.blocks.view(np.uint16)[3, 1, 0] = 0x7C00  # +inf
    for path in (pack_gguf, _generic):
        with pytest.raises(InvalidRequestError, match="does not fit float16"):
            path(weight)


def test_embedded_model_tensors():
    """Every Q8_0 / Q4_1 matrix of the embedded model (q and k reordered by the rotary unpermute) and its fused
    q|k|v and gate|up."""
    checkpoint = load_gguf(embedded_default_gguf())
    tensors = dict(checkpoint.tensors(native=True))
    fusions = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
    fused = [concat_rows([tensors[f"model.layers.{i}.{p}.weight"] for p in parts])
             for i in (0, 29) for parts in fusions]
    blocks = [t for t in tensors.values() if isinstance(t, GGUFBlockWeight)]
    assert {t.gguf_type for t in blocks} == {"Q8_0", "Q4_1"} and len(blocks) == 211
    for weight in blocks + fused:
        _assert_same_bits(pack_gguf(weight), _generic(weight))
