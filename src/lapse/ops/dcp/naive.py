"""Materialised DCP: the test oracles (SPEC section 6).

They share no code with the fast paths: the alpha-sigmoid is a bisection on ``p`` of the
equation exactly as the SPEC writes it, the mask is the product definition ``I[k, j] =
prod_{n=j+1..k} Ibar[n, j]`` built with ``cumprod`` (not a sum of logs), and the
attention is an explicit einsum with an explicit causal mask. Run them in float64 for a
reference; run in float32 they give "the same PyTorch math in float32", the baseline for
tolerances.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def naive_alpha_sigmoid(x: Tensor, alpha: float, steps: int = 200) -> Tensor:
    """``sigma_alpha(x)`` by bisection on ``p in [0, 1]`` of ``p^(a-1) - (1-p)^(a-1) =
    (a-1) x`` (clipped outside ``|x| < 1/(a-1)``); the closed forms at ``alpha = 1, 2``.
    Not differentiable. For ``alpha`` very near 1 the equation is a difference of two
    numbers near 1, so this loses ~``eps / (a-1)`` of relative precision there."""
    if alpha == 1.0:
        return torch.sigmoid(x)
    if alpha == 2.0:
        return ((x + 1) / 2).clamp(0, 1)
    c = alpha - 1.0
    lo, hi = torch.zeros_like(x), torch.ones_like(x)
    for _ in range(steps):
        mid = (lo + hi) / 2
        below = mid**c - (1 - mid) ** c < c * x
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    p = (lo + hi) / 2
    return torch.where(c * x >= 1, 1.0, torch.where(c * x <= -1, 0.0, p)).to(x.dtype)


def naive_interaction_mask(
    q_int: Tensor, k_int: Tensor, beta: float | Tensor, alpha: float | None
) -> Tensor:
    """``I`` ``[B, T, T]`` by the product definition; ``alpha=None`` is the step
    ``1[z > 0]``. Computed in the dtype of ``q_int``."""
    b, t, r = q_int.shape
    z = torch.einsum("bnr,bjr->bnj", q_int, k_int) / math.sqrt(r) + beta  # [B, T(n), T(j)]
    ibar = (z > 0).to(z.dtype) if alpha is None else naive_alpha_sigmoid(z, alpha)
    n = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    factors = torch.where(n > j, ibar, torch.ones_like(ibar))  # Ibar[n, j] for n > j, else 1
    i = torch.cumprod(factors, dim=1)  # [B, T(k), T(j)]: prod over n <= k of the factors
    return torch.where(j <= n, i, torch.zeros_like(i))


def naive_dcp_attention(
    q: Tensor, k: Tensor, v: Tensor, log_i: Tensor, scale: float
) -> Tensor:
    """``softmax(scale Q K^T + log I) V``, causal, ``log_i`` shared by all heads,
    materialised; differentiable by autograd. ``q`` ``[B, T, HQ, D]``, ``k, v`` ``[B, T,
    H, D]`` (``HQ`` a multiple of ``H``), ``log_i`` ``[B, T, T]``. Scores and softmax run
    in float32 (float64 for float64 inputs); the result has the dtype of ``q``."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)  # [B, T, HQ, D]
    v = v.repeat_interleave(group, dim=2)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    t = q.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()  # [T(k), T(j)]
    s = torch.einsum("bkhd,bjhd->bhkj", q, k).to(acc) * scale + log_i.to(acc)[:, None]
    s = torch.where(causal, s, -math.inf)  # [B, HQ, T, T]
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.einsum("bhkj,bjhd->bkhd", p, v)  # [B, T, HQ, D]
