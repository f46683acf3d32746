"""The gate's two scans on the GPU: the cumulative log gate for the forward, and the
reverse cumulative sum that turns the backward's row and column sums of dS into the
gradient of the log gates (SPEC section 1).

Both are float64 scans along time per (sequence, head), done in two launches so that
every chunk of every sequence runs at once (one program per (sequence, head) walking
the whole sequence took 55 us at T 16k on an H200, a sequential chain of loads):

1. ``_chunk_sum_kernel``: each chunk's sum, per head;
2. ``_scan_kernel``: each chunk adds the sums of the chunks before it (after it, for the
   reverse scan) and scans its own values.

A program holds a ``[BT, BH]`` tile (time x heads), so it reads the gates ``[B, T, HQ]``
whole rows at a time. The values are ``max(log f, floor)`` (forward) or ``rowsum_t(dS) -
colsum_t(dS)`` (gradient, ``GRAD``), both from :func:`_values`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CHUNKS = 128  # chunks per sequence: each program sums the others' partial sums


@triton.jit
def sequence_span(CU, i_b, TK, TQ, IS_VARLEN: tl.constexpr):
    """(first row, keys, queries, batch row) of sequence ``i_b``: packed sequences from
    ``CU``, else batch row ``i_b`` with ``TK`` keys and ``TQ`` queries."""
    if IS_VARLEN:
        bos = tl.load(CU + i_b).to(tl.int64)
        tk = tl.load(CU + i_b + 1).to(tl.int64) - bos
        tq = tk
        i_bt = i_b * 0
    else:
        bos = i_b * 0
        tk = i_b * 0 + TK
        tq = i_b * 0 + TQ
        i_bt = i_b
    return bos, tk, tq, i_bt


@triton.jit
def _values(X, Y, i_bt, bos, tk, tq, o_t, o_h, TC, HQ, floor, GRAD: tl.constexpr):
    """The scanned values at times ``o_t`` and heads ``o_h``, float64 ``[BT, BH]``, 0 outside.

    Forward: ``max(log f, floor)`` from ``X`` = the gates ``[B, Tc, HQ]``. ``GRAD``:
    ``dc_t = rowsum_t(dS) - colsum_t(dS)`` with ``X`` the column sums at key position t
    and ``Y`` the row sums at query index ``t - (tk - tq)``, both ``[B, HQ, Tc]``."""
    m = (o_t < tk)[:, None] & (o_h < HQ)[None, :]
    if GRAD:
        p_x = (i_bt * HQ + o_h[None, :]) * TC + bos + o_t[:, None]
        b_v = -tl.load(X + p_x, mask=m, other=0.0).to(tl.float64)
        off = tk - tq
        b_v += tl.load(Y + p_x - off, mask=m & (o_t >= off)[:, None], other=0.0).to(tl.float64)
    else:
        p_x = (i_bt * TC + bos + o_t[:, None]) * HQ + o_h[None, :]
        b_v = tl.maximum(tl.load(X + p_x, mask=m, other=0.0).to(tl.float64), floor)
    return b_v


@triton.jit
def _chunk_sum_kernel(X, Y, CU, PART, TK, TQ, TC, HQ, NC, floor, CT: tl.constexpr, BT: tl.constexpr,
                      BH: tl.constexpr, IS_VARLEN: tl.constexpr, GRAD: tl.constexpr):
    # PART[sequence, chunk, head]: the sum of the chunk's values
    i_c = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)
    o_h = tl.program_id(2) * BH + tl.arange(0, BH)
    bos, tk, tq, i_bt = sequence_span(CU, i_b, TK, TQ, IS_VARLEN)
    acc = tl.zeros([BH], dtype=tl.float64)
    for t0 in range(0, CT, BT):
        o_t = i_c * CT + t0 + tl.arange(0, BT)
        acc += tl.sum(_values(X, Y, i_bt, bos, tk, tq, o_t, o_h, TC, HQ, floor, GRAD), 0)
    tl.store(PART + (i_b * NC + i_c) * HQ + o_h, acc, mask=o_h < HQ)


@triton.jit
def _scan_kernel(X, Y, CU, PART, LG, OUT_A, OUT_B, TK, TQ, TC, HQ, NC, floor, CT: tl.constexpr,
                 BT: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr, IS_VARLEN: tl.constexpr,
                 GRAD: tl.constexpr):
    # forward: c (inclusive scan) as float32 hi + lo into OUT_A, OUT_B [B, HQ, Tc];
    # GRAD: the reverse inclusive scan, 0 where the gate was clamped, into OUT_A [B, Tc, HQ]
    i_c = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)
    o_h = tl.program_id(2) * BH + tl.arange(0, BH)
    m_h = o_h < HQ
    bos, tk, tq, i_bt = sequence_span(CU, i_b, TK, TQ, IS_VARLEN)
    o_c = tl.arange(0, BC)
    before = (o_c > i_c) if GRAD else (o_c < i_c)  # the chunks this one's scan continues
    b_part = tl.load(PART + (i_b * NC + o_c[:, None]) * HQ + o_h[None, :],
                     mask=(before & (o_c < NC))[:, None] & m_h[None, :], other=0.0)
    carry = tl.sum(b_part, 0)  # [BH] float64
    for i in range(0, CT, BT):
        t0 = CT - BT - i if GRAD else i
        o_t = i_c * CT + t0 + tl.arange(0, BT)
        b_v = _values(X, Y, i_bt, bos, tk, tq, o_t, o_h, TC, HQ, floor, GRAD)
        b_s = tl.cumsum(b_v, 0, reverse=GRAD) + carry[None, :]
        carry += tl.sum(b_v, 0)
        m = (o_t < tk)[:, None] & m_h[None, :]
        if GRAD:
            p_g = (i_bt * TC + bos + o_t[:, None]) * HQ + o_h[None, :]
            b_g = tl.load(LG + p_g, mask=m, other=0.0)
            tl.store(OUT_A + p_g, tl.where(b_g < floor, 0.0, b_s).to(tl.float32), mask=m)
        else:
            p_c = (i_bt * HQ + o_h[None, :]) * TC + bos + o_t[:, None]
            b_hi = b_s.to(tl.float32)
            tl.store(OUT_A + p_c, b_hi, mask=m)
            tl.store(OUT_B + p_c, (b_s - b_hi.to(tl.float64)).to(tl.float32), mask=m)


def _scan(x, y, lg, out_a, out_b, p, floor: float, grad: bool) -> None:
    """Both launches of a scan over every (sequence, head); see the module docstring."""
    hq = p.hq
    tc = lg.shape[1]
    t_max = p.tk  # the longest sequence (packed ones included)
    bh = min(32, max(2, triton.next_power_of_2(hq)))
    bt = max(16, 4096 // bh)
    ct = max(bt, triton.next_power_of_2(triton.cdiv(max(t_max, 1), MAX_CHUNKS)))
    nc = triton.cdiv(max(t_max, 1), ct)
    varlen = p.cu_seqlens is not None
    cu = p.cu_seqlens if varlen else lg
    part = torch.empty(p.batch, nc, hq, dtype=torch.float64, device=lg.device)
    grid = (nc, p.batch, triton.cdiv(hq, bh))
    common = dict(CT=ct, BT=bt, BH=bh, IS_VARLEN=varlen, GRAD=grad)
    _chunk_sum_kernel[grid](x, y, cu, part, p.tk, p.tq, tc, hq, nc, floor, **common)
    _scan_kernel[grid](x, y, cu, part, lg, out_a, out_b, p.tk, p.tq, tc, hq, nc, floor,
                       BC=max(2, triton.next_power_of_2(nc)), **common)


def gate_cumsum(log_fgate, p, floor: float):
    """(c_hi, c_lo) float32 ``[B, HQ, Tc]``: ``c = cumsum(max(log f, floor))`` in float64
    per sequence, split as in common.py."""
    b, tc, hq = log_fgate.shape
    c_hi = torch.empty(b, hq, tc, dtype=torch.float32, device=log_fgate.device)
    c_lo = torch.empty_like(c_hi)
    lg = log_fgate.contiguous()
    _scan(lg, lg, lg, c_hi, c_lo, p, floor, grad=False)
    return c_hi, c_lo


def gate_grad(dcc, dcr, log_fgate, p, floor: float):
    """d log_fgate ``[B, Tc, HQ]`` float32 from the column and row sums of dS: ``dc_t =
    rowsum_t - colsum_t``, then ``d log f_t = sum_{i >= t} dc_i`` (0 where the gate was
    clamped at ``floor``)."""
    lg = log_fgate.contiguous()
    dlg = torch.empty_like(lg)
    _scan(dcc, dcr, lg, dlg, dlg, p, floor, grad=True)
    return dlg
