"""RMSNorm, over the model width (block norms) or per head (QK-norm, output norm)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lapse.ops.norm import rms_norm


def compute_dtype(x: Tensor) -> torch.dtype:
    """float32 for half-precision inputs, the input's own dtype for float32/float64."""
    return torch.promote_types(x.dtype, torch.float32)


def gate_linear(linear: nn.Linear, x: Tensor) -> Tensor:
    """``linear(x)`` in :func:`compute_dtype`, for the small ``d_model -> heads`` gate
    projections (FoX's forget gate, the Pro KV-shift gates).

    One token per sequence (a decode step, ``x`` ``[B, 1, C]``): a product and a sum
    instead of a matmul. cuBLAS runs these ``[B, C] x [C, heads]`` products as a 9 us
    kernel each on an H100, a fifth of a 125M FoX (Pro) decode step (8 x 4096, under
    torch.profiler); as a reduction, Inductor fuses the three gates of a
    layer with their neighbours. Longer inputs (training, prefill) keep the matmul.
    """
    dtype = compute_dtype(x)
    if x.dim() != 3 or x.shape[1] != 1:
        return linear(x).to(dtype)
    y = (x.to(dtype).unsqueeze(-2) * linear.weight.to(dtype)).sum(-1)  # [B, 1, heads]
    return y if linear.bias is None else y + linear.bias.to(dtype)


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
        return rms_norm(x, self.weight, self.eps)
