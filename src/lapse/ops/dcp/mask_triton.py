"""``log I`` of DCP training from the logits ``z`` in two Triton kernels forward and one
backward, instead of the alpha-sigmoid over the whole ``[B, T, T]`` square and a float64
cumulative sum through autograd (``mask.py``, the torch path and the reference).

Forward:

1. ``_log_ibar_kernel``, one program per ``BR x BC`` tile below or on the diagonal (the
   tiles above it return at once: half the square is never solved): the logit ``t`` of
   ``sigma_alpha(z)`` (saved for the backward) and the floored ``log Ibar`` with 0 on
   and above the diagonal, written into the output. ``alpha = 1`` and ``alpha = 2`` take
   their closed forms (``t = z``; ``t = log((1+z)/(1-z))``, clipped at ``|z| >= 1``), any
   other value the bisection of ``alpha_sigmoid_triton.py``: a branch on the scalar, so
   a scheduled alpha passing through 1 or 2 costs nothing extra.
2. ``_column_scan_kernel``, one program per ``BC`` columns walking down the rows: the
   column-wise cumulative sum in place, in float64 (a running float64 carry per column,
   each tile's sums in float64, one rounding to float32 per entry: as the torch path's
   float64 ``cumsum``), 0 on the diagonal, ``-inf`` above it.

Backward (``_column_scan_bwd_kernel``, one program per ``BC`` columns walking up the
rows): ``dz[n, j] = d log p / dz (t[n, j]) * sum_{k >= n} g[k, j]`` for ``n > j``, 0 on
and above the diagonal, the suffix sums in float64; the derivative is the closed form of
``alpha_sigmoid_triton._dlog_p_dz`` (which covers ``alpha`` 1 and 2 as well: ``1 - p``
and ``1 / 2p``).

Shapes: ``z``, ``t``, ``log I`` and their gradients ``[B, T(query n or k), T(key j)]``
float32, contiguous.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..backend import tl, triton, triton_jit
from . import alpha_sigmoid_triton as _as
from .alpha_sigmoid_triton import _dlog_p_dz, _log1p, _log_sigmoid, _solve_logit
from .common import LOG_FLOOR, STEPS, T_MAX

BR, BC = 32, 32  # tile rows (queries) x columns (keys)


@triton_jit
def _log_ibar_kernel(
    z_ptr, alpha_ptr, t_ptr, out_ptr, T, t_max, log_floor,
    STEPS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):
    i_r, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    if (i_r + 1) * BR - 1 <= i_c * BC:  # every entry of the tile is on or above the diagonal
        return
    o_r = i_r * BR + tl.arange(0, BR)
    o_c = i_c * BC + tl.arange(0, BC)
    m = (o_r[:, None] < T) & (o_c[None, :] < T)
    below = o_r[:, None] > o_c[None, :]
    off = i_b * T * T + o_r[:, None] * T + o_c[None, :]
    b_z = tl.load(z_ptr + off, mask=m & below, other=0.0)
    c = (tl.load(alpha_ptr) - 1.0).to(tl.float32)
    if c == 0.0:  # alpha = 1: the logistic sigmoid, whose logit is z
        b_t = b_z
    elif c == 1.0:  # alpha = 2: p = clip((z + 1) / 2, 0, 1), logit log((1 + z) / (1 - z))
        b_in = tl.abs(b_z) < 1.0
        b_s = tl.where(b_in, b_z, 0.0)
        b_t = tl.where(b_in, _log1p(b_s) - _log1p(-b_s), tl.where(b_z > 0.0, float("inf"), float("-inf")))
        b_t = tl.where(b_z != b_z, b_z, b_t)
    else:
        b_t = _solve_logit(b_z, c, t_max, STEPS)
    b_lp = _log_sigmoid(b_t)
    b_y = tl.where(b_lp != b_lp, b_lp, tl.maximum(b_lp, log_floor))  # floored; NaN stays NaN
    tl.store(t_ptr + off, b_t, mask=m & below)
    tl.store(out_ptr + off, tl.where(below, b_y, 0.0), mask=m)


@triton_jit
def _column_scan_kernel(io_ptr, T, BR: tl.constexpr, BC: tl.constexpr):
    i_c, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < T
    carry = tl.zeros([BC], dtype=tl.float64)
    for i_r in range(0, tl.cdiv(T, BR)):
        o_r = i_r * BR + tl.arange(0, BR)
        m = (o_r[:, None] < T) & m_c[None, :]
        off = i_b * T * T + o_r[:, None] * T + o_c[None, :]
        diag = o_r[:, None] == o_c[None, :]
        if (i_r + 1) * BR - 1 <= i_c * BC:  # nothing below the diagonal (never written by the kernel above)
            tl.store(io_ptr + off, tl.where(diag, 0.0, float("-inf")), mask=m)
        else:
            below = o_r[:, None] > o_c[None, :]
            b = tl.load(io_ptr + off, mask=m & below, other=0.0).to(tl.float64)
            b_cs = tl.cumsum(b, axis=0) + carry[None, :]
            carry += tl.sum(b, axis=0)
            b_out = tl.where(below, b_cs.to(tl.float32), tl.where(diag, 0.0, float("-inf")))
            tl.store(io_ptr + off, b_out, mask=m)


@triton_jit
def _column_scan_bwd_kernel(g_ptr, t_ptr, alpha_ptr, dz_ptr, T, BR: tl.constexpr, BC: tl.constexpr):
    i_c, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    alpha = tl.load(alpha_ptr)
    a1 = (alpha - 1.0).to(tl.float32)
    a2 = (alpha - 2.0).to(tl.float32)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < T
    carry = tl.zeros([BC], dtype=tl.float64)
    n_r = tl.cdiv(T, BR)
    for i in range(0, n_r):
        i_r = n_r - 1 - i  # bottom up: the suffix sums over later queries
        o_r = i_r * BR + tl.arange(0, BR)
        m = (o_r[:, None] < T) & m_c[None, :]
        off = i_b * T * T + o_r[:, None] * T + o_c[None, :]
        if (i_r + 1) * BR - 1 <= i_c * BC:
            tl.store(dz_ptr + off, tl.zeros([BR, BC], dtype=tl.float32), mask=m)
        else:
            below = o_r[:, None] > o_c[None, :]
            b_g = tl.load(g_ptr + off, mask=m & below, other=0.0).to(tl.float64)
            b_sum = tl.sum(b_g, axis=0)
            b_suffix = carry[None, :] + b_sum[None, :] - tl.cumsum(b_g, axis=0) + b_g  # sum over k >= n
            carry += b_sum
            b_t = tl.load(t_ptr + off, mask=m & below, other=0.0)
            b_dz = b_suffix.to(tl.float32) * _dlog_p_dz(b_t, a1, a2, True)
            b_dz = tl.where(below & (tl.abs(b_t) != float("inf")), b_dz, 0.0)  # clipped: 0, no 0 * inf
            tl.store(dz_ptr + off, b_dz, mask=m)


def launch_fwd(z: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """``(t, log_i)`` for a contiguous float32 ``z`` ``[B, T, T]`` and a 0-d float64
    ``alpha`` on its device (``t`` is written below the diagonal only)."""
    b, t_len, _ = z.shape
    t, log_i = _as._new_output(z), _as._new_output(z)
    if z.numel():
        n_r, n_c = triton.cdiv(t_len, BR), triton.cdiv(t_len, BC)
        _log_ibar_kernel[(n_r, n_c, b)](
            z, alpha, t, log_i, t_len, T_MAX, LOG_FLOOR, STEPS=STEPS[torch.float32], BR=BR, BC=BC
        )
        _column_scan_kernel[(n_c, b)](log_i, t_len, BR=BR, BC=BC)
    return t, log_i


def launch_bwd(grad: Tensor, t: Tensor, alpha: Tensor) -> Tensor:
    """``dz`` from the gradient of ``log I`` and the saved logit (contiguous float32)."""
    b, t_len, _ = t.shape
    dz = _as._new_output(t)
    if t.numel():
        _column_scan_bwd_kernel[(triton.cdiv(t_len, BC), b)](grad, t, alpha, dz, t_len, BR=BR, BC=BC)
    return dz


@torch.library.custom_op("lapse::dcp_log_mask_fwd", mutates_args=())
def log_mask_fwd(z: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`launch_fwd` as one operator that ``torch.compile`` calls without tracing into."""
    return launch_fwd(z.contiguous(), alpha)


@log_mask_fwd.register_fake
def _(z, alpha):
    return z.new_empty(z.shape), z.new_empty(z.shape)


@torch.library.custom_op("lapse::dcp_log_mask_bwd", mutates_args=())
def log_mask_bwd(grad: Tensor, t: Tensor, alpha: Tensor) -> Tensor:
    """:func:`launch_bwd` as one operator (``grad`` taken to float32, made contiguous)."""
    return launch_bwd(grad.float().contiguous(), t.contiguous(), alpha)


@log_mask_bwd.register_fake
def _(grad, t, alpha):
    return t.new_empty(t.shape)


class TritonLogMask(torch.autograd.Function):
    """``log I`` ``[B, T, T]`` from float32 logits ``z`` and a 0-d float64 ``alpha >= 1``
    on their device. Saves the logit ``t`` (float32, the size of ``z``) and ``alpha``."""

    @staticmethod
    def forward(ctx, z: Tensor, alpha: Tensor) -> Tensor:
        t, log_i = log_mask_fwd(z, alpha)
        ctx.save_for_backward(t, alpha)
        return log_i

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        t, alpha = ctx.saved_tensors
        return log_mask_bwd(grad, t, alpha), None
