"""The interaction mask of Dynamic Context Pruning and its sparsity (SPEC section 6).

    z[n, j]     = q_int[n] . k_int[j] / sqrt(r) + beta
    Ibar[n, j]  = sigma_alpha(z[n, j])                     (training; 1[z > 0] at inference)
    log I[k, j] = sum_{n=j+1..k} log Ibar[n, j]  for j < k;   0 for j = k;   -inf for j > k

``log I[:, j]`` is a cumulative sum down column ``j`` of ``log Ibar`` with the entries on
and above the diagonal set to 0, so there is no ``-inf - (-inf)``; the causal ``-inf``
is written afterwards. ``log Ibar`` is floored at ``LOG_FLOOR = -1e4`` (``p = 0`` exactly
where the alpha-sigmoid clips), which keeps every number below the diagonal finite, the
forward and backward passes free of NaN, and a dropped pair's weight ``exp(log I)``
exactly 0 in float32 and float64 (irreversible: the column sum only goes down). The
floored entries get gradient 0, which is the true gradient: the alpha-sigmoid is flat
where it clips.

The cumulative sum runs in float64: T float32 additions down a column would cost up to
~T ulps of ``log I``, more than the rest of the op; float64 costs one transient
``[B, T, T]`` buffer (a scan has no saved tensors in its backward).

Shapes (legend): B batch, T positions (Tq query / Tk key positions), r interaction dim.
``log I`` is ``[B, T(query k), T(key j)]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..prefix import prefix_count
from .alpha_sigmoid import LOG_FLOOR, _resolve, check_alpha, check_alpha_tensor, log_alpha_sigmoid
from .mask_triton import TritonLogMask


def _shape(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_interaction(q_int: Tensor, k_int: Tensor, beta: float | Tensor, same_t: bool) -> None:
    """Raises ``TypeError`` / ``ValueError`` naming the bad argument: tensors ``[B, T, r]``
    of one floating dtype and device, the same ``B`` and ``r >= 1`` (and ``T`` when
    ``same_t``); ``beta`` a python number or a one-element floating tensor."""
    for name, t in (("q_int", q_int), ("k_int", k_int)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [batch, time, r], got {_shape(t)}")
    if q_int.dtype != k_int.dtype:
        raise TypeError(f"q_int and k_int must share a dtype, got {q_int.dtype}, {k_int.dtype}")
    if k_int.device != q_int.device:
        raise ValueError(f"k_int is on {k_int.device} but q_int is on {q_int.device}")
    if q_int.shape[-1] < 1:
        raise ValueError(f"the interaction dim r must be positive, got r = {q_int.shape[-1]}")
    if q_int.shape[0] != k_int.shape[0] or q_int.shape[-1] != k_int.shape[-1]:
        raise ValueError(
            f"q_int and k_int must agree in batch and r, got {_shape(q_int)} and {_shape(k_int)}"
        )
    if same_t and q_int.shape[1] != k_int.shape[1]:
        raise ValueError(
            f"q_int and k_int must have the same length, got {_shape(q_int)} and {_shape(k_int)}"
        )
    if isinstance(beta, Tensor):
        if not beta.is_floating_point() or beta.numel() != 1:
            raise ValueError(f"beta must be a number or a one-element float tensor, got {_shape(beta)}")
        if beta.device != q_int.device:
            raise ValueError(f"beta is on {beta.device} but q_int is on {q_int.device}")
    elif isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"beta must be a number or a tensor, got {type(beta).__name__}")


def _logits(q_int: Tensor, k_int: Tensor, beta: float | Tensor) -> Tensor:
    acc = torch.float64 if q_int.dtype == torch.float64 else torch.float32
    r = q_int.shape[-1]
    with torch.autocast(q_int.device.type, enabled=False):  # float32 under bf16 autocast too
        z = torch.einsum("bqr,bkr->bqk", q_int.to(acc), k_int.to(acc)) / math.sqrt(r)  # [B, Tq, Tk]
    if isinstance(beta, Tensor):
        beta = beta.to(acc).reshape(())
    return z + beta


def interaction_logits(q_int: Tensor, k_int: Tensor, beta: float | Tensor) -> Tensor:
    """``z = q_int k_int^T / sqrt(r) + beta``, the logits of the keep probabilities.

    Args:
        q_int: ``[B, Tq, r]`` interaction queries (any floating dtype).
        k_int: ``[B, Tk, r]`` interaction keys, same dtype.
        beta: the layer's scalar offset: a number or a one-element tensor (a parameter
            whose gradient is wanted).

    Returns:
        ``z`` ``[B, Tq, Tk]`` float32 (float64 for float64 inputs); no causal masking, so
        it also serves a decode step (new queries against cached keys).
    """
    check_interaction(q_int, k_int, beta, same_t=False)
    return _logits(q_int, k_int, beta)


def _strictly_lower(t: int, device: torch.device) -> Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril(-1)  # [T(n), T(j)]: n > j


def causal_log_cumsum(log_ibar: Tensor) -> Tensor:
    """``log I`` from ``log Ibar`` ``[B, T, T]``: the column-wise cumulative sum of the
    strictly lower triangle, 0 on the diagonal, ``-inf`` above; differentiable."""
    t = log_ibar.shape[-1]
    below = _strictly_lower(t, log_ibar.device)
    log_ibar = torch.where(below, log_ibar, 0.0)  # only factors n > j enter column j
    log_i = log_ibar.double().cumsum(dim=1).to(log_ibar.dtype)  # [B, T(k), T(j)]
    causal = below | torch.eye(t, dtype=torch.bool, device=log_ibar.device)
    return torch.where(causal, log_i, -math.inf)


def interaction_log_mask(
    q_int: Tensor, k_int: Tensor, beta: float | Tensor, alpha: float | Tensor, *, backend: str = "auto"
) -> Tensor:
    """``log I`` of DCP for training: the irreversible keep mask, shared by all heads.

    ``log I[k, j] = sum_{n=j+1..k} log sigma_alpha(z[n, j])`` below the diagonal, 0 on
    it, ``-inf`` above (causal); ``z = q_int k_int^T / sqrt(r) + beta``. For ``T = 4``
    (rows: queries k, columns: keys j)::

        0    -inf           -inf      -inf
        l10  0              -inf      -inf
        l10+l20  l21        0         -inf        l_nj = log Ibar[n, j]
        l10+l20+l30  l21+l31  l32     0

    Every ``log Ibar`` is floored at ``LOG_FLOOR = -1e4``, so below the diagonal ``log I``
    is finite, and a pair with a clipped factor (dropped) has ``exp(log I) = 0`` exactly
    for every later query. Gradients reach ``q_int``, ``k_int`` and ``beta`` with no NaN.

    Args:
        q_int, k_int: ``[B, T, r]`` interaction queries and keys, one floating dtype.
        beta: a number or a one-element tensor (the layer's ``beta_l``).
        alpha: the alpha-sigmoid's alpha, a python float ``>= 1`` (the schedule's value),
            or a 0-d tensor holding it (compiled code: see
            :func:`~lapse.ops.dcp.log_alpha_sigmoid`).
        backend: ``"auto"`` (Triton for CUDA inputs other than float64, else torch),
            ``"triton"`` (``mask_triton.py``: the alpha-sigmoid solved below the diagonal
            only and the cumulative sum in two kernels, one kernel backward; float32) or
            ``"torch"`` (the alpha-sigmoid of :func:`~lapse.ops.dcp.log_alpha_sigmoid` over
            the square, then :func:`causal_log_cumsum`: the reference).

    Returns:
        ``log_i`` ``[B, T, T]`` float32 (float64 for float64 inputs).
    """
    check_interaction(q_int, k_int, beta, same_t=True)
    if not isinstance(alpha, Tensor):
        alpha = check_alpha(alpha)
    z = _logits(q_int, k_int, beta)  # [B, T, T]
    if _resolve(z, backend) == "triton":
        if isinstance(alpha, Tensor):
            check_alpha_tensor(alpha, z)
            alpha = alpha.to(torch.float64)
        else:
            alpha = torch.full((), alpha, dtype=torch.float64, device=z.device)
        return TritonLogMask.apply(z, alpha)
    return causal_log_cumsum(log_alpha_sigmoid(z, alpha, backend="torch"))


def interaction_log_mask_step(q_int: Tensor, k_int: Tensor, beta: float | Tensor) -> Tensor:
    """``log I`` with the inference step ``Ibar = 1[z > 0]`` (the ``alpha -> inf`` limit):
    0 where every factor kept the pair, ``<= LOG_FLOOR`` where one dropped it, ``-inf``
    above the diagonal. Not differentiable (computed without autograd).

    Same arguments and result as :func:`interaction_log_mask`, without ``alpha``.
    """
    check_interaction(q_int, k_int, beta, same_t=True)
    with torch.no_grad():
        z = _logits(q_int, k_int, beta)  # [B, T, T]
        t = z.shape[-1]
        below = _strictly_lower(t, z.device)
        # causal_log_cumsum of LOG_FLOOR where z <= 0: LOG_FLOOR times the count of drops
        # n in (j, k], equal to the float64 sum bit for bit, counted by prefix_count (a
        # scan the compiler does not fuse with the broadcast mask)
        drops = prefix_count((~(z > 0) & below).transpose(1, 2)).transpose(1, 2)  # [B, T(k), T(j)]
        log_i = (drops.double() * LOG_FLOOR).to(z.dtype)
        causal = below | torch.eye(t, dtype=torch.bool, device=z.device)
        return torch.where(causal, log_i, -math.inf)


def _check_log_i(log_i: Tensor) -> None:
    if not isinstance(log_i, Tensor):
        raise TypeError(f"log_i must be a torch.Tensor, got {type(log_i).__name__}")
    if log_i.dim() != 3 or log_i.shape[1] != log_i.shape[2]:
        raise ValueError(f"log_i must be [batch, T, T], got {_shape(log_i)}")
    if log_i.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"log_i must be float32 or float64, got {log_i.dtype}")


def dcp_sparsity_loss(log_i: Tensor) -> Tensor:
    """The sparsity term ``mean over pairs j < k of I[k, j]`` (``I = exp(log_i)``),
    averaged over the batch too; differentiable. Multiply by ``gamma`` and average over
    layers for the loss of SPEC section 6. 0 for ``T < 2`` (no pairs).

    Args:
        log_i: ``[B, T, T]`` from :func:`interaction_log_mask`.

    Returns:
        a 0-dim tensor in the dtype of ``log_i``.
    """
    _check_log_i(log_i)
    b, t, _ = log_i.shape
    if t < 2:
        return log_i.new_zeros(())
    below = _strictly_lower(t, log_i.device)
    kept = torch.where(below, log_i, -math.inf).exp()  # [B, T, T]: I on pairs j < k, else 0
    return kept.sum() / (b * t * (t - 1) // 2)


def dcp_sparsity(log_i: Tensor) -> Tensor:
    """Sparsity per position: the share of earlier tokens dropped, ``#{j < k: dropped} /
    k`` (0 at ``k = 0``), for logging; no gradient.

    A pair counts as dropped when ``log I <= LOG_FLOOR``: a factor was clipped to 0 (or
    the product fell below ``e^-1e4``, which is 0 in any float).

    Args:
        log_i: ``[B, T, T]`` from :func:`interaction_log_mask` or its step variant.

    Returns:
        ``[B, T]`` float32.
    """
    _check_log_i(log_i)
    with torch.no_grad():
        t = log_i.shape[-1]
        below = _strictly_lower(t, log_i.device)
        dropped = (below & (log_i <= LOG_FLOOR)).sum(dim=-1)  # [B, T]
        k = torch.arange(t, device=log_i.device).clamp_min(1)
        return dropped.float() / k
