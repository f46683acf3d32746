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

from .common import ACP_BLOCK, Problem, acp_delta, check_acp_eps

NORM_TILE = 8192  # elements of q or k a program of the norms reads (tests lower it)
NORM_WARPS = 4  # the norms' warps a program
PARTS_BLOCK = 1024  # the widest read of the norms' tile maxima (a loop past it; tests lower it)


@triton.jit
def _delta_from_norms(QP, KP, CU, i_b, i_h, HQ, GROUP, NT, TK, scale, log_eps_bits,
                      BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """delta = -2 U - log L + log eps in float64 for (sequence ``i_b``, query head ``i_h``),
    ``U = max ||q|| * max ||k|| * scale`` from the tiles' maxima (:func:`_norm_parts`),
    in :func:`~lapse.ops.forgetting.common.acp_delta`'s order."""
    o_t = tl.arange(0, BT)
    q_max = tl.zeros([BT], dtype=tl.float32)
    k_max = tl.zeros([BT], dtype=tl.float32)
    p_q = QP + (i_b * HQ + i_h) * NT
    p_k = KP + (i_b * (HQ // GROUP) + i_h // GROUP) * NT
    for t0 in range(0, NT, BT):
        m_t = t0 + o_t < NT
        q_max = tl.maximum(q_max, tl.load(p_q + t0 + o_t, mask=m_t, other=0.0))
        k_max = tl.maximum(k_max, tl.load(p_k + t0 + o_t, mask=m_t, other=0.0))
    u = tl.max(q_max, 0) * tl.max(k_max, 0) * scale
    if IS_VARLEN:
        n = tl.maximum(tl.load(CU + i_b + 1) - tl.load(CU + i_b), 1).to(tl.float64)
    else:
        n = (i_b * 0 + TK).to(tl.float64)
    # log eps, a float64 host number, comes as its bits: Triton passes floats as float32
    log_eps = log_eps_bits.to(tl.float64, bitcast=True)
    return -2.0 * u.to(tl.float64) - tl.log(n) + log_eps


@triton.jit
def _block_start_kernel(
    CHI, CLO, DELTA, CU, BS, QP, KP,
    TQ, TK, TC, HQ, MB, GROUP, NT, scale, log_eps_bits,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
    AUTO: tl.constexpr = False, BT: tl.constexpr = 16,
):
    # AUTO: delta from the norms' tile maxima QP, KP (acp="auto"), else read from DELTA
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
    if AUTO:
        delta = _delta_from_norms(QP, KP, CU, i_b, i_h, HQ, GROUP, NT, TK, scale, log_eps_bits, BT, IS_VARLEN)
    else:
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
def _tile_max_norm(X, OUT, CU, i_x, i_t, i_b, i_h, stride_xb, stride_xt, stride_xh, t, NT,
                   D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The largest row norm of time tile ``i_t`` of (sequence ``i_b``, head ``i_h``) of ``X``
    ``[B, T, H, D]``, stored at ``OUT[i_x, i_t]``."""
    if IS_VARLEN:
        bos = tl.load(CU + i_b).to(tl.int64)
        t = tl.load(CU + i_b + 1).to(tl.int64) - bos
        i_bt = i_b * 0
    else:
        bos = i_b * 0
        i_bt = i_b
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m = (o_t < t)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(X + i_bt * stride_xb + (bos + o_t[:, None]) * stride_xt + i_h * stride_xh
                  + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + i_x * NT + i_t, tl.max(tl.sqrt(tl.sum(b_x * b_x, 1)), 0))


@triton.jit
def _max_norm_kernel(Q, K, CU, OUT, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                     TQ, TK, HQ, H, NQ, NT,
                     D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # per (sequence, head, time tile) of q (OUT's first NQ = B x HQ rows) or of k (the rest):
    # the largest row norm, float32. The (q or k) x head axis is the grid's first (up to 2^31
    # programs; the second stops at 65535). Each branch loads through its own argument: a
    # pointer chosen between the two loses what the compiler knows of its alignment and the
    # strides', and the loads go from 16 bytes to 2 (1,190 against 2,270 GiB/s on an H100)
    i_x = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1).to(tl.int64)
    if i_x < NQ:
        _tile_max_norm(Q, OUT, CU, i_x, i_t, i_x // HQ, i_x % HQ, stride_qb, stride_qt, stride_qh, TQ, NT,
                       D, BD, BT, IS_VARLEN)
    else:
        _tile_max_norm(K, OUT, CU, i_x, i_t, (i_x - NQ) // H, (i_x - NQ) % H, stride_kb, stride_kt, stride_kh,
                       TK, NT, D, BD, BT, IS_VARLEN)


def _norm_parts(q: Tensor, k: Tensor, p: Problem) -> tuple[Tensor, Tensor]:
    """The per-tile maxima of ``||q_t||`` ``[B, HQ, tiles]`` and of ``||k_t||`` ``[B, H,
    tiles]`` per (sequence, head), float32, in one launch (q and k last-dim contiguous)."""
    d = q.shape[-1]
    bd = max(16, triton.next_power_of_2(d))
    bt = max(16, NORM_TILE // bd)
    nt = triton.cdiv(p.tk if p.cu_seqlens is not None else max(q.shape[1], k.shape[1]), bt)
    nq = p.batch * p.hq
    parts = torch.empty(nq + p.batch * p.h, nt, dtype=torch.float32, device=q.device)
    cu = p.cu_seqlens if p.cu_seqlens is not None else parts
    _max_norm_kernel[(nq + p.batch * p.h, nt)](
        q, k, cu, parts, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q.shape[1], k.shape[1], p.hq, p.h, nq, nt, D=d, BD=bd, BT=bt, IS_VARLEN=p.cu_seqlens is not None,
        num_warps=NORM_WARPS,
    )
    return parts[:nq].view(p.batch, p.hq, nt), parts[nq:].view(p.batch, p.h, nt)


def triton_acp_bound(q: Tensor, k: Tensor, p: Problem) -> Tensor:
    """U = max ||q|| * max ||k|| * scale per (sequence, query head), ``[B, HQ]`` float32.

    The same bound as :func:`~lapse.ops.forgetting.common.acp_bound_from_data` in one pass
    over q and k, without a float32 copy, packed sequences included.
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        from .common import acp_bound_from_data

        return acp_bound_from_data(q, k, p)
    qp, kp = _norm_parts(q, k, p)
    return qp.amax(-1) * kp.amax(-1).repeat_interleave(p.hq // p.h, dim=1) * p.scale


@triton.jit
def _acp_delta_kernel(QP, KP, CU, DELTA, TK, HQ, GROUP, NT, scale, log_eps_bits,
                      BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    # per (sequence, query head): delta from the tiles' maxima
    i_bh = tl.program_id(0).to(tl.int64)
    delta = _delta_from_norms(QP, KP, CU, i_bh // HQ, i_bh % HQ, HQ, GROUP, NT, TK, scale, log_eps_bits,
                              BT, IS_VARLEN)
    tl.store(DELTA + i_bh, delta)


def _log_eps_bits(acp_eps: float) -> int:
    """log eps as the bits of a float64 (Triton passes float arguments as float32)."""
    return struct.unpack("<q", struct.pack("<d", math.log(acp_eps)))[0]


def _parts_block(nt: int) -> int:
    """The vector width that reads the norms' tile maxima."""
    return min(PARTS_BLOCK, max(16, triton.next_power_of_2(nt)))


def triton_acp_delta(q: Tensor, k: Tensor, p: Problem, acp_eps: float) -> Tensor:
    """``acp_delta("auto", acp_eps, q, k, p, triton_acp_bound)`` in two launches instead of
    about a dozen (the tiles' norm maxima of q and k, then one program per (sequence, head)
    for U and delta), with no host copy: ``[B, HQ]`` float64, equal bit for bit. Inputs not
    contiguous in D take the unfused path. The op itself folds delta into the boundary
    search (:func:`triton_acp_block_start`)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return acp_delta("auto", acp_eps, q, k, p)
    qp, kp = _norm_parts(q, k, p)
    nt = qp.shape[-1]
    delta = torch.empty(p.batch, p.hq, dtype=torch.float64, device=q.device)
    _acp_delta_kernel[(p.batch * p.hq,)](
        qp, kp, p.cu_seqlens if p.cu_seqlens is not None else qp, delta, p.tk, p.hq, p.hq // p.h,
        nt, p.scale, _log_eps_bits(acp_eps), BT=_parts_block(nt), IS_VARLEN=p.cu_seqlens is not None,
        num_warps=1,
    )
    return delta


def triton_block_start(c_hi: Tensor, c_lo: Tensor, delta: Tensor, p: Problem) -> Tensor:
    """First kept key block per query block, ``[B, HQ, M]`` int32 (see module docstring).

    c_hi, c_lo: ``[B, HQ, Tc]`` float32 halves of the cumulative gate
    (:func:`~lapse.ops.forgetting.triton_ops.triton_gate_cumsum`); delta: ``[B, HQ]`` float64.
    """
    return _block_start(c_hi, c_lo, p, delta=delta.contiguous())


def _block_start(c_hi: Tensor, c_lo: Tensor, p: Problem, delta: Tensor | None = None,
                 parts: tuple[Tensor, Tensor] | None = None, log_eps_bits: int = 0) -> Tensor:
    """The boundary search's launch: from ``delta``, or (``parts``, the norms' tile maxima of
    :func:`_norm_parts`) with each program computing its own delta."""
    mb = -(-p.tq // ACP_BLOCK)
    bs = torch.empty(p.batch, p.hq, mb, dtype=torch.int32, device=c_hi.device)
    block_m = 64
    grid = (triton.cdiv(mb, block_m), p.batch * p.hq)
    qp, kp = parts if parts is not None else (c_hi, c_hi)
    nt = qp.shape[-1] if parts is not None else 1
    _block_start_kernel[grid](
        c_hi, c_lo, delta if delta is not None else c_hi, p.cu_seqlens if p.cu_seqlens is not None else c_hi,
        bs, qp, kp, p.tq, p.tk, c_hi.shape[-1], p.hq, mb, p.hq // p.h, nt, p.scale, log_eps_bits,
        G=ACP_BLOCK, BLOCK_M=block_m, BLOCK_N=64, IS_VARLEN=p.cu_seqlens is not None,
        AUTO=parts is not None, BT=_parts_block(nt), num_warps=4,
    )
    return bs


def triton_acp_block_start(acp, acp_eps: float, q: Tensor, k: Tensor, c_hi: Tensor, c_lo: Tensor,
                           p: Problem) -> Tensor:
    """ACP's boundaries on the Triton path: :func:`triton_block_start` of
    ``acp_delta(acp, acp_eps, ...)``, ``[B, HQ, M]`` int32. With ``acp="auto"`` (q and k
    contiguous in D) two launches in all: the norms' tile maxima of q and k, then the
    search, each of whose programs computes its delta from them (equal bit for bit to
    :func:`triton_acp_delta`'s)."""
    if isinstance(acp, str) and acp == "auto" and q.stride(-1) == 1 and k.stride(-1) == 1:
        check_acp_eps(acp_eps)
        return _block_start(c_hi, c_lo, p, parts=_norm_parts(q, k, p), log_eps_bits=_log_eps_bits(acp_eps))
    return triton_block_start(c_hi, c_lo, acp_delta(acp, acp_eps, q, k, p), p)  # delta [B, HQ]


@triton.jit
def _block_end_kernel(BS, BE, CU, TQ, HQ, MB, NB,
                      G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr):
    # per (key-block chunk, sequence x head): the number of the sequence's query blocks m
    # with block_start[m] <= n, in vector compares
    i_bh = tl.program_id(0).to(tl.int64)  # the first axis: no 65535 limit
    i_n = tl.program_id(1)
    if IS_VARLEN:
        i_b = i_bh // HQ
        tq = tl.load(CU + i_b + 1) - tl.load(CU + i_b)
    else:
        tq = TQ
    valid = (tq + G - 1) // G  # query blocks of this sequence
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    count = tl.zeros([BLOCK_N], dtype=tl.int32)
    for m0 in range(0, valid, BLOCK_M):
        o_m = m0 + tl.arange(0, BLOCK_M)
        b_bs = tl.load(BS + i_bh * MB + o_m, mask=o_m < valid, other=2147483647)
        count += tl.sum((b_bs[:, None] <= o_n[None, :]).to(tl.int32), 0)
    tl.store(BE + i_bh * NB + o_n, count, mask=o_n < NB)


def block_end_from_start(block_start: Tensor, p: Problem) -> Tensor:
    """For every key block n, the number of query blocks m with block_start[m] <= n
    (query blocks past a sequence's end excluded): ``[B, HQ, N]`` int32, one launch.
    :func:`block_end_reference` is the same in torch operations."""
    nb = -(-p.tk // ACP_BLOCK)
    mb = block_start.shape[-1]
    be = torch.empty(p.batch, p.hq, nb, dtype=torch.int32, device=block_start.device)
    block_n = min(128, max(16, triton.next_power_of_2(nb)))
    _block_end_kernel[(p.batch * p.hq, triton.cdiv(nb, block_n))](
        block_start.contiguous(), be, p.cu_seqlens if p.cu_seqlens is not None else block_start,
        p.tq, p.hq, mb, nb, G=ACP_BLOCK, BLOCK_M=32, BLOCK_N=block_n, IS_VARLEN=p.cu_seqlens is not None,
        num_warps=4,
    )
    return be


def block_end_reference(block_start: Tensor, p: Problem) -> Tensor:
    """:func:`block_end_from_start` as a ``searchsorted`` over the staircase (the test's
    reference; query blocks past a sequence's end excluded). Returns ``[B, HQ, N]`` int32."""
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
