"""Checkpoints in the compressed-tensors layout (what vLLM, SGLang and llm-compressor read and write):
QuantizedWeights to named tensors plus a `quantization_config`, and back, losslessly.

Followed: compressed-tensors 0.20 (compressors/naive_quantized, pack_quantized, nvfp4; quantization/quant_args,
quant_config) and vLLM's compressed_tensors.py scheme detection. Per format:
  int-quantized (W8A8, any int weight with int activations): `weight` int8 codes in the signed range
    [-2^(b-1), 2^(b-1) - 1] (asymmetric too: compressed-tensors' range is signed), `weight_scale`,
    `weight_zero_point` (int8, asymmetric only).
  pack-quantized (int4 / int8 weight-only, vLLM's WNA16): `weight_packed` int32 [out, ceil(in * b / 32)] holding
    code + 2^(b-1) little-endian (element i at bit b * i), `weight_shape` [out, in], `weight_scale`, and for
    asymmetric weights `weight_zero_point` packed the same way along the output dim: [ceil(out * b / 32), groups].
    A float minimum per group (spec.float_min, w = s * q + m) is a float zero point in compressed-tensors' terms
    (QuantizationArgs.zp_dtype, its quantize/dequantize: (q - z) * s with z not rounded): args `zp_dtype`
    "torch.float32", `weight_zero_point` float32 [out, groups] holding z = -m / s in the signed code range, not
    packed (compressed-tensors 0.20's pack-quantized compressor packs integer zero points only, and vLLM's WNA16
    reads them packed: **vLLM does not load this variant**; we do). Read back, m = -z * s rounds to the float16
    minimum it came from: float32 z keeps 24 bits, the float16 m 11, so the round trip is exact wherever
    8 s < 2^12 |m| (a group's minimum not within 1/512 of a scale step from 0; an exact 0 stays 0).
  float-quantized (fp8 E4M3 by channel, tensor or 128x128 block): `weight` float8_e4m3fn, `weight_scale`.
  nvfp4-pack-quantized: `weight_packed` uint8 [out, in / 2] (E2M1 codes, low nibble first), `weight_scale`
    float8_e4m3fn [out, in / 16], `weight_global_scale` fp32 [1].
Scales keep the dtype they have in the QuantizedWeight (float32 from our quantizers) so the round trip is exact;
a tensor-strategy scale is stored as [1], as compressed-tensors does. When config groups need different formats
the top-level `format` is `mixed-precision` and each group names its own, as compressed-tensors writes it.

Our own extension (vLLM does not read it): a module whose outlier input columns stay in float (the seeds'
`activation_threshold` recipe) also has `outlier_weight` [out, k] (float) and `outlier_columns` [k] (int64); its
quantized weight has those columns zeroed, and y = dequant(W) x + outlier_weight x[..., outlier_columns].
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glmserve.errors import InvalidRequestError, UnsupportedModelError
from glmserve.quant.reference import dequantize
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import OutlierColumns, QuantizedWeight

QUANT_METHOD = "compressed-tensors"
INT_QUANTIZED, PACK_QUANTIZED = "int-quantized", "pack-quantized"
FLOAT_QUANTIZED, NVFP4_PACKED, MIXED = "float-quantized", "nvfp4-pack-quantized", "mixed-precision"
FLOAT_ZERO_POINT = "torch.float32"  # the zp_dtype of a float minimum's zero point (see the module docstring)
WEIGHTS_FILE = "model.safetensors"


@dataclass
class QuantizedModule:
    """One linear layer as a checkpoint holds it: its weight, the activation format it runs with (W8A8's
    dynamic int8 tokens; None for weight-only) and its float outlier columns, if any."""

    weight: QuantizedWeight
    input_activations: QuantSpec | None = None
    outliers: OutlierColumns | None = None


def dense_weight(module: QuantizedModule, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight the module computes with: dequantized, its outlier columns (zero in the quantized part)
    put back."""
    w = dequantize(module.weight, dtype)
    if module.outliers is not None:
        w[:, module.outliers.columns] = module.outliers.weight.to(dtype)
    return w


# ---- QuantSpec <-> QuantizationArgs ----

def spec_to_args(spec: QuantSpec) -> dict:
    """The QuantizationArgs dict compressed-tensors writes for `spec`."""
    if spec.gguf_type is not None:
        raise InvalidRequestError(f"GGUF block format {spec.gguf_type} has no compressed-tensors form")
    args = {"num_bits": spec.num_bits, "type": spec.type, "symmetric": spec.symmetric,
            "group_size": spec.group_size, "strategy": spec.strategy, "dynamic": spec.dynamic}
    if spec.block_structure is not None:
        args["block_structure"] = list(spec.block_structure)
    if spec.float_min:
        args["zp_dtype"] = FLOAT_ZERO_POINT
    return args


def _float_zero_point(args: Mapping) -> bool:
    """Whether asymmetric int args carry a float zero point (a `zp_dtype` such as "torch.float32")."""
    zp = args.get("zp_dtype")
    if zp is None or args.get("symmetric", True) or args.get("type", "int") != "int":
        return False
    dtype = getattr(torch, str(zp).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedModelError(f"unknown zp_dtype {zp!r}")
    return dtype.is_floating_point


def args_to_spec(args: Mapping) -> QuantSpec:
    block = args.get("block_structure")
    if isinstance(block, str):  # older compressed-tensors wrote "128x128"
        block = tuple(int(v) for v in block.lower().split("x"))
    strategy = args.get("strategy") or ("group" if args.get("group_size") else "tensor")
    dynamic = args.get("dynamic", False)
    return QuantSpec(num_bits=int(args["num_bits"]), type=args.get("type", "int"),
                     symmetric=bool(args.get("symmetric", True)), strategy=strategy,
                     group_size=args.get("group_size"), block_structure=tuple(block) if block else None,
                     dynamic=dynamic if isinstance(dynamic, bool) else dynamic == "local",
                     zero_point="float" if _float_zero_point(args) else "int")


def format_of(weight: QuantSpec, activations: QuantSpec | None) -> str:
    """The compressor compressed-tensors (and vLLM's scheme detection) uses for this weight/activation pair."""
    if weight.type == "float":
        if weight.num_bits == 8:
            return FLOAT_QUANTIZED
        if weight.num_bits == 4 and weight.strategy == "tensor_group" and weight.group_size == 16:
            return NVFP4_PACKED
        raise InvalidRequestError(f"no compressed-tensors format for float weights {weight}")
    if activations is None and weight.num_bits in (4, 8):
        return PACK_QUANTIZED
    return INT_QUANTIZED


# ---- tensors of one module ----

def _pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes [rows, cols] -> int32 [rows, ceil(cols * bits / 32)] (compressed-tensors' pack_to_int32 for
    4 and 8 bits: unsigned code + 2^(bits-1), element i at bit bits * i of the little-endian stream)."""
    rows, cols = values.shape
    per_word = 32 // bits
    u = (values.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    u = torch.nn.functional.pad(u, (0, -cols % per_word))
    if bits == 4:
        u = u[:, 0::2] | (u[:, 1::2] << 4)
    return u.contiguous().flatten().view(torch.int32).reshape(rows, -1)  # flatten: a [1, n] view may keep odd strides


def _unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    u = packed.contiguous().flatten().view(torch.uint8).reshape(packed.shape[0], -1)
    if bits == 4:
        u = torch.stack((u & 0xF, u >> 4), dim=-1).flatten(-2)
    return (u[:, :cols].to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def _offset(spec: QuantSpec) -> int:
    """What our canonical codes/zeros minus compressed-tensors' signed ones is: 0 for symmetric codes and for
    asymmetric int4 codes in [0, 15] and int8 in [0, 255] it is 2^(bits-1)."""
    return 0 if spec.symmetric else 1 << (spec.num_bits - 1)


def _store_scale(scales: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    return scales.reshape(1) if spec.strategy == "tensor" else scales


def _zero_point_of_min(mins: torch.Tensor, scales: torch.Tensor, offset: int) -> torch.Tensor:
    """The float32 zero point z (signed code range) of w = s * q + m: s * (q - offset - z) = s * q + m."""
    return (-mins.double() / scales.double() - offset).to(torch.float32)


def _min_of_zero_point(zero: torch.Tensor, scales: torch.Tensor, offset: int) -> torch.Tensor:
    """The inverse of `_zero_point_of_min`: the float16 minimum m = -s * (z + offset)."""
    return (-(zero.double() + offset) * scales.double()).reshape(scales.shape).to(torch.float16)


def encode(module: QuantizedModule) -> dict[str, torch.Tensor]:
    """The module's tensors by suffix (`weight_packed`, `weight_scale`, ...) as compressed-tensors stores them."""
    w, spec = module.weight, module.weight.spec
    fmt = format_of(spec, module.input_activations)
    out: dict[str, torch.Tensor] = {"weight_scale": _store_scale(w.scales, spec)}
    if w.mins is not None and not spec.float_min:
        raise InvalidRequestError("a weight with per-block minimums (GGUF Q4_1) has no compressed-tensors form")
    if fmt == NVFP4_PACKED:
        codes = w.codes.to(torch.uint8)
        out["weight_packed"] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        out["weight_global_scale"] = w.global_scale.reshape(1).to(torch.float32)
    elif fmt == FLOAT_QUANTIZED:
        out["weight"] = w.codes
    else:
        off = _offset(spec)
        codes = (w.codes.to(torch.int16) - off).to(torch.int8)
        zeros = None if w.zeros is None else (w.zeros.to(torch.int16) - off).to(torch.int8)
        if spec.float_min:
            out["weight_zero_point"] = _store_scale(_zero_point_of_min(w.mins, w.scales, off), spec)
        if fmt == PACK_QUANTIZED:
            out["weight_packed"] = _pack_int32(codes, spec.num_bits)
            out["weight_shape"] = torch.tensor(w.shape, dtype=torch.int64)
            if zeros is not None:
                out["weight_zero_point"] = _pack_int32(zeros.T, spec.num_bits).T.contiguous()
        else:
            out["weight"] = codes
            if zeros is not None:
                out["weight_zero_point"] = _store_scale(zeros, spec)
    if module.outliers is not None:
        out["outlier_columns"] = module.outliers.columns.to(torch.int64)
        out["outlier_weight"] = module.outliers.weight.contiguous()
    return out


def decode(tensors: Mapping[str, torch.Tensor], spec: QuantSpec, activations: QuantSpec | None) -> QuantizedModule:
    """The inverse of `encode`: one module's tensors (by suffix) under its config group's specs."""
    fmt = format_of(spec, activations)
    scales = tensors["weight_scale"]
    zeros = global_scale = mins = None
    if fmt == NVFP4_PACKED:
        packed = tensors["weight_packed"]
        codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
        global_scale = tensors["weight_global_scale"].reshape(())
    elif fmt == FLOAT_QUANTIZED:
        codes = tensors["weight"]
    else:
        off = _offset(spec)
        code_dtype = torch.uint8 if not spec.symmetric and spec.num_bits == 8 else torch.int8
        zero_dtype = torch.int16 if spec.num_bits == 8 else torch.int8
        if fmt == PACK_QUANTIZED:
            out_features, in_features = (int(v) for v in tensors["weight_shape"])
            signed = _unpack_int32(tensors["weight_packed"], spec.num_bits, in_features)
            if spec.float_min:
                mins = _min_of_zero_point(tensors["weight_zero_point"], scales, off)
            elif "weight_zero_point" in tensors:
                zp = _unpack_int32(tensors["weight_zero_point"].T, spec.num_bits, out_features).T
                zeros = (zp.to(torch.int16) + off).to(zero_dtype)
        else:
            signed = tensors["weight"]
            if spec.float_min:
                mins = _min_of_zero_point(tensors["weight_zero_point"], scales, off)
            elif "weight_zero_point" in tensors:
                zeros = (tensors["weight_zero_point"].to(torch.int16) + off).to(zero_dtype).reshape(scales.shape[0], -1)
        codes = (signed.to(torch.int16) + off).to(code_dtype)
    if spec.strategy == "tensor":
        scales = scales.reshape(1, 1)
        zeros = None if zeros is None else zeros.reshape(1, 1)
        mins = None if mins is None else mins.reshape(1, 1)
    outliers = None
    if "outlier_columns" in tensors:
        outliers = OutlierColumns(tensors["outlier_columns"], tensors["outlier_weight"])
    weight = QuantizedWeight(spec, codes.contiguous(), scales, zeros=zeros, mins=mins, global_scale=global_scale)
    return QuantizedModule(weight, activations, outliers)


# ---- the whole checkpoint ----

def quantization_config(modules: Mapping[str, QuantizedModule], ignore: Iterable[str]) -> dict:
    """`quantization_config` for config.json: one config group per (weight, activation) format, targeting its
    modules by name; `ignore` names the linear layers left in float (lm_head, ...)."""
    groups: dict[tuple, list[str]] = {}
    for name, m in modules.items():
        groups.setdefault((m.weight.spec, m.input_activations), []).append(name)
    config_groups, formats = {}, set()
    for i, ((w, a), names) in enumerate(groups.items()):
        fmt = format_of(w, a)
        formats.add(fmt)
        config_groups[f"group_{i}"] = {"targets": sorted(names), "weights": spec_to_args(w),
                                       "input_activations": None if a is None else spec_to_args(a),
                                       "output_activations": None, "format": fmt}
    mixed = len(formats) > 1
    if not mixed:  # one format: only the top-level key, as before per-group formats existed
        for group in config_groups.values():
            del group["format"]
    return {"quant_method": QUANT_METHOD, "format": MIXED if mixed else next(iter(formats), "dense"),
            "quantization_status": "compressed", "config_groups": config_groups, "ignore": sorted(ignore),
            "kv_cache_scheme": None, "global_compression_ratio": None}


def save_checkpoint(out_dir: Path, modules: Mapping[str, QuantizedModule], float_tensors: Mapping[str, torch.Tensor],
                    hf_config: dict, ignore: Iterable[str]) -> None:
    """model.safetensors (each module's tensors as `<module>.<suffix>`, then the float tensors by name) and
    config.json (`hf_config` plus the quantization_config). Written to temporary names, then renamed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = dict(float_tensors)
    for name, module in modules.items():
        for suffix, t in encode(module).items():
            tensors[f"{name}.{suffix}"] = t
    seen: set[int] = set()
    for name, t in tensors.items():  # safetensors stores no shared memory (a fused layer's one global scale)
        t = t.contiguous()
        tensors[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    config = {**hf_config, "quantization_config": quantization_config(modules, ignore)}
    tmp_weights, tmp_config = out_dir / (WEIGHTS_FILE + ".tmp"), out_dir / "config.json.tmp"
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    tmp_config.write_text(json.dumps(config, indent=2) + "\n")
    tmp_weights.replace(out_dir / WEIGHTS_FILE)
    tmp_config.replace(out_dir / "config.json")


def module_specs(qconfig: Mapping) -> dict[str, tuple[QuantSpec, QuantSpec | None]]:
    """Module name -> (weight spec, activation spec) from a quantization_config whose targets name modules (ours).
    Class-name or regex targets (llm-compressor's "Linear", "re:...") need the model's module list: `resolve`."""
    if qconfig.get("quant_method") != QUANT_METHOD:
        raise UnsupportedModelError(f"quant_method {qconfig.get('quant_method')!r} is not {QUANT_METHOD}")
    specs = {}
    for name, group in qconfig.get("config_groups", {}).items():
        if group.get("weights") is None:
            continue
        try:
            w = args_to_spec(group["weights"])
            a = None if group.get("input_activations") is None else args_to_spec(group["input_activations"])
            targets = list(group["targets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedModelError(f"quantization_config group {name!r} is malformed: {exc!r}") from None
        declared = group.get("format") or qconfig.get("format")
        expected = format_of(w, a)
        if declared not in (None, MIXED, expected):  # our decoding reads the layout format_of names
            raise UnsupportedModelError(f"quantization_config group {name!r}: format {declared!r} is not read "
                                        f"(its weights {w} are read as {expected!r})")
        for target in targets:
            specs[target] = (w, a)
    return specs


def resolve(qconfig: Mapping, linear_names: Iterable[str]) -> dict[str, tuple[QuantSpec, QuantSpec | None]]:
    """Each quantized linear layer's specs: targets are a module name, "re:<regex>" or the class name "Linear",
    and `ignore` entries (names or regexes) win, as in compressed-tensors' match_named_modules."""
    def matches(pattern: str, name: str) -> bool:
        if pattern.startswith("re:"):
            return re.match(pattern[3:], name) is not None
        return pattern in ("Linear", name)

    by_target = module_specs(qconfig)
    out = {}
    for name in linear_names:
        if any(matches(p, name) for p in qconfig.get("ignore", [])):
            continue
        hit = next((specs for target, specs in by_target.items() if matches(target, name)), None)
        if hit is not None:
            out[name] = hit
    return out


def quantized_modules(qconfig: Mapping, keys: Iterable[str]) -> dict[str, tuple[QuantSpec, QuantSpec | None]]:
    """The quantized linear layers of a checkpoint whose tensor names are `keys` (those with a `weight_scale`
    or `weight_packed` that a config group targets), with their specs."""
    linear = {key.rsplit(".", 1)[0] for key in keys if key.endswith((".weight_scale", ".weight_packed"))}
    return resolve(qconfig, linear)


def stream_modules(qconfig: Mapping, keys: Iterable[str], tensors: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor | QuantizedModule]]:
    """The checkpoint's tensors (`keys`: every name `tensors` yields) with each quantized module's tensors
    (`<module>.<suffix>`, its bias aside) decoded into one QuantizedModule, yielded under the module's name as
    soon as its last tensor is read; every other tensor passes through as it comes. Only the modules in
    progress are held."""
    keys = list(keys)
    specs = quantized_modules(qconfig, keys)
    owner = {}
    for key in keys:
        module, _, suffix = key.rpartition(".")
        if module in specs and suffix != "bias":
            owner[key] = module
    missing = Counter(owner.values())
    pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, tensor in tensors:
        module = owner.get(key)
        if module is None:
            yield key, tensor
            continue
        pending[module][key.rpartition(".")[2]] = tensor
        missing[module] -= 1
        if missing[module] == 0:
            weight, activations = specs[module]
            own = pending.pop(module)
            try:
                yield module, decode(own, weight, activations)
            except KeyError as exc:
                raise UnsupportedModelError(f"{module}: its {format_of(weight, activations)} weight needs a "
                                            f"{exc.args[0]!r} tensor; the checkpoint has {sorted(own)}") from None


def safetensors_keys(files: Iterable[Path]) -> list[str]:
    """Every tensor name of the files (read from their headers, no tensor loaded)."""
    keys = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys.extend(f.keys())
    return keys


def read_safetensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_checkpoint(folder: Path) -> tuple[dict, dict[str, QuantizedModule], dict[str, torch.Tensor]]:
    """(config.json, quantized modules by name, the remaining float tensors by name) of a folder written by
    `save_checkpoint` or by llm-compressor (one or several safetensors files)."""
    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" not in config:
        raise UnsupportedModelError(f"{folder}/config.json has no quantization_config")
    files = sorted(folder.glob("*.safetensors"))
    modules: dict[str, QuantizedModule] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, item in stream_modules(config["quantization_config"], safetensors_keys(files), read_safetensors(files)):
        if isinstance(item, QuantizedModule):
            modules[name] = item
        else:
            rest[name] = item
    return config, modules, rest
