"""The alpha-sigmoid of Dynamic Context Pruning (SPEC section 6), solved by bisection.

``p = sigma_alpha(x)`` solves ``p^(a-1) - (1-p)^(a-1) = (a-1) x``, clipped to [0, 1].
The solver works on the logit ``t = log(p / (1-p))`` and on a rearranged equation that
stays well conditioned for every ``a > 1``, including ``a`` a hair above 1 where the
equation as written is a difference of two numbers near 1 (derivation in README.md):

    for x > 0 (t > 0):   h(t) = c log sigmoid(t) + log(-expm1(-c t) / c) = log x,   c = a - 1

``h`` increases with ``t``, tends to ``log t`` as ``c -> 0`` (so ``t -> x``: the logistic
sigmoid) and to ``-log c`` as ``t -> inf`` (saturation at ``x = 1/c``). Negative ``x``
follow from ``sigma_alpha(-x) = 1 - sigma_alpha(x)``, i.e. ``t(-x) = -t(x)``.

Bisection runs over ``t in [0, T_MAX]`` for a fixed number of steps (no host syncs, the
same work for every element). ``T_MAX = 1e4 = -LOG_FLOOR``: a logit beyond it means
``log p`` (or ``log(1-p)``) below the floor the mask clamps to anyway. Working on ``t``
gives ``log p = log sigmoid(t)`` to full relative precision even where ``p`` itself
underflows, which the interaction mask needs: it sums ``log p``, never ``p``.

``alpha`` is a python float (eager code: the closed forms at 1 and 2 are host branches)
or a 0-d tensor (compiled code: one graph for every value of a scheduled alpha; the
closed forms are picked by ``torch.where``, bitwise the same values).

Shapes: elementwise; any shape.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..backend import check_backend, resolve_backend, triton
from .alpha_sigmoid_triton import TritonAlphaSigmoid
from .common import LOG_FLOOR, STEPS, T_MAX

ALPHA_SIGMOID_BACKENDS = ("auto", "triton", "torch")


def check_alpha(alpha: object) -> float:
    """``alpha`` as a float; ``TypeError`` unless a python number, ``ValueError`` unless
    finite and >= 1. A tensor is refused here: its value cannot be read without a
    synchronisation (the ops check a tensor alpha with :func:`check_alpha_tensor`)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"alpha must be a python float (>= 1), got {type(alpha).__name__}")
    alpha = float(alpha)
    if not math.isfinite(alpha) or alpha < 1.0:
        raise ValueError(f"alpha must be a finite number >= 1, got {alpha!r}")
    return alpha


def check_alpha_tensor(alpha: Tensor, x: Tensor) -> None:
    """A tensor ``alpha`` must be 0-d, floating point and on the device of ``x``; its value
    (finite, ``>= 1``) is the caller's to keep (a DCP layer's ``alpha`` setter checks it)."""
    if not alpha.is_floating_point():
        raise TypeError(f"a tensor alpha must be floating point, got {alpha.dtype}")
    if alpha.dim() != 0:
        raise ValueError(f"a tensor alpha must be 0-d, got shape {tuple(alpha.shape)}")
    if alpha.device != x.device:
        raise ValueError(f"alpha is on {alpha.device} but x is on {x.device}")


def _check_x(x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")


def _work_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def solve_logit(x: Tensor, alpha: Tensor) -> Tensor:
    """``t = logit(sigma_alpha(x))`` for ``alpha > 1`` (0-d float64): ``+inf`` / ``-inf``
    where ``p`` is clipped to 1 / 0 (``|x| >= 1/(a-1)``), else in ``[-T_MAX, T_MAX]``; NaN
    stays NaN. ``x`` float32 or float64 (the working precision)."""
    c = (alpha - 1.0).to(x.dtype)  # rounded once, as a python float meeting x in an op is
    ax = x.abs()
    log_ax = torch.log(ax)  # -inf at x = 0: every step moves hi down, t -> 0
    lo = torch.zeros_like(x)
    hi = torch.full_like(x, T_MAX)
    for _ in range(STEPS[x.dtype]):
        mid = 0.5 * (lo + hi)
        h = c * F.logsigmoid(mid) + torch.log(torch.expm1(-c * mid) / -c)
        below = h < log_ax  # the root lies above mid
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    t = 0.5 * (lo + hi)
    t = torch.where(ax == 0, 0.0, t)
    t = torch.where(ax * c >= 1.0, math.inf, t)
    t = torch.where(torch.isnan(x), math.nan, t)
    return torch.copysign(t, x)


def _grad_from_logit(t: Tensor, alpha: Tensor, log: bool) -> Tensor:
    """``dp/dx = 1 / (p^(a-2) + (1-p)^(a-2))`` or ``d log p / dx = 1 / (p^(a-1) +
    p (1-p)^(a-2))`` from the logit, in log space (no 0 * inf, no overflow of the
    individual powers); 0 where clipped (``t = +-inf``)."""
    a1, a2 = (alpha - 1.0).to(t.dtype), (alpha - 2.0).to(t.dtype)
    clipped = torch.isinf(t)
    t = torch.where(clipped, 0.0, t)
    log_p = F.logsigmoid(t)
    log_q = log_p - t  # log(1 - p) = log sigmoid(-t)
    if log:
        g = torch.exp(-torch.logaddexp(a1 * log_p, log_p + a2 * log_q))
    else:
        g = torch.exp(-torch.logaddexp(a2 * log_p, a2 * log_q))
    return torch.where(clipped, 0.0, g)


class _AlphaSigmoid(torch.autograd.Function):
    """``p`` or ``log p`` (floored) for ``alpha > 1`` (0-d float64) from the bisected
    logit, with the closed-form gradient. Saves only the logit (one tensor the size of
    ``x``) and ``alpha``."""

    @staticmethod
    def forward(ctx, x: Tensor, alpha: Tensor, log: bool) -> Tensor:
        t = solve_logit(x, alpha)
        ctx.save_for_backward(t, alpha)
        ctx.log = log
        if log:
            return F.logsigmoid(t).clamp_min(LOG_FLOOR)
        return torch.sigmoid(t)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        t, alpha = ctx.saved_tensors
        return grad * _grad_from_logit(t, alpha, ctx.log), None, None


def _sigmoid(x: Tensor, log: bool) -> Tensor:
    """``alpha = 1``: the logistic sigmoid (or its floored log)."""
    return F.logsigmoid(x).clamp_min(LOG_FLOOR) if log else torch.sigmoid(x)


def _clip_linear(x: Tensor, log: bool) -> Tensor:
    """``alpha = 2``: ``clip((x+1)/2, 0, 1)`` (or its floored log), gradient 0 outside
    ``|x| < 1``. The log is taken of a safe value where clipped so that the unused branch
    of ``where`` has no NaN to leak into the backward pass."""
    inside = x.abs() < 1.0
    if not log:
        return torch.where(inside, 0.5 * (x + 1.0), (x > 0).to(x.dtype))
    safe = torch.where(inside, x, 0.0)
    log_p = torch.log(0.5 * (safe + 1.0)).clamp_min(LOG_FLOOR)
    clipped = torch.where(x >= 1.0, 0.0, LOG_FLOOR).to(x.dtype)
    return torch.where(inside, log_p, clipped)


def _resolve(x: Tensor, backend: str) -> str:
    """``"auto"``: the fused Triton kernels for float16/bfloat16/float32 CUDA tensors, the
    torch bisection otherwise (float64 stays in torch: the kernels solve in float32)."""
    check_backend(backend, ALPHA_SIGMOID_BACKENDS)
    if backend == "auto":
        return "triton" if triton is not None and x.is_cuda and x.dtype != torch.float64 else "torch"
    return resolve_backend(backend, x, ALPHA_SIGMOID_BACKENDS, products=False)


def _bisect(x: Tensor, alpha: Tensor, log: bool, backend: str) -> Tensor:
    if backend == "triton":
        return TritonAlphaSigmoid.apply(x, alpha, log)
    return _AlphaSigmoid.apply(x, alpha, log)


def _apply(x: Tensor, alpha: float | Tensor, log: bool, backend: str) -> Tensor:
    _check_x(x)
    backend = _resolve(x, backend)
    xw = x.to(_work_dtype(x))
    if isinstance(alpha, Tensor):
        check_alpha_tensor(alpha, x)
        alpha = alpha.to(torch.float64)  # what follows from alpha is rounded once, as from a float
        one, two = alpha == 1.0, alpha == 2.0
        # No host branch: the bisection runs whatever alpha holds, at a stand-in alpha where
        # a closed form is picked (so that its unused values and gradients stay finite).
        solved = _bisect(xw, torch.where(one | two, 3.0, alpha), log, backend)
        out = torch.where(one, _sigmoid(xw, log), torch.where(two, _clip_linear(xw, log), solved))
    else:
        alpha = check_alpha(alpha)
        if alpha == 1.0:
            out = _sigmoid(xw, log)
        elif alpha == 2.0:
            out = _clip_linear(xw, log)
        else:
            out = _bisect(xw, torch.full((), alpha, dtype=torch.float64, device=x.device), log, backend)
    return out.to(x.dtype)


def alpha_sigmoid(x: Tensor, alpha: float | Tensor, *, backend: str = "auto") -> Tensor:
    """The alpha-sigmoid ``sigma_alpha(x) = argmax_{p in [0,1]} p x + H_alpha(p)``
    (Tsallis entropy ``H_alpha``; SPEC section 6), elementwise.

    ``alpha = 1`` is exactly ``torch.sigmoid``, ``alpha = 2`` exactly
    ``clip((x+1)/2, 0, 1)``; any other ``alpha > 1`` solves ``p^(a-1) - (1-p)^(a-1) =
    (a-1) x`` by bisection (fixed step count, no host syncs) and saturates at
    ``x = +-1/(a-1)``. As ``alpha -> inf`` it tends to the step ``1[x > 0]``.

    Args:
        x: a floating-point tensor of any shape; float16 and bfloat16 are computed in
            float32, float64 in float64.
        alpha: a python float ``>= 1``, or a 0-d floating tensor on the device of ``x``
            holding one (a scheduled alpha under ``torch.compile``: the graph does not
            depend on its value; the value is not checked, reading it would synchronise).
            Eager, both give the same results, bitwise.
        backend: ``"auto"`` (Triton for CUDA tensors other than float64, else torch),
            ``"triton"`` (the fused kernels of ``alpha_sigmoid_triton.py``: one pass
            forward, one backward) or ``"torch"`` (the bisection as torch ops). They
            compute the same function; ``alpha = 1, 2`` take the closed forms on either.

    Returns:
        ``p`` in [0, 1], the shape and dtype of ``x``. Differentiable: ``dp/dx = 1 /
        (p^(a-2) + (1-p)^(a-2))`` where ``0 < p < 1``, 0 where clipped.
    """
    return _apply(x, alpha, log=False, backend=backend)


def log_alpha_sigmoid(x: Tensor, alpha: float | Tensor, *, backend: str = "auto") -> Tensor:
    """``log sigma_alpha(x)``, floored at ``LOG_FLOOR = -1e4`` (where ``p = 0``).

    Computed from the bisected logit as ``log sigmoid(t)``, so it keeps full relative
    precision where ``p`` is tiny or near 1 (``log(alpha_sigmoid(x))`` would not).
    Gradient ``1 / (p^(a-1) + p (1-p)^(a-2))`` where ``0 < p < 1``, 0 where clipped.
    Same arguments as :func:`alpha_sigmoid`.
    """
    return _apply(x, alpha, log=True, backend=backend)
