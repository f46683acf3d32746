"""KV-shift (the Pro block, SPEC section 2): each key (value) mixes in its predecessor's."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .norm import gate_linear


def kv_shift(x: Tensor, alpha: Tensor, prev: Tensor | None = None, context=None) -> Tensor:
    """``y_t = alpha_t * x_{t-1} + (1 - alpha_t) * x_t`` per head.

    x: ``[B, T, K, D]`` the pre-shift projections; alpha: ``[B, T, K]`` in (0, 1);
    prev: ``[B, 1, K, D]`` the projection before the first token (zeros when ``None``:
    ``x_0 = 0`` at the start of a sequence; a decoding cache passes the last one);
    context: a :class:`~lapse.layers.context.ContextParallel` when ``x`` is this rank's
    tokens of the sequences (their predecessors come from the ranks that hold them).
    """
    if context is not None:
        x_prev = context.shift_right(x)  # [B, T, K, D]
    else:
        if prev is None:
            prev = torch.zeros_like(x[:, :1])
        x_prev = torch.cat([prev, x[:, :-1]], dim=1)  # [B, T, K, D]
    a = alpha[..., None]  # [B, T, K, 1]
    return (a * x_prev + (1 - a) * x).to(x.dtype)


class KVShift(nn.Linear):
    """The shift gate ``alpha_t = sigmoid(w_h . x_t)`` per key/value head (a Linear
    without bias, ``d_model -> heads``) and the shift it drives.

    A Linear subclass so that its weight initialises, decays and saves like every other
    projection (state-dict key ``<name>.weight``).
    """

    def __init__(self, d_model: int, heads: int):
        super().__init__(d_model, heads, bias=False)

    def shift(self, proj: Tensor, x: Tensor, prev: Tensor | None = None, context=None) -> Tensor:
        """proj ``[B, T, K, D]`` shifted with the gates of the block input x ``[B, T, C]``
        (``prev``, ``context``: those of :func:`kv_shift`)."""
        alpha = torch.sigmoid(gate_linear(self, x))  # [B, T, K]
        return kv_shift(proj, alpha, prev, context)
