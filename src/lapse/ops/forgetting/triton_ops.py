"""The Triton path's kernel launches (forward, backward) and its autograd Function (kernels in
triton_fwd.py / triton_bwd.py; the same launches as custom ops in library.py)."""

from __future__ import annotations

import logging
import os
import warnings

import torch
from torch import Tensor

from ..backend import LN2, autocast_off_backward
from . import fa4_bwd, fa4_fwd
from .common import LOG_GATE_FLOOR, Problem
from .gate_scan import gate_cumsum, gate_grad
from .pruning import block_end_from_start
from .triton_bwd import launch_bwd
from .triton_fwd import launch_fwd

log = logging.getLogger(__name__)

# Tests set this to fill every kernel output with NaN before the launch, so that a tile a
# kernel skipped (ACP) and left unwritten shows up instead of passing on stale zeros.
POISON_OUTPUTS = False


def _empty_like(x: Tensor) -> Tensor:
    return torch.full_like(x, float("nan")) if POISON_OUTPUTS else torch.empty_like(x)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


FA4_STRICT = os.environ.get("LAPSE_FA4_STRICT", "0") == "1"  # a failing FlashAttention-4 kernel raises


def _fa4_failed(module, what: str, error: Exception) -> None:
    """FlashAttention-4's kernel for FoX's ``what`` failed (a CuTe DSL or driver it does not work
    with): say so once, with the traceback in the log, and turn that path off for the process; the
    caller then runs Triton's. Out of memory is not its fault and propagates, as everything does
    with ``LAPSE_FA4_STRICT=1`` (the GPU tests' setting: a kernel that fails must fail them)."""
    if FA4_STRICT or isinstance(error, torch.cuda.OutOfMemoryError):
        raise error
    module.ENABLED = False
    log.warning("lapse: FoX's %s on FlashAttention-4 failed", what, exc_info=error)
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    warnings.warn(f"lapse: FoX's {what} on FlashAttention-4 failed ({type(error).__name__}: {first}); it "
                  "runs on the Triton kernels from now on", RuntimeWarning, stacklevel=3)


def triton_gate_cumsum(log_fgate: Tensor, p: Problem) -> tuple[Tensor, Tensor]:
    """The cumulative log gate as float32 ``hi + lo``, each ``[B, HQ, Tc]`` (one kernel)."""
    return gate_cumsum(log_fgate, p, LOG_GATE_FLOOR)


def forward_kernel(q, k, v, c_hi, c_lo, p: Problem, block_start) -> tuple[Tensor, Tensor]:
    """``(o, lse2)``: the forward kernel's output and base-2 lse ``[B, HQ, Tc]`` float32. With
    ``LAPSE_FA4_FWD=1`` (opt-in: slower) and ``flash-attn-4`` installed, the calls it serves on
    Hopper (dense and ACP) go through its kernel (fa4_fwd.py)."""
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    if fa4_fwd.serves(q, p, block_start):
        try:
            return fa4_fwd.forward(q, k, v, c_hi, c_lo, p, block_start, POISON_OUTPUTS)
        except Exception as e:  # its compile or launch failed here: Triton's kernel, from now on
            _fa4_failed(fa4_fwd, "forward", e)
    o = _empty_like(q)
    lse2 = _empty_like(c_hi)
    launch_fwd(q, k, v, c_hi, c_lo, block_start, p.cu_seqlens, p, o, lse2)
    return o, lse2


def backward_kernels(q, k, v, o, do, lse2, dlse, c_hi, c_lo, block_start, p: Problem):
    """``(dq, dk, dv, dcc, dcr)``: the backward kernels' gradients and the column and row
    sums of dS (per key position and per query index, float32 ``[B, HQ, Tc]``). Where
    ``flash-attn-4`` is installed, the calls it serves on Hopper (dense and ACP) go through its
    kernel (fa4_bwd.py)."""
    q, k, v, do = (_last_dim_contiguous(x) for x in (q, k, v, do))
    if fa4_bwd.serves(q, p, block_start):
        try:
            return fa4_bwd.backward(q, k, v, o, do, lse2, dlse, c_hi, c_lo, p, POISON_OUTPUTS, block_start)
        except Exception as e:  # its compile or launch failed here: the Triton kernels, from now on
            _fa4_failed(fa4_bwd, "backward", e)
    block_end = block_end_from_start(block_start, p) if block_start is not None else None
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    dcc, dcr = _empty_like(lse2), _empty_like(lse2)
    launch_bwd(q, k, v, o, do, lse2, dlse, c_hi, c_lo, block_start, block_end, p.cu_seqlens,
               p, dq, dk, dv, dcc, dcr, poison=POISON_OUTPUTS)
    return dq, dk, dv, dcc, dcr


class _TritonForgettingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_fgate, c_hi, c_lo, p: Problem, block_start):
        ctx.set_materialize_grads(False)
        o, lse2 = forward_kernel(q, k, v, c_hi, c_lo, p, block_start)
        ctx.save_for_backward(q, k, v, o, lse2, c_hi, c_lo, log_fgate, block_start)
        ctx.p = p
        return o, lse2[..., : q.shape[1]] * LN2

    @staticmethod
    @autocast_off_backward
    def backward(ctx, do, dlse):
        q, k, v, o, lse2, c_hi, c_lo, log_fgate, block_start = ctx.saved_tensors
        p = ctx.p
        do = torch.zeros_like(o) if do is None else do
        dq, dk, dv, dcc, dcr = backward_kernels(q, k, v, o, do, lse2, dlse, c_hi, c_lo, block_start, p)
        dlog = gate_grad(dcc, dcr, log_fgate, p, LOG_GATE_FLOOR)
        return dq, dk, dv, dlog, None, None, None, None


def triton_forgetting_attention(q, k, v, log_fgate, c_hi, c_lo, p, block_start):
    """(o, lse) through the fused Triton kernels; differentiable in q, k, v, log_fgate."""
    return _TritonForgettingAttention.apply(q, k, v, log_fgate, c_hi, c_lo, p, block_start)
