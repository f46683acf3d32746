"""RMSNorm, over the model width (block norms) or per head (QK-norm, output norm)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def compute_dtype(x: Tensor) -> torch.dtype:
    """float32 for half-precision inputs, the input's own dtype for float32/float64."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed in float32.

    ``shape`` is the weight's shape: ``(C,)`` for the block norms, ``(H, D)`` for the
    per-head norms (QK-norm, output norm), which normalise each head's ``D`` channels
    with that head's own per-channel gains.
    """

    def __init__(self, shape: int | tuple[int, ...], eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shape))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(compute_dtype(x))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)
