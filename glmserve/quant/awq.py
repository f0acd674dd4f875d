"""AWQ: activation-aware weight quantization (Lin et al. 2023, arXiv 2306.00978), as the authors' llm-awq
implements it (awq/quantize/auto_scale.py, auto_clip.py), with the output error measured through the input Gram
matrix instead of stored activations: ||(W' - W) X^T||^2 / tokens = tr(E H E^T), E = W' - W, H = X^T X / tokens.

`search_scale`: per input channel s = mean|x|^alpha (normalized by sqrt(max * min), as llm-awq), alpha searched
on a grid of 20 in [0, 1) for the smallest summed output error of the layers that share the input when
quantized as Q(W diag(s)) diag(s)^-1; alpha 0 is round to nearest, so the search never loses to it on the
calibration statistics. The caller folds 1/s into the op that produces the input (an RMSNorm weight, or the
rows of up_proj for down_proj), so the served weight is Q(W diag(s)).
`clip_quantize`: per (row, group), the clipping range max|w| * r, r in {1, 0.975, ..., 0.525} (llm-awq's grid of
20 down to half), chosen for the smallest output error of that group (its diagonal block of H, as llm-awq scores
each group on its own), then round to nearest. Integer group / channel formats only, as GPTQ.
"""

from __future__ import annotations

import torch

from glmserve.quant.quantize import grouped, quantize, ungrouped
from glmserve.quant.reference import dequantize
from glmserve.quant.spec import QuantSpec
from glmserve.quant.weight import QuantizedWeight

SCALE_GRID = 20
CLIP_GRID = 20
CLIP_MIN = 0.5


def output_error(e: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(E H E^T): the summed squared output error of a weight error E [out, in] on inputs with Gram H."""
    return torch.einsum("oi,ij,oj->", e, hessian, e).item()


def _rtn(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    return dequantize(quantize(w, spec))


@torch.no_grad()
def search_scale(weights: list[torch.Tensor], hessian: torch.Tensor, absmean: torch.Tensor,
                 spec: QuantSpec) -> torch.Tensor:
    """The per-input-channel scale s [in] (all ones if no alpha beats round to nearest) for layers sharing an
    input with Gram `hessian` and mean |x| `absmean`."""
    h = hessian.float()
    salience = absmean.float().clamp_min(1e-8)
    best, best_err = torch.ones_like(salience), None
    for k in range(SCALE_GRID):
        s = salience ** (k / SCALE_GRID)
        s = s / (s.max() * s.min()).sqrt()
        err = sum(output_error(_rtn(w * s, spec) / s - w, h) for w in weights)
        if best_err is None or err < best_err:
            best, best_err = s, err
    return best


@torch.no_grad()
def clip_quantize(w: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec) -> QuantizedWeight:
    """Round to nearest after clipping each (row, group) to the range with the smallest output error on its
    block of `hessian`."""
    if spec.strategy not in ("group", "channel") or spec.type != "int" or spec.gguf_type is not None:
        raise ValueError(f"AWQ clipping applies to integer group/channel weights, not {spec}")
    w = w.float()
    g = grouped(w, spec)  # [out, groups, group_len]
    n_groups, size = g.shape[1], g.shape[2]
    h = hessian.float().reshape(n_groups, size, n_groups, size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    amax = g.abs().amax(dim=-1, keepdim=True)
    best_err = torch.full(g.shape[:2], float("inf"))
    best = g
    for k in range(CLIP_GRID):
        r = 1.0 - k * (1.0 - CLIP_MIN) / CLIP_GRID
        clipped = torch.maximum(torch.minimum(g, amax * r), -amax * r)
        e = grouped(_rtn(ungrouped(clipped, spec, w.shape), spec), spec) - g
        err = torch.einsum("ogi,gij,ogj->og", e, h, e)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better.unsqueeze(-1), clipped, best)
    return quantize(ungrouped(best, spec, w.shape), spec)


def supports(spec: QuantSpec) -> bool:
    """AWQ's scale search and clipping: integer group / channel weights."""
    return spec.type == "int" and spec.strategy in ("group", "channel") and spec.gguf_type is None
