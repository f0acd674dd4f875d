"""SmoothQuant (Xiao et al. 2022, arXiv 2211.10438): migrate activation outliers into the weights before
quantizing both, as the authors' smoothquant/smooth.py (`smooth_ln_fcs`) computes it: per input channel j of the
layers that share one input, s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha) (absmax over the calibration tokens and
over the rows of every layer of the unit), the layers then compute with W diag(s) on inputs x / s. The caller folds
1/s into the op that produces the input (the same folds as AWQ: an RMSNorm weight, or up_proj's rows for
down_proj), so the model's function is unchanged in float and the quantized activations have flatter channels.
alpha 0 leaves activations as they are (s_j = 1 / max|W_:,j|); 0.5 (the paper's default) splits the range between
activations and weights; larger alpha moves more of it into the weights.
"""

from __future__ import annotations

import torch

from glmserve.errors import InvalidRequestError

EPS = 1e-5  # smooth.py's clamp on both maxima and on the scales


def check_alpha(alpha: float) -> float:
    if not 0.0 <= alpha <= 1.0:
        raise InvalidRequestError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    return float(alpha)


@torch.no_grad()
def smooth_scale(weights: list[torch.Tensor], act_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [in] for layers `weights` ([out_i, in] each) sharing an input whose per-channel absmax is `act_absmax`."""
    w_max = torch.cat([w.detach().float().abs() for w in weights]).amax(dim=0).clamp_min(EPS)
    a_max = act_absmax.float().clamp_min(EPS)
    return (a_max.pow(alpha) / w_max.pow(1.0 - alpha)).clamp_min(EPS)
