"""The alpha-sigmoid as two fused elementwise Triton kernels (forward and backward).

The torch path (``alpha_sigmoid.py``) runs the bisection as ~10 elementwise kernels per
step, 38 steps in float32: ~400 launches and as many passes over a ``[B, T, T]`` tensor
per layer. Here the whole bisection runs in registers: the forward reads ``x`` once and
writes the logit ``t`` (saved for the backward) and ``p`` or ``log p``; the backward reads
``t`` and the incoming gradient once. The math is that of ``alpha_sigmoid.py`` (README.md:
the equation in the logit, ``h(t) = c log sigmoid(t) + log(-expm1(-c t) / c) = log |x|``),
with ``expm1`` and ``log1p`` in Kahan's exp/log forms (the Triton interpreter has no
libdevice). Float32 only (float16/bfloat16 are solved in float32 by the caller).

``alpha`` is read from a 0-d tensor (float64, so that ``alpha - 1`` is rounded once, as
from a python float): a value the trainer changes every step is data, not a kernel
argument that ``torch.compile`` would bake into its graph. The launches are two custom
operators (``lapse::dcp_alpha_sigmoid_fwd`` / ``_bwd``) that ``torch.compile`` calls
without tracing into, on a GPU and under the interpreter alike.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..backend import tl, triton, triton_jit
from .common import LOG_FLOOR, STEPS, T_MAX

BLOCK = 1024

# Tests set this to fill the outputs with NaN before the launches, so that an element a
# kernel skipped shows up instead of passing on stale memory.
POISON_OUTPUTS = False


def _new_output(x: Tensor) -> Tensor:
    """A contiguous tensor like ``x`` (NaN-filled when the tests poison outputs)."""
    return x.new_full(x.shape, float("nan")) if POISON_OUTPUTS else x.new_empty(x.shape)


@triton_jit
def _log1p(x):
    # Kahan: log(1 + x) * x / ((1 + x) - 1) is exact to a few ulps for small x
    w = 1.0 + x
    d = w - 1.0
    return tl.where(d == 0.0, x, tl.log(w) * (x / tl.where(d == 0.0, 1.0, d)))


@triton_jit
def _log_sigmoid(t):
    # log sigmoid(t) = min(t, 0) - log1p(exp(-|t|)); -inf for t = -inf, 0 for t = +inf
    return tl.minimum(t, 0.0) - _log1p(tl.exp(-tl.abs(t)))


@triton_jit
def _one_minus_exp_neg_over_c(t, c):
    # -expm1(-c t) / c for t >= 0, by Kahan's expm1(y) = (e^y - 1) y / log(e^y); where
    # e^(-c t) < 1e-8 it is 1/c to float32 precision (and log of a denormal e^(-c t) is not exact)
    u = tl.exp(-c * t)
    tiny = u < 1e-8
    log_u = tl.where((u == 1.0) | tiny, -1.0, tl.log(u))
    ratio = (1.0 - u) * (-t) / log_u
    return tl.where(u == 1.0, t, tl.where(tiny, 1.0 / c, ratio))


@triton_jit
def _solve_logit(b_x, c, t_max, STEPS: tl.constexpr):
    """``t = logit(sigma_alpha(x))`` for ``c = alpha - 1 > 0``, elementwise over a block of
    any shape: bisection of ``h(t) = log |x|`` over ``[0, t_max]``, ``+-inf`` where
    clipped, the sign of ``x``, NaN kept."""
    b_ax = tl.abs(b_x)
    b_log_ax = tl.log(b_ax)  # -inf at x = 0: every step moves hi down
    b_lo = tl.zeros_like(b_ax)
    b_hi = tl.zeros_like(b_ax) + t_max
    for _ in range(STEPS):
        b_mid = 0.5 * (b_lo + b_hi)
        b_h = c * _log_sigmoid(b_mid) + tl.log(_one_minus_exp_neg_over_c(b_mid, c))
        b_below = b_h < b_log_ax  # the root lies above mid
        b_lo = tl.where(b_below, b_mid, b_lo)
        b_hi = tl.where(b_below, b_hi, b_mid)
    b_t = 0.5 * (b_lo + b_hi)
    b_t = tl.where(b_ax == 0.0, 0.0, b_t)
    b_t = tl.where(b_ax * c >= 1.0, float("inf"), b_t)  # clipped: p = 1
    b_t = tl.where(b_x < 0.0, -b_t, b_t)  # sigma(-x) = 1 - sigma(x)
    return tl.where(b_x != b_x, b_x, b_t)  # NaN stays NaN


@triton_jit
def _dlog_p_dz(b_t, a1, a2, IS_LOG: tl.constexpr):
    """``d log p / dx = 1 / (p^(a-1) + p (1-p)^(a-2))`` (``IS_LOG``) or ``dp/dx = 1 /
    (p^(a-2) + (1-p)^(a-2))`` from the logit ``t``, in logs; 0 where clipped (``t = +-inf``).
    ``a1 = alpha - 1``, ``a2 = alpha - 2`` (float32)."""
    b_clipped = tl.abs(b_t) == float("inf")
    b_t = tl.where(b_clipped, 0.0, b_t)
    b_log_p = _log_sigmoid(b_t)
    b_log_q = b_log_p - b_t  # log(1 - p)
    if IS_LOG:
        b_u = a1 * b_log_p
        b_v = b_log_p + a2 * b_log_q
    else:
        b_u = a2 * b_log_p
        b_v = a2 * b_log_q
    b_m = tl.maximum(b_u, b_v)
    b_lse = b_m + _log1p(tl.exp(-tl.abs(b_u - b_v)))  # logaddexp(u, v)
    return tl.where(b_clipped, 0.0, tl.exp(-b_lse))


@triton_jit
def _alpha_sigmoid_fwd_kernel(
    x_ptr, alpha_ptr, t_ptr, y_ptr, n, t_max, log_floor,
    STEPS: tl.constexpr, IS_LOG: tl.constexpr, BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    c = (tl.load(alpha_ptr) - 1.0).to(tl.float32)  # alpha - 1 in the alpha tensor's precision, then float32
    o_x = i_b * BLOCK + tl.arange(0, BLOCK)
    m_x = o_x < n
    b_x = tl.load(x_ptr + o_x, mask=m_x, other=0.0).to(tl.float32)
    b_t = _solve_logit(b_x, c, t_max, STEPS)
    b_log_p = _log_sigmoid(b_t)
    if IS_LOG:
        b_y = tl.maximum(b_log_p, log_floor)
        b_y = tl.where(b_log_p != b_log_p, b_log_p, b_y)
    else:
        b_y = tl.exp(b_log_p)
    tl.store(t_ptr + o_x, b_t, mask=m_x)
    tl.store(y_ptr + o_x, b_y, mask=m_x)


@triton_jit
def _alpha_sigmoid_bwd_kernel(
    t_ptr, g_ptr, alpha_ptr, dx_ptr, n, IS_LOG: tl.constexpr, BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    alpha = tl.load(alpha_ptr)
    a1 = (alpha - 1.0).to(tl.float32)
    a2 = (alpha - 2.0).to(tl.float32)
    o_x = i_b * BLOCK + tl.arange(0, BLOCK)
    m_x = o_x < n
    b_t = tl.load(t_ptr + o_x, mask=m_x, other=0.0)
    b_g = tl.load(g_ptr + o_x, mask=m_x, other=0.0).to(tl.float32)
    b_dx = tl.where(tl.abs(b_t) == float("inf"), 0.0, b_g * _dlog_p_dz(b_t, a1, a2, IS_LOG))  # no 0 * inf
    tl.store(dx_ptr + o_x, b_dx, mask=m_x)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def launch_fwd(x: Tensor, alpha: Tensor, log: bool) -> tuple[Tensor, Tensor]:
    """``(t, y)`` for a contiguous float32 ``x`` and a 0-d ``alpha`` on its device: the
    logit and ``p`` (or floored ``log p``)."""
    t, y = _new_output(x), _new_output(x)
    n = x.numel()
    if n:
        _alpha_sigmoid_fwd_kernel[_grid(n)](
            x, alpha, t, y, n, T_MAX, LOG_FLOOR, STEPS=STEPS[torch.float32], IS_LOG=log, BLOCK=BLOCK,
        )
    return t, y


def launch_bwd(t: Tensor, grad: Tensor, alpha: Tensor, log: bool) -> Tensor:
    """``grad * dy/dx`` from the saved logit ``t`` (both contiguous, float32)."""
    dx = _new_output(t)
    n = t.numel()
    if n:
        _alpha_sigmoid_bwd_kernel[_grid(n)](t, grad, alpha, dx, n, IS_LOG=log, BLOCK=BLOCK)
    return dx


@torch.library.custom_op("lapse::dcp_alpha_sigmoid_fwd", mutates_args=())
def alpha_sigmoid_fwd(x: Tensor, alpha: Tensor, log: bool) -> tuple[Tensor, Tensor]:
    """:func:`launch_fwd` as one operator that ``torch.compile`` does not trace into: ``x``
    float32 (made contiguous), ``alpha`` 0-d float64 on its device (inputs checked)."""
    return launch_fwd(x.contiguous(), alpha, log)


@alpha_sigmoid_fwd.register_fake
def _(x, alpha, log):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("lapse::dcp_alpha_sigmoid_bwd", mutates_args=())
def alpha_sigmoid_bwd(t: Tensor, grad: Tensor, alpha: Tensor, log: bool) -> Tensor:
    """:func:`launch_bwd` as one operator (``grad`` taken to float32, both made contiguous)."""
    return launch_bwd(t.contiguous(), grad.float().contiguous(), alpha, log)


@alpha_sigmoid_bwd.register_fake
def _(t, grad, alpha, log):
    return t.new_empty(t.shape)


class TritonAlphaSigmoid(torch.autograd.Function):
    """``p`` or floored ``log p`` from a float32 ``x`` and a 0-d float64 ``alpha > 1`` on
    its device, by the fused kernels. Saves only the logit (one float32 tensor the size of
    ``x``) and ``alpha``."""

    @staticmethod
    def forward(ctx, x: Tensor, alpha: Tensor, log: bool) -> Tensor:
        t, y = alpha_sigmoid_fwd(x, alpha, log)
        ctx.save_for_backward(t, alpha)
        ctx.log = log
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        t, alpha = ctx.saved_tensors
        return alpha_sigmoid_bwd(t, grad, alpha, ctx.log), None, None
