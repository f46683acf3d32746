"""RMSNorm as a function: the one definition the layers' :class:`lapse.layers.RMSNorm` and
the ops' torch references (the fused decode step's QK-norm and output norm) share, so the
references compute exactly what the layers do."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, in float32 for
    half-precision ``x`` (its own dtype for float32/float64), returned in ``x``'s dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight).to(x.dtype)
