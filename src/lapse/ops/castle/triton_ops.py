"""The autograd Functions of CASTLE's Triton paths: the wavefront (kernels in
triton_fwd.py / triton_bwd.py) and the key-major schedule (triton_parallel.py).

Memory beyond the inputs and outputs: float32 ``[B, H, T, D]`` buffers, O(T D) per head
(forward: U, kept for the backward, and the softmax accumulators; backward: six
gradient accumulators, plus U and R for the wavefront) and ``[B, H, T]`` rows. Nothing
of size T x T.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ..backend import LN2, autocast_off_backward
from .triton_bwd import launch_bwd
from .triton_fwd import block_config, launch_fwd
from .triton_parallel import launch_parallel_bwd, launch_parallel_fwd, parallel_config

# Tests set this to fill every kernel output and scratch buffer with NaN before the
# launches, so that a tile a kernel skipped shows up instead of passing on stale zeros.
POISON_OUTPUTS = False


def _empty(*shape, dtype, device) -> Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _interpret(x: Tensor) -> bool:
    return not x.is_cuda and os.environ.get("TRITON_INTERPRET") == "1"


def _config(x: Tensor, backward: bool) -> dict:
    return block_config(x.shape[-1], _interpret(x), backward)


def _group_sum(g: Tensor, heads: int) -> Tensor:
    """``[B, H, T, D]`` per query head -> ``[B, T, heads, D]``, summing each group."""
    b, h, t, d = g.shape
    return g.view(b, heads, h // heads, t, d).sum(2).transpose(1, 2)


class _TritonCastle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qc, kc, vc, qu, ku, vu, scale, window):
        ctx.set_materialize_grads(False)
        qc, kc, vc, qu, ku, vu = (x.contiguous() for x in (qc, kc, vc, qu, ku, vu))
        b, t, h, d = qc.shape
        dev, f32 = qc.device, torch.float32
        o = _empty(b, t, h, d, dtype=qc.dtype, device=dev)
        lse2 = _empty(b, h, t, dtype=f32, device=dev)  # base 2
        u = _empty(b, h, t, d, dtype=f32, device=dev)
        acc = _empty(b, h, t, d, dtype=f32, device=dev)
        m, l = _empty(b, h, t, dtype=f32, device=dev), _empty(b, h, t, dtype=f32, device=dev)
        launch_fwd(qc, kc, vc, qu, ku, vu, scale, window, o, lse2, u, acc, m, l,
                   _config(qc, backward=False))
        ctx.save_for_backward(qc, kc, vc, qu, ku, vu, o, lse2, u)
        ctx.args = (scale, window)
        return o, lse2 * LN2

    @staticmethod
    @autocast_off_backward
    def backward(ctx, do, dlse):
        qc, kc, vc, qu, ku, vu, o, lse2, u_end = ctx.saved_tensors
        scale, window = ctx.args
        b, t, h, d = qc.shape
        dev, f32 = qc.device, torch.float32
        do = torch.zeros_like(o) if do is None else do.contiguous()
        delta = _delta(do, o, dlse)
        scratch = [_empty(b, h, t, d, dtype=f32, device=dev) for _ in range(2)]  # U, R
        grads = [_empty(b, h, t, d, dtype=f32, device=dev) for _ in range(6)]
        launch_bwd(qc, kc, vc, qu, ku, vu, do, lse2, delta, u_end, scratch, grads, scale,
                   window, _config(qc, backward=True))
        return (*_input_grads(grads, qc, kc, vc, ku, vu), None, None)


def _delta(do: Tensor, o: Tensor, dlse: Tensor | None) -> Tensor:
    """``Delta_i = dO_i . O_i`` ``[B, H, T]`` float32. A gradient of lse_i adds
    ``P_ij dlse_i`` to ``dZ_ij``: the same as lowering ``Delta_i``."""
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()
    return delta if dlse is None else delta - dlse.float()


def _input_grads(grads, qc, kc, vc, ku, vu) -> tuple[Tensor, ...]:
    """float32 ``[B, H, T, D]`` per-query-head gradients -> the six inputs' layouts."""
    dqc, dkc, dvc, dqu, dku, dvu = grads
    dt = qc.dtype
    return (
        dqc.transpose(1, 2).to(dt),
        _group_sum(dkc, kc.shape[2]).to(dt),
        _group_sum(dvc, vc.shape[2]).to(dt),
        dqu.transpose(1, 2).to(dt),
        _group_sum(dku, ku.shape[2]).to(dt),
        _group_sum(dvu, vu.shape[2]).to(dt),
    )


class _TritonParallelCastle(torch.autograd.Function):
    """The key-major schedule: two launches forward, one backward, every key block of
    every head at once; rows are summed with atomics (README.md)."""

    @staticmethod
    def forward(ctx, qc, kc, vc, qu, ku, vu, scale, window):
        ctx.set_materialize_grads(False)
        qc, kc, vc, qu, ku, vu = (x.contiguous() for x in (qc, kc, vc, qu, ku, vu))
        b, t, h, d = qc.shape
        dev, f32 = qc.device, torch.float32
        m2 = _empty(b, h, t, dtype=f32, device=dev)  # base-2 row bound
        u = _empty(b, h, t, d, dtype=f32, device=dev)
        acc = torch.zeros(b, h, t, d, dtype=f32, device=dev)  # added into: must start at 0
        den = torch.zeros(b, h, t, dtype=f32, device=dev)
        launch_parallel_fwd(qc, kc, vc, qu, ku, vu, scale, window, m2, acc, den, u,
                            parallel_config(d, _interpret(qc)))
        o = (acc / den[..., None]).transpose(1, 2).to(qc.dtype).contiguous()  # [B, T, H, D]
        lse2 = m2 + torch.log2(den)
        ctx.save_for_backward(qc, kc, vc, qu, ku, vu, o, lse2, u)
        ctx.args = (scale, window)
        return o, lse2 * LN2

    @staticmethod
    @autocast_off_backward
    def backward(ctx, do, dlse):
        qc, kc, vc, qu, ku, vu, o, lse2, u_end = ctx.saved_tensors
        scale, window = ctx.args
        b, t, h, d = qc.shape
        dev, f32 = qc.device, torch.float32
        do = torch.zeros_like(o) if do is None else do.contiguous()
        # dQ^C, dK^U, dV^U are added into by every key block; the rest written whole
        dqc, dku, dvu = (torch.zeros(b, h, t, d, dtype=f32, device=dev) for _ in range(3))
        dkc, dvc, dqu = (_empty(b, h, t, d, dtype=f32, device=dev) for _ in range(3))
        grads = (dqc, dkc, dvc, dqu, dku, dvu)
        launch_parallel_bwd(qc, kc, vc, qu, ku, vu, do, lse2, _delta(do, o, dlse), u_end, grads,
                            scale, window, parallel_config(d, _interpret(qc), backward=True, window=window))
        return (*_input_grads(grads, qc, kc, vc, ku, vu), None, None)


def triton_castle_attention(q_c, k_c, v_c, q_u, k_u, v_u, scale, window):
    """(o ``[B, T, H, D]``, lse ``[B, H, T]`` float32) through the Triton wavefront;
    differentiable in all six inputs (checked by ``castle_attention``)."""
    return _TritonCastle.apply(q_c, k_c, v_c, q_u, k_u, v_u, scale, window)


def triton_parallel_castle_attention(q_c, k_c, v_c, q_u, k_u, v_u, scale, window):
    """(o ``[B, T, H, D]``, lse ``[B, H, T]`` float32) through the key-major Triton
    schedule; differentiable in all six inputs (checked by ``castle_attention``)."""
    return _TritonParallelCastle.apply(q_c, k_c, v_c, q_u, k_u, v_u, scale, window)
