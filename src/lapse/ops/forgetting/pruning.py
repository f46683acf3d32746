"""ACP boundary search on the GPU (SPEC section 3).

For every query block ``m`` the pruned tiles are a prefix of its key blocks, so the first
kept key block is the number of pruned ones: a monotone count. One program takes a chunk
of query blocks of one (sequence, head) and counts, in vector compares, the strictly-causal
key blocks whose largest bias ``c[first query of m] - c[last key of n]`` is below delta.
The count only looks at key blocks before the chunk's last query block (all later ones
are diagonal or masked), and compares ``c`` in float64 so the decision is the same as
:func:`~lapse.ops.forgetting.common.acp_block_start`, the reference it is tested against.
The backward's view of the same staircase (for key block ``n``, the kept query blocks
end at ``block_end[n]``) is a ``searchsorted`` over it.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import ACP_BLOCK, Problem


@triton.jit
def _block_start_kernel(
    CHI, CLO, DELTA, CU, BS,
    TQ, TK, TC, HQ, MB,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_c = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // HQ
    i_h = i_bh % HQ
    if IS_VARLEN:
        bos = tl.load(CU + i_b).to(tl.int64)
        tq = tl.load(CU + i_b + 1).to(tl.int64) - bos
        tk = tq
        i_bt = i_b * 0
    else:
        bos = i_b * 0
        tq = TQ
        tk = TK
        i_bt = i_b
    off = tk - tq
    o_mb = i_c * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mb = o_mb * G < tq
    first_q = o_mb * G + off
    # c rebuilt in float64 from its hi + lo halves, so the decision matches the reference
    p_c = (i_bt * HQ + i_h) * TC + bos
    o_fq = tl.minimum(first_q, tk - 1)
    b_cf = tl.load(CHI + p_c + o_fq, mask=m_mb, other=0.0).to(tl.float64) \
        + tl.load(CLO + p_c + o_fq, mask=m_mb, other=0.0).to(tl.float64)  # [BLOCK_M]
    delta = tl.load(DELTA + i_b * HQ + i_h)
    last_first_q = tl.minimum(i_c * BLOCK_M + BLOCK_M - 1, (tq - 1) // G) * G + off
    n_hi = (last_first_q + 1 + G - 1) // G  # key blocks that can be strictly before a query
    n_hi = tl.where(tq > 0, n_hi, 0)  # an empty packed sequence reads nothing
    count = tl.zeros([BLOCK_M], dtype=tl.int32)
    for n0 in range(0, n_hi, BLOCK_N):
        o_nb = n0 + tl.arange(0, BLOCK_N)
        last_k = tl.minimum(o_nb * G + G - 1, tk - 1)
        m_nb = o_nb < n_hi
        b_cl = tl.load(CHI + p_c + last_k, mask=m_nb, other=0.0).to(tl.float64) \
            + tl.load(CLO + p_c + last_k, mask=m_nb, other=0.0).to(tl.float64)
        pruned = (last_k[None, :] < first_q[:, None]) & m_nb[None, :] & \
            ((b_cf[:, None] - b_cl[None, :]) < delta)
        count += tl.sum(pruned.to(tl.int32), 1)
    count = tl.where(m_mb, count, 0)
    tl.store(BS + (i_b * HQ + i_h) * MB + o_mb, count, mask=o_mb < MB)


@triton.jit
def _max_norm_kernel(X, CU, OUT, stride_xb, stride_xt, stride_xh, T, NH, NT,
                     D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # per (sequence, head, time tile): the largest row norm, float32
    i_t = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // NH
    i_h = i_bh % NH
    if IS_VARLEN:
        bos = tl.load(CU + i_b).to(tl.int64)
        t = tl.load(CU + i_b + 1).to(tl.int64) - bos
        i_bt = i_b * 0
    else:
        bos = i_b * 0
        t = T
        i_bt = i_b
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m = (o_t < t)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(X + i_bt * stride_xb + (bos + o_t[:, None]) * stride_xt + i_h * stride_xh
                  + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + i_bh * NT + i_t, tl.max(tl.sqrt(tl.sum(b_x * b_x, 1)), 0))


def _max_norm(x: Tensor, p: Problem) -> Tensor:
    """max over time of ||x_t|| per (sequence, head): ``[B, heads]`` float32, two launches."""
    return _max_norm_parts(x, p).amax(-1)


def triton_acp_bound(q: Tensor, k: Tensor, p: Problem) -> Tensor:
    """U = max ||q|| * max ||k|| * scale per (sequence, query head), ``[B, HQ]`` float32.

    The same bound as :func:`~lapse.ops.forgetting.common.acp_bound_from_data` in one pass
    over q and k, without a float32 copy, packed sequences included.
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        from .common import acp_bound_from_data

        return acp_bound_from_data(q, k, p)
    kn = _max_norm(k, p).repeat_interleave(p.hq // p.h, dim=1)  # [B, HQ]
    return _max_norm(q, p) * kn * p.scale


@triton.jit
def _acp_delta_kernel(QP, KP, CU, DELTA, TK, HQ, GROUP, NTQ, NTK, scale, log_eps_bits,
                      BQ: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr):
    # per (sequence, query head): U = max ||q|| * max ||k|| * scale from the tiles' maxima,
    # then delta = -2 U - log L + log eps in float64 (acp_delta's formula, in its order)
    i_bh = tl.program_id(0).to(tl.int64)
    i_b = i_bh // HQ
    i_hk = (i_bh % HQ) // GROUP
    o_q = tl.arange(0, BQ)
    o_k = tl.arange(0, BK)
    q_max = tl.max(tl.load(QP + i_bh * NTQ + o_q, mask=o_q < NTQ, other=0.0), 0)
    p_k = KP + (i_b * (HQ // GROUP) + i_hk) * NTK
    k_max = tl.max(tl.load(p_k + o_k, mask=o_k < NTK, other=0.0), 0)
    u = q_max * k_max * scale
    if IS_VARLEN:
        n = tl.maximum(tl.load(CU + i_b + 1) - tl.load(CU + i_b), 1).to(tl.float64)
    else:
        n = (i_b * 0 + TK).to(tl.float64)
    # log eps, a float64 host number, comes as its bits: Triton passes floats as float32
    log_eps = log_eps_bits.to(tl.float64, bitcast=True)
    tl.store(DELTA + i_bh, -2.0 * u.to(tl.float64) - tl.log(n) + log_eps)


def _max_norm_parts(x: Tensor, p: Problem) -> Tensor:
    """The per-tile maxima of ``||x_t||`` per (sequence, head), ``[B, heads, tiles]``."""
    _, t, nh, d = x.shape
    bd = max(16, triton.next_power_of_2(d))
    bt = max(16, 8192 // bd)
    nt = triton.cdiv(p.tk if p.cu_seqlens is not None else t, bt)
    part = torch.empty(p.batch, nh, nt, dtype=torch.float32, device=x.device)
    cu = p.cu_seqlens if p.cu_seqlens is not None else part
    _max_norm_kernel[(nt, p.batch * nh)](x, cu, part, x.stride(0), x.stride(1), x.stride(2),
                                         t, nh, nt, D=d, BD=bd, BT=bt,
                                         IS_VARLEN=p.cu_seqlens is not None)
    return part


def triton_acp_delta(q: Tensor, k: Tensor, p: Problem, acp_eps: float) -> Tensor:
    """``acp_delta("auto", acp_eps, q, k, p, triton_acp_bound)`` in three launches instead
    of about a dozen (the tiles' norm maxima of q and of k, then one program per
    (sequence, head) for U and delta), with no host copy: ``[B, HQ]`` float64, equal bit
    for bit. Inputs not contiguous in D take the unfused path."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        from .common import acp_delta

        return acp_delta("auto", acp_eps, q, k, p)
    qp, kp = _max_norm_parts(q, p), _max_norm_parts(k, p)
    delta = torch.empty(p.batch, p.hq, dtype=torch.float64, device=q.device)
    bits = struct.unpack("<q", struct.pack("<d", math.log(acp_eps)))[0]
    _acp_delta_kernel[(p.batch * p.hq,)](
        qp, kp, p.cu_seqlens if p.cu_seqlens is not None else qp, delta, p.tk, p.hq, p.hq // p.h,
        qp.shape[-1], kp.shape[-1], p.scale, bits,
        BQ=max(16, triton.next_power_of_2(qp.shape[-1])),
        BK=max(16, triton.next_power_of_2(kp.shape[-1])), IS_VARLEN=p.cu_seqlens is not None, num_warps=1,
    )
    return delta


def triton_block_start(c_hi: Tensor, c_lo: Tensor, delta: Tensor, p: Problem) -> Tensor:
    """First kept key block per query block, ``[B, HQ, M]`` int32 (see module docstring).

    c_hi, c_lo: ``[B, HQ, Tc]`` float32 halves of the cumulative gate
    (:func:`~lapse.ops.forgetting.triton_ops.triton_gate_cumsum`); delta: ``[B, HQ]`` float64.
    """
    mb = -(-p.tq // ACP_BLOCK)
    bs = torch.empty(p.batch, p.hq, mb, dtype=torch.int32, device=c_hi.device)
    block_m = 64
    grid = (triton.cdiv(mb, block_m), p.batch * p.hq)
    _block_start_kernel[grid](
        c_hi, c_lo, delta.contiguous(), p.cu_seqlens if p.cu_seqlens is not None else c_hi, bs,
        p.tq, p.tk, c_hi.shape[-1], p.hq, mb,
        G=ACP_BLOCK, BLOCK_M=block_m, BLOCK_N=64, IS_VARLEN=p.cu_seqlens is not None,
        num_warps=4,
    )
    return bs


def block_end_from_start(block_start: Tensor, p: Problem) -> Tensor:
    """For every key block n, the number of query blocks m with block_start[m] <= n.

    Query blocks past a sequence's end are excluded. Returns ``[B, HQ, N]`` int32.
    """
    nb = -(-p.tk // ACP_BLOCK)
    mb = block_start.shape[-1]
    if p.seqlens is None:
        valid_blocks = torch.full((p.batch,), -(-p.tq // ACP_BLOCK), device=block_start.device)
    else:
        valid_blocks = -(-torch.tensor(p.seqlens, device=block_start.device) // ACP_BLOCK)
    m = torch.arange(mb, device=block_start.device)
    big = torch.iinfo(torch.int32).max
    bs = torch.where(m[None, None, :] < valid_blocks[:, None, None], block_start, big)
    n = torch.arange(nb, device=block_start.device, dtype=torch.int32)
    n = n.expand(p.batch, p.hq, nb).contiguous()
    return torch.searchsorted(bs.contiguous(), n, right=True).to(torch.int32)
