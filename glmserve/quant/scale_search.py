"""Scale search: per (row, group) the quantization range with the smallest weighted squared rounding error,
instead of the absmax (or min/max) range round to nearest takes.

For each candidate factor f the group's range is scaled by f (quantize's `shrink`) and the weight rounded; each
(row, group) keeps the factor whose error sum_j h_j (w_j - q_j)^2 is smallest, h_j the importance of input j
(the Hessian diagonal: the mean square of that input's activation; all ones without calibration). This follows the
MSE grid search of GPTQ's reference quantizer (quant.py, `find_params` with mse=True: min and max shrunk together by
p = 1, 0.99, ..., 0.2) and llama.cpp's importance-weighted scale search (ggml-quants.c, `make_qx_quants` /
`make_qkx3_quants` with the imatrix's `quant_weights`); the weighting by the Hessian diagonal is that imatrix's.
Integer formats search f in {1, 0.99, ..., 0.5} (clipping). FP8 E4M3 search f = 2^(k/32), k = -8..31: below 1
clips the largest values, above 1 shifts E4M3's relative grid against the weights without clipping (f = 2 would
repeat f = 1 a binade lower). f = 1 (round to nearest) is tried first and kept on ties, so the search never does
worse than round to nearest on its own objective. The result is an ordinary QuantizedWeight: only the scales
(and zero points) differ, so every backend runs it, and GPTQ can keep these scales fixed (calibrate.gptq's
`initial`).
"""

from __future__ import annotations

import torch

from glmserve.quant.quantize import grouped, quantize
from glmserve.quant.reference import dequantize
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight

INT_FACTORS = tuple(1.0 - k / 100 for k in range(51))
FP8_FACTORS = (1.0,) + tuple(2.0 ** (k / 32) for k in range(-8, 32) if k)


def supports(spec: QuantSpec) -> bool:
    """Integer group / channel weights and FP8 E4M3 per channel, group or block (one scale per range)."""
    if spec.gguf_type is not None:
        return False
    if spec.type == "float":
        return spec.num_bits == 8 and spec.strategy in ("channel", "group", "block")
    return spec.strategy in ("channel", "group")


def factors(spec: QuantSpec) -> tuple[float, ...]:
    return FP8_FACTORS if spec.type == "float" else INT_FACTORS


@torch.no_grad()
def search_quantize(w: torch.Tensor, spec: QuantSpec, importance: torch.Tensor | None = None) -> QuantizedWeight:
    """`w` [out, in] quantized with, per (row, group), the range factor of smallest importance-weighted squared
    error; `importance` [in] >= 0 (None: plain squared error)."""
    if not supports(spec):
        raise ValueError(f"the scale search covers integer group/channel and FP8 channel/group/block weights, "
                         f"not {spec}")
    w = w.detach().float()
    if importance is not None and importance.shape != (w.shape[1],):
        raise ValueError(f"importance has shape {tuple(importance.shape)}, expected ({w.shape[1]},)")
    imp = torch.ones_like(w) if importance is None else importance.float().clamp_min(0).expand_as(w).contiguous()
    g, gi = grouped(w, spec), grouped(imp, spec)
    best_err = torch.full(g.shape[:-1] + (1,), float("inf"))
    best = torch.ones_like(best_err)
    for f in factors(spec):
        err = ((grouped(dequantize(quantize(w, spec, shrink=f)), spec) - g).square() * gi).sum(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, f), best)
    return quantize(w, spec, shrink=best)
