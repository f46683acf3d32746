"""Dynamic Context Pruning (DCP): the alpha-sigmoid, the interaction mask, attention.

SPEC section 6; the derivations are in README.md. The folder reads top-down:
``alpha_sigmoid.py`` (the bisection and its closed-form gradient), ``mask.py`` (``log I``
as a column-wise cumulative sum, the step variant, the sparsity term and statistic),
``naive.py`` (the materialised oracles), and here the attention with ``log I`` as an
additive bias shared by all heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backend import autocast_off, check_backend
from ..forgetting.common import (
    check_devices,
    check_float_dtype,
    check_heads,
    check_tensors,
    resolve_scale,
)
from .alpha_sigmoid import LOG_FLOOR, alpha_sigmoid, log_alpha_sigmoid
from .mask import (
    dcp_sparsity,
    dcp_sparsity_loss,
    interaction_log_mask,
    interaction_log_mask_step,
    interaction_logits,
)
from .naive import naive_alpha_sigmoid, naive_dcp_attention, naive_interaction_mask

__all__ = [
    "DCP_BACKENDS",
    "LOG_FLOOR",
    "alpha_sigmoid",
    "dcp_attention",
    "dcp_sparsity",
    "dcp_sparsity_loss",
    "interaction_log_mask",
    "interaction_log_mask_step",
    "interaction_logits",
    "log_alpha_sigmoid",
    "naive_alpha_sigmoid",
    "naive_dcp_attention",
    "naive_interaction_mask",
]

DCP_BACKENDS = ("auto", "torch", "naive")


def _shape(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _validate(q: Tensor, k: Tensor, v: Tensor, log_i: Tensor, backend: str) -> None:
    check_tensors(q=q, k=k, v=v, log_i=log_i)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, time, heads, head_dim], got {_shape(t)}")
        check_float_dtype(name, t)
    check_devices(q, k=k, v=v, log_i=log_i)
    check_heads(q, k, v)
    b, t = q.shape[:2]
    if k.shape[1] != t:
        raise ValueError(f"q has {t} positions but k has {k.shape[1]}: DCP attention is square")
    if log_i.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"log_i must be float32 (log space), got {log_i.dtype}")
    if tuple(log_i.shape) != (b, t, t):
        raise ValueError(f"log_i must be [batch, T, T] = {(b, t, t)}, got {_shape(log_i)}")
    check_backend(backend, DCP_BACKENDS)


def _sdpa_attention(q: Tensor, k: Tensor, v: Tensor, log_i: Tensor, scale: float) -> Tensor:
    group = q.shape[2] // k.shape[2]
    if group > 1:  # [B, T, HQ, D]: the memory-efficient kernel takes no grouped heads
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
    t = q.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()  # [T(k), T(j)]
    # SDPA wants a float mask in the dtype of q; it broadcasts [B, 1, T, T] over heads.
    bias = torch.where(causal, log_i, -math.inf).to(q.dtype)[:, None]  # [B, 1, T, T]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale
    )  # [B, HQ, T, D]
    return o.transpose(1, 2)  # [B, T, HQ, D]


def dcp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_i: Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Causal softmax attention with the DCP mask as an additive bias shared by all heads.

    ``O = softmax(scale * Q K^T + log I) V`` over keys ``j <= k`` (SPEC section 6). The
    causal mask is applied here whatever ``log_i`` holds above the diagonal; its
    diagonal must be finite (it is 0 from :func:`interaction_log_mask`), so no row is
    empty. Gradients flow to ``q, k, v`` and to ``log_i`` (hence to the interaction
    queries and keys and ``beta`` that made it).

    Args:
        q: ``[B, T, HQ, D]`` float16, bfloat16, float32 or float64.
        k, v: ``[B, T, H, D]``, same dtype; ``HQ`` a multiple of ``H`` (grouped-query).
        log_i: ``[B, T, T]`` float32 (float64 allowed), rows queries, columns keys.
        scale: logit scale, ``1 / sqrt(D)`` by default.
        backend: ``"auto"`` (= ``"torch"``), ``"torch"`` or ``"naive"``.

            ``"torch"`` is ``F.scaled_dot_product_attention`` with ``log_i`` as a
            ``[B, 1, T, T]`` ``attn_mask`` in the dtype of ``q``. On CUDA it runs the
            memory-efficient kernel, the one fused SDPA kernel that takes an additive
            bias and returns its gradient: no ``[B, HQ, T, T]`` probabilities are kept,
            only the bias (``B T^2`` elements per layer, saved for the backward); the
            backward builds a transient ``[B, HQ, T, T]`` bias gradient and sums it over
            heads. On CPU PyTorch falls back to its materialised math path. For 16-bit
            ``q`` the bias is rounded to that dtype (bfloat16: ~0.4% of ``|log I|``,
            a weight error below ``4e-3 * exp(log I) |log I| <= 1.5e-3``).

            ``"naive"`` materialises ``[B, HQ, T, T]`` scores in float32 (float64 for
            float64 inputs): the oracle.

    Returns:
        ``o`` ``[B, T, HQ, D]`` in the dtype of ``q``. Under ``torch.autocast`` both
        backends compute as without it, in the dtype of ``q`` (autocast is off inside the
        forward; the backward is autograd's, which follows an autocast block it is called
        in).
    """
    _validate(q, k, v, log_i, backend)
    scale = resolve_scale(scale, q.shape[-1])
    with autocast_off(q):  # SDPA under autocast would round float32 inputs to its dtype
        if backend == "naive":
            return naive_dcp_attention(q, k, v, log_i, scale)
        return _sdpa_attention(q, k, v, log_i, scale)
