"""compressed-tensors checkpoints: our export -> import is lossless for every scheme, and compressed-tensors'
own decompression of what we wrote equals our dequantization (the layout is theirs, not merely self-consistent)."""

from __future__ import annotations

import json

import pytest
import torch

from glmserve.quant.compressed_tensors import (
    QuantizedModule,
    format_of,
    load_checkpoint,
    save_checkpoint,
)
from glmserve.quant.quantize import quantize
from glmserve.quant.reference import dequantize
from tests.quant_specs import SCHEMES

SHAPE = (200, 192)  # out not a multiple of 8 (packed zero points pad) nor of 128 (fp8 blocks pad)


def _module(scheme: str, seed: int = 0) -> QuantizedModule:
    torch.manual_seed(seed)
    w = torch.randn(SHAPE) * 0.05 + 0.01
    spec, act = SCHEMES[scheme]
    return QuantizedModule(quantize(w, spec), act)


def _same(a: QuantizedModule, b: QuantizedModule) -> None:
    assert a.weight.spec == b.weight.spec and a.input_activations == b.input_activations
    for field in ("codes", "scales", "zeros", "mins", "global_scale"):
        x, y = getattr(a.weight, field), getattr(b.weight, field)
        assert (x is None) == (y is None), field
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, field
            assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                               y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y), field


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_round_trip_is_lossless(tmp_path, scheme):
    modules = {"model.layers.0.mlp.down_proj": _module(scheme), "model.layers.1.mlp.down_proj": _module(scheme, 1)}
    floats = {"model.embed_tokens.weight": torch.randn(10, 4), "lm_head.weight": torch.randn(10, 4)}
    save_checkpoint(tmp_path, modules, floats, {"model_type": "llama"}, ignore=["lm_head"])
    config, loaded, rest = load_checkpoint(tmp_path)
    assert config["model_type"] == "llama"
    assert set(loaded) == set(modules)
    for name in modules:
        _same(modules[name], loaded[name])
    assert set(rest) == set(floats) and all(torch.equal(rest[k], floats[k]) for k in floats)


def test_mixed_formats_name_their_own_format(tmp_path):
    modules = {"a.q_proj": _module("fp8"), "a.down_proj": _module("nvfp4"), "a.up_proj": _module("w4a16")}
    save_checkpoint(tmp_path, modules, {}, {}, ignore=["lm_head"])
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    assert sorted(g["format"] for g in qc["config_groups"].values()) == sorted(
        ["float-quantized", "nvfp4-pack-quantized", "pack-quantized"])
    _, loaded, _ = load_checkpoint(tmp_path)
    for name in modules:
        _same(modules[name], loaded[name])


ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is the test-only reference")


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_compressed_tensors_decompresses_what_we_wrote(tmp_path, scheme):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from safetensors.torch import load_file

    module = _module(scheme)
    if module.weight.spec.float_min:
        pytest.skip("compressed-tensors' pack-quantized compressor packs integer zero points only: "
                    "test_float_zero_point_dequantizes_by_their_formula checks this format")
    save_checkpoint(tmp_path, {"layer": module}, {}, {}, ignore=[])
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)  # their schema accepts our config
    group = next(iter(qc["config_groups"].values()))
    scheme_obj = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    fmt = format_of(module.weight.spec, module.input_activations)
    assert qc["format"] == fmt
    state = {k.split(".", 1)[1]: v for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    compressor = BaseCompressor.get_value_from_registry(fmt)
    theirs = compressor.decompress(state, scheme_obj)["weight"].float()
    ours = dequantize(module.weight)
    # their NVFP4 decompression computes in bfloat16 (unpack_fp4_from_uint8's default dtype): its rounding only
    rtol = 2 ** -8 if fmt == "nvfp4-pack-quantized" else 1e-6
    torch.testing.assert_close(theirs, ours, rtol=rtol, atol=1e-7)


def test_float_zero_point_dequantizes_by_their_formula(tmp_path):
    """A float minimum is written as a float32 zero point (zp_dtype): their schema reads the config back to the
    same args, and their dequantize formula (q - z) * s on the file's signed codes and zero points gives our
    weight."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
    from safetensors.torch import load_file

    from glmserve.quant.compressed_tensors import _unpack_int32

    module = _module("w4a16-fmin")
    save_checkpoint(tmp_path, {"layer": module}, {}, {}, ignore=[])
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    args = QuantizationArgs.model_validate(next(iter(qc["config_groups"].values()))["weights"])
    assert args.zp_dtype == torch.float32 and not args.symmetric
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["layer.weight_zero_point"].dtype == torch.float32
    signed = _unpack_int32(state["layer.weight_packed"], 4, SHAPE[1]).float()
    theirs = ct_dequantize(signed, state["layer.weight_scale"].float(), state["layer.weight_zero_point"], args)
    torch.testing.assert_close(theirs, dequantize(module.weight), rtol=1e-6, atol=1e-7)
