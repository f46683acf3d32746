"""The autograd Function of the Triton path (kernels in triton_fwd.py / triton_bwd.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from .common import Problem, gate_grad_from_dc, split_hi_lo
from .pruning import block_end_from_start
from .triton_bwd import launch_bwd
from .triton_fwd import launch_fwd

LN2 = 0.6931471805599453


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _TritonForgettingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_fgate, c, p: Problem, block_start):
        ctx.set_materialize_grads(False)
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        c_hi, c_lo = split_hi_lo(c)  # [B, HQ, Tc] float32 each
        cu = p.cu_seqlens
        o = torch.empty_like(q)
        lse2 = torch.empty(c_hi.shape, dtype=torch.float32, device=q.device)  # base 2
        launch_fwd(q, k, v, c_hi, c_lo, block_start, cu, p, o, lse2)
        ctx.save_for_backward(q, k, v, o, lse2, c_hi, c_lo, log_fgate, block_start)
        ctx.p = p
        tq = q.shape[1]
        return o, lse2[..., :tq] * LN2

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse2, c_hi, c_lo, log_fgate, block_start = ctx.saved_tensors
        p = ctx.p
        do = torch.zeros_like(o) if do is None else _last_dim_contiguous(do)
        tq = q.shape[1]
        b, _, hq, _ = q.shape
        tc = c_hi.shape[-1]
        delta = torch.zeros(b, hq, tc, dtype=torch.float32, device=q.device)
        # Delta_i = rowsum(dO * O)_i; a gradient of lse_i adds P_ij * dlse_i to dS_ij,
        # which is the same as lowering Delta_i by dlse_i.
        delta[..., :tq] = (do.float() * o.float()).sum(-1).transpose(1, 2)
        if dlse is not None:
            delta[..., :tq] -= dlse.float()
        block_end = block_end_from_start(block_start, p) if block_start is not None else None
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dcc = torch.empty(b, hq, tc, dtype=torch.float32, device=q.device)
        dcr = torch.zeros(b, hq, tc, dtype=torch.float32, device=q.device)
        launch_bwd(q, k, v, do, lse2, delta, c_hi, c_lo, block_start, block_end, p.cu_seqlens,
                   p, dq, dk, dv, dcc, dcr)
        # dc_i = rowsum_i(dS) - colsum_i(dS); query i sits at key position i + Tk - Tq
        dc = -dcc.double()
        dc[..., tc - tq:] += dcr[..., :tq].double()
        dlog = gate_grad_from_dc(dc.transpose(1, 2), log_fgate, p.cu_seqlens)
        return dq, dk, dv, dlog, None, None, None


def triton_forgetting_attention(q, k, v, log_fgate, c, p, block_start):
    """(o, lse) through the fused Triton kernels; differentiable in q, k, v, log_fgate."""
    return _TritonForgettingAttention.apply(q, k, v, log_fgate, c, p, block_start)
