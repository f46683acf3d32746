"""Fused backward kernels of forgetting attention with ACP (SPEC sections 1 and 3).

Two kernels, no atomics (or, at D 128, the dK/dV kernel and a dQ kernel of one product a
tile, ``FUSE_DQ="ds"`` below):
- ``_bwd_dkdv_kernel``: one program per (key tile, batch x key head); loops over the
  query heads of the group and over query tiles; writes dK, dV and the column sums of dS
  per query head.
- ``_bwd_dq_kernel``: one program per (query tile, batch x query head); loops over key
  tiles; writes dQ and the row sums of dS.
Or one kernel (``FUSE_DQ`` in the dK/dV config, a measured option): the dK/dV kernel
also adds each tile's ``dS K`` and row sums of dS into float32 buffers with atomics, so
S and dP are computed once per tile instead of twice (5 matrix products per tile, not 7);
dQ is then that buffer times the scale. Its sums' order varies from run to run.
``FUSE_DQ="tma"`` adds each tile's dQ with one bulk operation of the tensor-memory engine
instead of an atomic add a thread an element; both are slower than two kernels on an H100
and an H200 at D 64 and 128. ``FUSE_DQ="ds"`` (D 128's table) keeps dS instead: the dK/dV kernel
stores it in 16 bits through a tensor descriptor and sums it by key as stored, and
``_dq_from_ds_kernel`` makes dQ with one product a tile and sums it by query (so the gate's two
sums add the same numbers); at D 128, 10-13% less backward time dense and 5-11% with ACP
on an H200 (:func:`bwd_config`), where dS fits its budget. ``ROW_BIAS`` (16-bit inputs)
subtracts the query's ``c_i`` from its lse once a row instead of adding it to every pair.
The gate gradient is ``dc_i = rowsum_i(dS) - colsum_i(dS)`` then a reverse cumulative sum
(``gate_scan.py``, float64). Both kernels skip exactly the tiles the forward skipped: for a key
tile the kept query rows are a contiguous range ending at ``block_end * ACP_BLOCK``.
The same three-loop split as the forward keeps the interior loop free of masks.

Each query's inputs, ``Delta = rowsum(dO * O)`` and its lse less its ``c_lo log2 e``, are
made once (:func:`_query_rows`): by the dQ kernel, run first (``MAKE_ROWS``), or by a
launch of their own before the others. Each small vector load a loop pipelines costs a
shared-memory buffer, a copy and a wait per step, so the dK/dV loop reads a query's
``(lse - c_lo log2 e, delta, c_hi, 0)`` in one 16-byte load (``ROWS4``), and the dQ kernel
may read each key's ``(c_hi, c_lo)`` in one 8-byte load (``PAIRS``,
:func:`triton_fwd.key_bias`); :func:`bwd_config` has the measurements.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..backend import LOG2E, LOG2E_TL
from . import triton_fwd
from .gate_scan import sequence_span
from .triton_fwd import (
    device_descriptors,
    head_rows_descriptor,
    keeps_every_key,
    key_bias,
    loop_runs,
    program_tile,
    tile_grid,
    tma_device,
    tma_mode,
    tma_ready,
)


@triton.jit
def _query_rows(b_o, b_do, p_lse, p_dlse, p_rows, b_chi, b_clo, o_m, m_m, HAS_DLSE: tl.constexpr):
    """Rows ``o_m``'s backward inputs from their outputs: ``Delta = rowsum(dO * O)`` (less
    ``dlse``, a gradient of the lse, which adds ``P_ij dlse_i`` to dS), and the base-2 lse
    less the query's ``c_lo log2 e`` (so the kernels read ``c_hi`` alone for a query: both
    small, exact to float32 rounding). Stores ``(lse - c_lo, delta, c_hi, 0)`` at
    ``p_rows`` (16 bytes a row) and returns ``(lse - c_lo, delta)``."""
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)
    if HAS_DLSE:
        b_delta -= tl.load(p_dlse + o_m, mask=m_m, other=0.0)
    b_lse = tl.load(p_lse + o_m, mask=m_m, other=0.0) - b_clo * LOG2E_TL
    o_4 = tl.arange(0, 4)[None, :]
    b_r = tl.where(o_4 == 0, b_lse[:, None], tl.where(o_4 == 1, b_delta[:, None],
                                                      tl.where(o_4 == 2, b_chi[:, None], 0.0)))
    tl.store(p_rows + o_m[:, None] * 4 + o_4, b_r, mask=m_m[:, None])
    return b_lse, b_delta


@triton.jit
def _rows_kernel(O, DO, LSE, DLSE, CHI, CLO, ROWS, CU, stride_ob, stride_ot, stride_oh, stride_dob,
                 stride_dot, stride_doh, TQ, TK, TC, TQD, HQ, D: tl.constexpr, BD: tl.constexpr,
                 BT: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr):
    # the rows of _query_rows for BT queries (when the dQ kernel does not make them itself)
    i_t = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // HQ
    i_h = i_bh % HQ
    bos, tk, tq, i_bt = sequence_span(CU, i_b, TK, TQ, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < tq
    o_d = tl.arange(0, BD)
    m = m_t[:, None] & (o_d < D)[None, :]
    b_o = tl.load(O + i_bt * stride_ob + (bos + o_t[:, None]) * stride_ot + i_h * stride_oh
                  + o_d[None, :], mask=m, other=0.0)
    b_do = tl.load(DO + i_bt * stride_dob + (bos + o_t[:, None]) * stride_dot + i_h * stride_doh
                   + o_d[None, :], mask=m, other=0.0)
    p_row = (i_bt * HQ + i_h) * TC + bos
    o_abs = tl.minimum(o_t + tk - tq, tk - 1)  # the query's key position
    b_chi = tl.load(CHI + p_row + o_abs, mask=m_t, other=0.0)
    b_clo = tl.load(CLO + p_row + o_abs, mask=m_t, other=0.0)
    _query_rows(b_o, b_do, LSE + p_row, DLSE + (i_bt * HQ + i_h) * TQD + bos, ROWS + p_row * 4,
                b_chi, b_clo, o_t, m_t, HAS_DLSE)


@triton.jit
def _dkdv_inner(
    b_dk, b_dv, b_dcc,
    b_k, b_v, b_ck, o_n, k0,
    p_q, p_do, p_rows, p_chi, p_bs, c_ref,
    p_dqa, p_dcra, dq_row, dq_col, dq_rows,
    stride_qt, stride_dot, stride_dqat,
    lo, hi, tq, off, qk_scale,
    o_d, m_d,
    BM: tl.constexpr, G: tl.constexpr, MASKED: tl.constexpr, USE_ACP: tl.constexpr,
    DOT_PREC: tl.constexpr, FUSE_DQ: tl.constexpr, BIAS: tl.constexpr = 1, ROWS4: tl.constexpr = False,
    STAGES: tl.constexpr = None, ROW_BIAS: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    tma_row=0, tma_col=0, ds_rows=0, USE_TMA_DS: tl.constexpr = False,
):
    # USE_TMA: p_q, p_do are descriptors over [B * Tq, HQ * D] whose block (tma_row + start,
    # tma_col) is this head's queries from start on (rows past the sequence are the next one's:
    # their bias, or lse, masks them, and a finite row times a zero weight adds nothing)
    for start in tl.range(lo, hi, BM, num_stages=STAGES):  # STAGES: None, the launch's
        o_m = start + tl.arange(0, BM)
        m_m = o_m < tq
        # [BM, BD]
        if USE_TMA:
            b_q = p_q.load([tl.cast(tma_row + start, tl.int32), tma_col])
            b_do = p_do.load([tl.cast(tma_row + start, tl.int32), tma_col])
        else:
            b_q = tl.load(p_q + o_m[:, None] * stride_qt + o_d[None, :],
                          mask=m_m[:, None] & m_d[None, :], other=0.0)
            b_do = tl.load(p_do + o_m[:, None] * stride_dot + o_d[None, :],
                           mask=m_m[:, None] & m_d[None, :], other=0.0)
        o_abs = o_m + off
        if ROWS4:  # each row's (lse - c_lo, delta, c_hi, 0) in one 16-byte load (_query_rows)
            o_4 = tl.arange(0, 4)[None, :]
            b_r = tl.load(p_rows + o_m[:, None] * 4 + o_4, mask=m_m[:, None], other=0.0)
            b_lse = tl.sum(tl.where(o_4 == 0, b_r, 0.0), 1)
            b_delta = tl.sum(tl.where(o_4 == 1, b_r, 0.0), 1)
            b_chi = tl.sum(tl.where(o_4 == 2, b_r, 0.0), 1)
        else:  # three loads a step
            b_lse = tl.load(p_rows + o_m * 4, mask=m_m, other=0.0)
            b_delta = tl.load(p_rows + o_m * 4 + 1, mask=m_m, other=0.0)
            b_chi = tl.load(p_chi + tl.minimum(o_abs, tq + off - 1))
        # the query's c_lo is in its lse (_query_rows): one load a step less
        if BIAS == 1 or BIAS == 3:  # the bias (3: without the gate sums)
            b_cq = (b_chi - c_ref) * LOG2E_TL
        else:  # no bias, as plain causal softmax attention: a timing diagnostic only (BIAS 0, 2)
            b_cq = tl.zeros([BM], dtype=tl.float32)
        if ROW_BIAS:  # the query's c_i joins its lse: one multiply-add and one add a pair
            b_lse = b_lse - b_cq
        if MASKED:  # rows past the end, and with ACP rows whose first kept key is past this
            # tile (BN divides the ACP block: kept or pruned whole), get -inf through their bias
            row_ok = m_m
            if USE_ACP:
                b_kstart = tl.load(p_bs + o_m // G, mask=m_m, other=0) * G
                row_ok = row_ok & (k0 >= b_kstart)
            if ROW_BIAS:  # (or +inf through their lse)
                b_lse = tl.where(row_ok, b_lse, float("inf"))
            else:
                b_cq = tl.where(row_ok, b_cq, float("-inf"))
        # [BN, BM] transposed scores, base 2
        if ROW_BIAS and (BIAS == 1 or BIAS == 3):
            b_st = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC) * qk_scale - b_ck[:, None]
        else:
            b_st = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC) * qk_scale
            if BIAS == 1 or BIAS == 3:
                b_st += b_cq[None, :] - b_ck[:, None]
            elif MASKED and not ROW_BIAS:
                b_st += b_cq[None, :]
        if MASKED == 2:  # and the causal mask, in 32-bit positions (64-bit: two compares a pair)
            b_st = tl.where(o_n.to(tl.int32)[:, None] <= o_abs.to(tl.int32)[None, :], b_st, float("-inf"))
        b_pt = tl.math.exp2(b_st - b_lse[None, :])
        b_dv = tl.dot(b_pt.to(b_do.dtype), b_do, b_dv, input_precision=DOT_PREC)
        # [BN, BM]
        b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC)
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        b_dst_lo = b_dst.to(b_q.dtype)
        if BIAS == 1 or BIAS == 2:  # the gate sums (2: without the bias); with dS kept, of the
            # 16-bit dS that _dq_from_ds_kernel sums by rows: the two sums cancel in the gate's
            # suffix sums only if they add the same numbers
            b_dcc += tl.sum(b_dst_lo.to(tl.float32) if FUSE_DQ == 4 else b_dst, 1)
        b_dk = tl.dot(b_dst_lo, b_q, b_dk, input_precision=DOT_PREC)
        if FUSE_DQ == 4:  # dS kept for _dq_from_ds_kernel, as it is here (keys x queries,
            # queries contiguous): this key block's rows of the head's staircase (p_dqa)
            if USE_TMA_DS:  # p_dqa: a descriptor over the key block's rows (the engine clips
                # the columns past Tq); no per-element addresses held in registers
                p_dqa.store([0, tl.cast(start - k0, tl.int32)], b_dst_lo)
            else:
                p_t = p_dqa + (ds_rows[:, None] + o_m.to(tl.int32)[None, :])  # 32-bit offsets
                tl.store(p_t, b_dst_lo, mask=m_m[None, :] & (o_n < tq)[:, None])
        elif FUSE_DQ:  # this tile's share of dQ (unscaled) and of the row sums of dS
            b_dq = tl.dot(tl.trans(b_dst_lo), b_k, input_precision=DOT_PREC)  # [BM, BD]
            if FUSE_DQ == 2:  # one bulk add from shared memory by the tensor-memory engine;
                # rows past the sequence add zeros (their dS is 0) to the next one's
                p_dqa.atomic_add([tl.cast(dq_row + start, tl.int32), dq_col], b_dq)
            elif FUSE_DQ == 3:  # the interpreter's stand-in for 2 (it has no bulk adds): the
                # same rows of the [B * Tq, HQ * D] view, clipped at its end only
                o_r = dq_row + o_m
                tl.atomic_add(p_dqa + o_r[:, None] * stride_dqat + dq_col + o_d[None, :], b_dq,
                              mask=(o_r < dq_rows)[:, None] & m_d[None, :], sem="relaxed")
            else:  # an atomic add a thread an element
                tl.atomic_add(p_dqa + o_m[:, None] * stride_dqat + o_d[None, :], b_dq,
                              mask=m_m[:, None] & m_d[None, :], sem="relaxed")
            tl.atomic_add(p_dcra + o_m, tl.sum(b_dst, 0), mask=m_m, sem="relaxed")
    return b_dk, b_dv, b_dcc


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, ROWS, CHI, CLO, BSTART, BEND, CU, DK, DV, DCC, DQA, DCRA,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh,
    stride_dqab, stride_dqat, stride_dqah,
    qk_scale, scale, TQ, TK, TC, HQ, H, MB, NB, DQ_ROWS,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    G: tl.constexpr, GROUP: tl.constexpr, IS_VARLEN: tl.constexpr, USE_ACP: tl.constexpr,
    DOT_PREC: tl.constexpr, FUSE_DQ: tl.constexpr, BIAS: tl.constexpr = 1, ROWS4: tl.constexpr = False,
    LOOPS: tl.constexpr = 0, ROW_BIAS: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    HEADS_FIRST: tl.constexpr = False, USE_TMA_DS: tl.constexpr = False, ROUTE: tl.constexpr = 0,
):
    i_n, i_bh = program_tile(False, HEADS_FIRST)  # the first key tiles have the most queries
    i_b = i_bh // H
    i_hk = i_bh % H
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
    k0 = i_n * BN
    if k0 >= tk:
        return
    if ROUTE:  # one of two launches (launch_bwd's ROUTE): 1 serves the kv heads whose query
        # heads ACP prunes nowhere, 2 the others
        n_kept = 0
        for g in tl.static_range(GROUP):
            n_kept += keeps_every_key(BSTART, i_b * HQ + i_hk * GROUP + g, MB, tq, G).to(tl.int32)
        if (n_kept == GROUP) != (ROUTE == 1):
            return
    off = tk - tq
    o_n = k0 + tl.arange(0, BN)
    m_n = o_n < tk
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    # [BN, BD]
    b_k = tl.load(K + i_bt * stride_kb + (bos + o_n[:, None]) * stride_kt + i_hk * stride_kh
                  + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_v = tl.load(V + i_bt * stride_vb + (bos + o_n[:, None]) * stride_vt + i_hk * stride_vh
                  + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_dk = tl.zeros([BN, BD], dtype=tl.float32)
    b_dv = tl.zeros([BN, BD], dtype=tl.float32)

    # query rows that see some key of this tile: abs position >= k0
    q_lo = (tl.maximum(k0 - off, 0) // BM) * BM
    # rows from diag_end on see every key of the tile causally
    # (clamped before dividing: integer division in Triton truncates toward zero)
    diag_rows = tl.maximum(k0 + BN - 1 - off, 0)
    diag_end = tl.minimum(((diag_rows + BM - 1) // BM) * BM, ((tq + BM - 1) // BM) * BM)
    diag_end = tl.maximum(diag_end, q_lo)
    tq_floor = (tq // BM) * BM
    # GROUP is a compile-time constant: with a run-time trip count the loop kept its state
    # live around the three inner loops, and the kernel spilled 604 B per thread at D 64
    # (1612 at D 128) compiled for sm_90; with GROUP = 1 known, none (196 B at D 128)
    for g in range(0, GROUP):
        i_h = i_hk * GROUP + g
        if USE_ACP:
            tl.static_assert(G % BN == 0, "with ACP a key tile divides the ACP block")
            p_be = BEND + (i_b * HQ + i_h) * NB
            q_full = tl.load(p_be + k0 // G) * G
            q_end = tl.minimum(tl.load(p_be + (tl.minimum(k0 + BN, tk) - 1) // G) * G, tq)
        else:
            q_full = tq
            q_end = tq
        a = tl.minimum(diag_end, q_end)
        b = tl.maximum(a, tl.minimum(q_full, tq_floor))
        p_chi = CHI + (i_bt * HQ + i_h) * TC + bos
        p_clo = CLO + (i_bt * HQ + i_h) * TC + bos
        c_ref = tl.load(p_chi + k0)
        b_ck = ((tl.load(p_chi + o_n, mask=m_n, other=0.0) - c_ref)
                + tl.load(p_clo + o_n, mask=m_n, other=0.0)) * LOG2E_TL
        if USE_TMA:  # descriptors made on the host (launch_bwd)
            p_q = Q
            p_do = DO
        else:
            p_q = Q + i_bt * stride_qb + bos * stride_qt + i_h * stride_qh
            p_do = DO + i_bt * stride_dob + bos * stride_dot + i_h * stride_doh
        tma_row = tl.cast(i_bt * TQ + bos, tl.int32)
        tma_col = tl.cast(i_h * D, tl.int32)
        p_rows = ROWS + ((i_bt * HQ + i_h) * TC + bos) * 4
        p_bs = BSTART + (i_b * HQ + i_h) * MB
        if FUSE_DQ == 4:  # dS kept (stride_dqab: the staircase's size a head): this key
            # block's rows of the head's staircase, key k0 + j in row j over the queries from k0
            # on (p_dqa less k0: a query's own index is its column; ds_rows, each row's start,
            # computed once)
            p_dqa = DQA + (i_b * HQ + i_h) * stride_dqab + G * (i_n * tq - G * (i_n * (i_n - 1) // 2))
            ds_rows = ((o_n - k0) * (tq - k0)).to(tl.int32)
            if USE_TMA_DS:  # the block's rows as a [BN, Tq - k0] matrix
                row_len = tl.cast(tq - k0, tl.int32)
                p_dqa = tl.make_tensor_descriptor(p_dqa, shape=[BN, row_len], strides=[row_len, 1],
                                                  block_shape=[BN, BM])
            else:
                p_dqa = p_dqa - k0
            p_dcra = DCRA
        elif FUSE_DQ >= 2:  # a descriptor made on the host over [B * Tq, HQ * D] (launch_bwd),
            p_dqa = DQA  # or (3) that view's first element
            p_dcra = DCRA + (i_bt * HQ + i_h) * TC + bos
            ds_rows = 0
        else:
            p_dqa = DQA + i_bt * stride_dqab + bos * stride_dqat + i_h * stride_dqah
            p_dcra = DCRA + (i_bt * HQ + i_h) * TC + bos
            ds_rows = 0
        dq_row = i_bt * TQ + bos
        dq_col = tl.cast(i_h * D, tl.int32)
        b_dcc = tl.zeros([BN], dtype=tl.float32)
        # LOOPS: as in triton_fwd._fwd_kernel (1: empty loops not entered; 2: the masked ones
        # not pipelined; 3: both)
        ns_m: tl.constexpr = 1 if LOOPS >= 2 else None
        run_lo, run_mid, run_hi = loop_runs(q_lo, a, b, q_end, LOOPS)
        if run_lo:
            b_dk, b_dv, b_dcc = _dkdv_inner(b_dk, b_dv, b_dcc, b_k, b_v, b_ck, o_n, k0, p_q, p_do, p_rows,
                                            p_chi, p_bs, c_ref, p_dqa, p_dcra, dq_row, dq_col, DQ_ROWS,
                                            stride_qt, stride_dot, stride_dqat,
                                            q_lo, a, tq, off, qk_scale, o_d, m_d,
                                            BM, G, 2, USE_ACP, DOT_PREC, FUSE_DQ, BIAS, ROWS4, ns_m, ROW_BIAS,
                                            USE_TMA, tma_row, tma_col, ds_rows, USE_TMA_DS)
        if run_mid:
            b_dk, b_dv, b_dcc = _dkdv_inner(b_dk, b_dv, b_dcc, b_k, b_v, b_ck, o_n, k0, p_q, p_do, p_rows,
                                            p_chi, p_bs, c_ref, p_dqa, p_dcra, dq_row, dq_col, DQ_ROWS,
                                            stride_qt, stride_dot, stride_dqat,
                                            a, b, tq, off, qk_scale, o_d, m_d,
                                            BM, G, 0, USE_ACP, DOT_PREC, FUSE_DQ, BIAS, ROWS4, None, ROW_BIAS,
                                            USE_TMA, tma_row, tma_col, ds_rows, USE_TMA_DS)
        if run_hi:
            b_dk, b_dv, b_dcc = _dkdv_inner(b_dk, b_dv, b_dcc, b_k, b_v, b_ck, o_n, k0, p_q, p_do, p_rows,
                                            p_chi, p_bs, c_ref, p_dqa, p_dcra, dq_row, dq_col, DQ_ROWS,
                                            stride_qt, stride_dot, stride_dqat,
                                            b, q_end, tq, off, qk_scale, o_d, m_d,
                                            BM, G, 1, USE_ACP, DOT_PREC, FUSE_DQ, BIAS, ROWS4, ns_m, ROW_BIAS,
                                            USE_TMA, tma_row, tma_col, ds_rows, USE_TMA_DS)
        tl.store(DCC + (i_bt * HQ + i_h) * TC + bos + o_n, b_dcc, mask=m_n)
    p_dk = DK + i_bt * stride_dkb + (bos + o_n[:, None]) * stride_dkt + i_hk * stride_dkh + o_d[None, :]
    p_dv = DV + i_bt * stride_dvb + (bos + o_n[:, None]) * stride_dvt + i_hk * stride_dvh + o_d[None, :]
    tl.store(p_dk, (b_dk * scale).to(DK.dtype.element_ty), mask=m_n[:, None] & m_d[None, :])
    tl.store(p_dv, b_dv.to(DV.dtype.element_ty), mask=m_n[:, None] & m_d[None, :])


@triton.jit
def _dq_from_ds_kernel(
    DS, K, BSTART, DQ, DCR,
    stride_kb, stride_kt, stride_kh, stride_qb, stride_qt, stride_qh,
    scale, TQ, TC, HQ, MB, DS_HEAD,
    D: tl.constexpr, BD: tl.constexpr, G: tl.constexpr,
    GROUP: tl.constexpr, USE_ACP: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # one program per (query block of G rows, batch x query head), the longest first:
    # dQ = scale * dS K over the block's kept key blocks, from the staircase the dK/dV
    # kernel wrote (FUSE_DQ 4; Tq = Tk, no packed sequences: key block kb's G rows hold
    # dS^T for the queries from kb G on), and each row's sum of the same 16-bit dS (the
    # dK/dV kernel's column sums add them too)
    i_m, i_bh = program_tile(True, False)
    if i_m * G >= TQ:
        return
    i_b = i_bh // HQ
    i_h = i_bh % HQ
    o_m = i_m * G + tl.arange(0, G)
    m_m = o_m < TQ
    o_g = tl.arange(0, G)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_ds = DS + i_bh * DS_HEAD
    p_k = K + i_b * stride_kb + (i_h // GROUP) * stride_kh
    lo = tl.load(BSTART + i_bh * MB + i_m) if USE_ACP else 0
    acc = tl.zeros([G, BD], dtype=tl.float32)
    # each row's sum of dS by the tensor cores: dS times a [G, 16] matrix of ones gives it in
    # all 16 columns (exact products, float32 sums), with no reduction across the warps
    acc_rs = tl.zeros([G, 16], dtype=tl.float32)
    ones = tl.full([G, 16], 1.0, dtype=DS.dtype.element_ty)
    for kb in range(lo, i_m + 1):
        kb64 = tl.full([], 0, tl.int64) + kb
        row_len = TQ - kb64 * G
        o_n = kb64 * G + o_g
        m_n = o_n < TQ
        p_t = p_ds + G * (kb64 * TQ - G * (kb64 * (kb64 - 1) // 2)) + o_g[:, None] * row_len \
            + (o_m - kb64 * G)[None, :]
        b_dst = tl.load(p_t, mask=m_n[:, None] & m_m[None, :], other=0.0)  # [keys, queries]
        b_k = tl.load(p_k + o_n[:, None] * stride_kt + o_d[None, :], mask=m_n[:, None] & m_d[None, :],
                      other=0.0)
        acc = tl.dot(tl.trans(b_dst), b_k, acc, input_precision=DOT_PREC)
        acc_rs = tl.dot(tl.trans(b_dst), ones, acc_rs, input_precision=DOT_PREC)
    b_rs = tl.sum(acc_rs, 1) / 16  # 16 equal float32 numbers: their mean, to an ulp
    p_dq = DQ + i_b * stride_qb + o_m[:, None] * stride_qt + i_h * stride_qh + o_d[None, :]
    tl.store(p_dq, (acc * scale).to(DQ.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
    tl.store(DCR + i_bh * TC + o_m, b_rs, mask=m_m)


@triton.jit
def _dq_inner(
    b_dq, b_dcr,
    b_q, b_do, b_lse, b_delta, b_cq, o_abs, b_kstart,
    p_k, p_v, p_chi, p_clo, c_ref,
    stride_kt, stride_vt,
    lo, hi, tk, qk_scale,
    o_d, m_d,
    BN: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr, BIAS: tl.constexpr = 1,
    PAIRS: tl.constexpr = False, STAGES: tl.constexpr = None, ROW_BIAS: tl.constexpr = False,
    USE_TMA: tl.constexpr = False, tma_row=0, tma_col=0,
):
    # ROW_BIAS: b_lse arrives less the query's c_i (b_cq unused): one multiply-add a pair;
    # USE_TMA: p_k, p_v are descriptors over [B * Tk, H * D] (keys past the sequence are
    # after every query: the causal mask drops them)
    for start in tl.range(lo, hi, BN, num_stages=STAGES):  # STAGES: None, the launch's
        o_n = start + tl.arange(0, BN)
        m_n = o_n < tk
        # [BD, BN]
        if USE_TMA:
            b_kt = tl.trans(p_k.load([tl.cast(tma_row + start, tl.int32), tma_col]))
            b_vt = tl.trans(p_v.load([tl.cast(tma_row + start, tl.int32), tma_col]))
        else:
            b_kt = tl.load(p_k + o_n[None, :] * stride_kt + o_d[:, None],
                           mask=m_d[:, None] & m_n[None, :], other=0.0)
            b_vt = tl.load(p_v + o_n[None, :] * stride_vt + o_d[:, None],
                           mask=m_d[:, None] & m_n[None, :], other=0.0)
        # [BM, BN]
        if ROW_BIAS and (BIAS == 1 or BIAS == 3):
            b_ck = key_bias(p_chi, p_clo, o_n, m_n, c_ref, PAIRS)
            b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale - b_ck[None, :]
        elif BIAS == 1 or BIAS == 3:  # the bias (3: without the gate sums)
            b_ck = key_bias(p_chi, p_clo, o_n, m_n, c_ref, PAIRS)
            b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale + (b_cq[:, None] - b_ck[None, :])
        else:  # no bias, as plain causal softmax attention: a timing diagnostic only (BIAS 0, 2)
            b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale
        if MASKED:
            keep = (o_n[None, :] <= o_abs[:, None]) & (o_n[None, :] >= b_kstart[:, None])
            b_s = tl.where(keep, b_s, float("-inf"))
        b_p = tl.math.exp2(b_s - b_lse[:, None])
        b_dp = tl.dot(b_do, b_vt, input_precision=DOT_PREC)
        b_ds = b_p * (b_dp - b_delta[:, None])
        if BIAS == 1 or BIAS == 2:  # the gate sums (2: without the bias)
            b_dcr += tl.sum(b_ds, 1)
        b_dq = tl.dot(b_ds.to(b_kt.dtype), tl.trans(b_kt), b_dq, input_precision=DOT_PREC)
    return b_dq, b_dcr


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DLSE, ROWS, CHI, CLO, BSTART, CU, DQ, DCR,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh,
    qk_scale, scale, TQ, TK, TC, TQD, HQ, GROUP, MB,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    G: tl.constexpr, IS_VARLEN: tl.constexpr, USE_ACP: tl.constexpr, DOT_PREC: tl.constexpr,
    BIAS: tl.constexpr = 1, PAIRS: tl.constexpr = False, MAKE_ROWS: tl.constexpr = False,
    HAS_DLSE: tl.constexpr = False, LOOPS: tl.constexpr = 0, ROW_BIAS: tl.constexpr = False,
    USE_TMA: tl.constexpr = False, HEADS_FIRST: tl.constexpr = False, ROUTE: tl.constexpr = 0,
):
    # the last query tiles have the most keys: schedule them first to shorten the tail
    i_m, i_bh = program_tile(True, HEADS_FIRST)
    i_b = i_bh // HQ
    i_h = i_bh % HQ
    i_hk = i_h // GROUP
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
    if i_m * BM >= tq:
        return
    if ROUTE:  # (as the dK/dV kernel's, by query head)
        if keeps_every_key(BSTART, i_bh, MB, tq, G) != (ROUTE == 1):
            return
    off = tk - tq
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < tq
    o_abs = o_m + off
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_md = m_m[:, None] & m_d[None, :]
    b_q = tl.load(Q + i_bt * stride_qb + (bos + o_m[:, None]) * stride_qt + i_h * stride_qh
                  + o_d[None, :], mask=m_md, other=0.0)
    b_do = tl.load(DO + i_bt * stride_dob + (bos + o_m[:, None]) * stride_dot + i_h * stride_doh
                   + o_d[None, :], mask=m_md, other=0.0)
    p_row = (i_bt * HQ + i_h) * TC + bos
    p_chi = CHI + p_row
    p_clo = CLO + p_row * (2 if PAIRS else 1)  # PAIRS: (c_hi, c_lo) side by side
    first_abs = i_m * BM + off
    last_abs = tl.minimum(i_m * BM + BM, tq) - 1 + off
    c_ref = tl.load(p_chi + first_abs)
    o_absc = tl.minimum(o_abs, tk - 1)
    b_chiq = tl.load(p_chi + o_absc)
    b_cq = (b_chiq - c_ref) * LOG2E_TL  # c_lo: in the lse (_query_rows)
    if MAKE_ROWS:  # this kernel runs first and makes the rows the dK/dV kernel reads
        b_o = tl.load(O + i_bt * stride_ob + (bos + o_m[:, None]) * stride_ot + i_h * stride_oh
                      + o_d[None, :], mask=m_md, other=0.0)
        b_clo = tl.load(p_clo + (o_absc * 2 + 1 if PAIRS else o_absc))
        b_lse, b_delta = _query_rows(b_o, b_do, LSE + p_row, DLSE + (i_bt * HQ + i_h) * TQD + bos,
                                     ROWS + p_row * 4, b_chiq, b_clo, o_m, m_m, HAS_DLSE)
    else:  # from the rows _rows_kernel made
        b_lse = tl.load(ROWS + (p_row + o_m) * 4, mask=m_m, other=0.0)
        b_delta = tl.load(ROWS + (p_row + o_m) * 4 + 1, mask=m_m, other=0.0)
    b_lsek = b_lse
    if ROW_BIAS and (BIAS == 1 or BIAS == 3):  # the query's c_i joins its lse (_dq_inner)
        b_lsek = b_lse - b_cq
    if USE_ACP:
        p_bs = BSTART + (i_b * HQ + i_h) * MB
        b_kstart = tl.load(p_bs + o_m // G, mask=m_m, other=0) * G
        ks_lo = tl.load(p_bs + (i_m * BM) // G) * G
        ks_hi = tl.load(p_bs + (tl.minimum(i_m * BM + BM, tq) - 1) // G) * G
    else:
        b_kstart = tl.zeros([BM], dtype=tl.int32)
        ks_lo = 0
        ks_hi = 0
    diag = ((first_abs + 1) // BN) * BN
    mid = tl.maximum(diag, ks_hi)
    if USE_TMA:  # descriptors made on the host (launch_bwd)
        p_k = K
        p_v = V
    else:
        p_k = K + i_bt * stride_kb + bos * stride_kt + i_hk * stride_kh
        p_v = V + i_bt * stride_vb + bos * stride_vt + i_hk * stride_vh
    tma_row = tl.cast(i_bt * TK + bos, tl.int32)
    tma_col = tl.cast(i_hk * D, tl.int32)
    b_dq = tl.zeros([BM, BD], dtype=tl.float32)
    b_dcr = tl.zeros([BM], dtype=tl.float32)
    ns_m: tl.constexpr = 1 if LOOPS >= 2 else None  # LOOPS: as in the dK/dV kernel
    run_edge, run_mid, run_diag = loop_runs(ks_lo, ks_hi, mid, last_abs + 1, LOOPS)
    if run_edge:
        b_dq, b_dcr = _dq_inner(b_dq, b_dcr, b_q, b_do, b_lsek, b_delta, b_cq, o_abs, b_kstart, p_k, p_v,
                                p_chi, p_clo, c_ref, stride_kt, stride_vt, ks_lo, ks_hi, tk, qk_scale,
                                o_d, m_d, BN, True, DOT_PREC, BIAS, PAIRS, ns_m, ROW_BIAS,
                                USE_TMA, tma_row, tma_col)
    if run_mid:
        b_dq, b_dcr = _dq_inner(b_dq, b_dcr, b_q, b_do, b_lsek, b_delta, b_cq, o_abs, b_kstart, p_k, p_v,
                                p_chi, p_clo, c_ref, stride_kt, stride_vt, ks_hi, mid, tk, qk_scale,
                                o_d, m_d, BN, False, DOT_PREC, BIAS, PAIRS, None, ROW_BIAS,
                                USE_TMA, tma_row, tma_col)
    if run_diag:
        b_dq, b_dcr = _dq_inner(b_dq, b_dcr, b_q, b_do, b_lsek, b_delta, b_cq, o_abs, b_kstart, p_k, p_v,
                                p_chi, p_clo, c_ref, stride_kt, stride_vt, mid, last_abs + 1, tk,
                                qk_scale, o_d, m_d, BN, True, DOT_PREC, BIAS, PAIRS, ns_m, ROW_BIAS,
                                USE_TMA, tma_row, tma_col)
    p_dq = DQ + i_bt * stride_dqb + (bos + o_m[:, None]) * stride_dqt + i_h * stride_dqh + o_d[None, :]
    tl.store(p_dq, (b_dq * scale).to(DQ.dtype.element_ty), mask=m_md)
    tl.store(DCR + p_row + o_m, b_dcr, mask=m_m)


def bwd_config(d: int, group: int = 1, acp: bool = False, tk: int = 0) -> tuple[dict, dict]:
    """(dK/dV config, dQ config). dK/dV: BM divides ACP_BLOCK; dQ: BN divides it; ``tk`` the
    key length (D 128 with ACP: ``ROUTE`` from ``LONG_ACP_KEYS`` keys on).

    The figures below are the backward kernels on the benchmark's shapes (bf16, B x T = 32k, 24
    heads at D 64, 12 at D 128, the tuning workload or the bench's own as the text says), ms at
    T 4k / 16k unless it says otherwise, against the option it replaced. ``lapse bench
    attention --sweep bwd`` times the tile options against this table.

    The tiles come from a sweep on an H100 at T 16384, dense and ACP. With grouped-query heads
    (the dK/dV kernel loops over the group) 128-key tiles were 4% faster dense (24 query heads
    over 6; forward+backward 1.22x -> 1.18x SDPA FlashAttention-2) but with ACP the coarser
    tiles skip less (efficiency 0.86 -> 0.80), so ACP keeps 64.

    ``ROWS4`` (the dK/dV kernel's per-row inputs in one load) on an H200: the backward at D 64,
    4.621 / 16.851 ms against 4.974 / 17.966 for three loads (D 128: 3.645 / 13.148 against
    3.727 / 13.470). ``PAIRS`` in the dQ kernel: D 64 4.425 / 16.243 against 4.589 / 16.669;
    at D 128 it loses (3.655 / 13.494 against 3.612 / 13.112).

    ``MAKE_ROWS`` (the dQ kernel runs first and makes each query's delta and lse, instead of
    a launch of their own; H200): D 64 dense 4.375 / 16.071 against 4.423 / 16.112, ACP 2.068
    / 5.841 against 2.122 / 5.901; D 128 dense 3.606 / 13.204 against 3.693 / 13.227, ACP 1.860
    / 5.269 against 1.915 / 5.789.

    ``maxnreg=168`` for the dK/dV kernel at D 64 (it needs 196 registers a thread, so two
    programs of 4 warps share a multiprocessor; capped, three do): the backward at T 4k,
    D 64, 4.175 ms against 4.407 dense, and with ACP 0.665 / 0.971 / 2.114 against 0.722 /
    1.054 / 2.296 where every head's constant gate keeps a band of 1, 4 and 16 blocks a row
    (H200). At D 128 the cap spills: 6.505 against 3.631 ms.

    ``LOOPS=1`` (a loop with no step not entered) with ACP at D 64: 0.634 / 0.945 / 2.134
    against 0.662 / 0.967 / 2.160 ms at T 4k and bands of 1, 4 and 16 blocks; dense it loses
    (4.244 against 4.199).

    ``ROW_BIAS`` (16-bit inputs, dropped for float32 by :func:`launch_bwd`: the query's c_i
    joins its lse, so a pair's logit is one multiply-add and one add), on an H200, two runs
    each: dense in both kernels, D 64 3.983 / 14.775 and 4.017 / 14.676 against 4.118 / 15.213
    and 4.147 / 15.223, D 128 3.512 / 12.789 and 3.533 / 12.862 against 3.571 / 13.089 and
    3.602 / 13.079 (in one kernel alone it gained less or lost: 15.4-15.5 at D 64, 16k, dK/dV
    only); with ACP in the dK/dV kernel only, D 64 1.838 / 5.288 and 1.844 / 5.314 against
    1.868 / 5.420 and 1.912 / 5.334, D 128 1.774 / 5.024 and 1.768 / 4.943 against 1.836 /
    5.115 and 1.842 / 5.116 (in both kernels D 64 16k lost: 5.443, 5.467). Grouped-query
    heads: below.

    ``TMA="host"`` (the loops' tiles through tensor descriptors made on the host) in both
    kernels, on an H200, two runs each, against the tables above: D 64, with the dQ kernel
    capped at 168 registers (it needs 176 with descriptors, 234 without: three programs a
    multiprocessor), dense 3.567 / 13.693 and 3.619 / 13.635 against 4.011 / 14.808 and 4.047
    / 14.826, ACP 1.643 / 4.849 and 1.678 / 4.761 against 1.836 / 5.330 and 1.842 / 5.311
    (without the cap 0.93-0.95 of the default); D 128 dense 3.170 / 11.701 and 3.253 / 11.891
    against 3.518 / 12.796 and 3.530 / 12.775, ACP 1.663 / 4.613 and 1.678 / 4.620 against
    1.764 / 4.940 and 1.769 / 4.922 (with the cap it loses: 2.18 / 5.76 with ACP).

    With grouped-query heads (24 query heads over 6 at D 64, 12 over 3 at D 128; H200),
    descriptors and ``ROW_BIAS`` in both kernels, dense and ACP: D 64 dense 4.067 / 14.652
    against 4.566 / 16.458, ACP 1.934 / 5.319 against 2.150 / 5.879 (descriptors with the dQ
    kernel capped instead: 4.078 / 14.752, 1.908 / 5.368); D 128 dense 3.292 / 11.726 against
    3.947 / 13.630, ACP 1.812 / 4.820 against 2.127 / 5.655.

    With the descriptors, ``PAIRS`` in the dQ kernel at D 128 pays with ACP (two runs): 0.932 /
    0.987 and 0.971 / 0.984 of the backward's time; dense it does not (0.983 / 1.002 and 1.068
    / 1.012). ``HEADS_FIRST`` (every head's first tile before any head's second) loses in both
    kernels: 1.01-1.13x the backward's time, but D 64 ACP at 16k 0.986 and 0.998 (a tie).

    At D 128 the dK/dV kernel keeps dS for a dQ kernel of one product a tile
    (``FUSE_DQ="ds"``; dS of all heads at once; H200), against the two kernels: dense 2.801 /
    10.250 against 3.169 / 11.634, ACP 1.474 / 4.173 against 1.616 / 4.437; grouped-query
    (12 query heads over 3) dense 2.973 / 10.260 against 3.301 / 11.516, ACP 1.736 / 4.501
    against 1.818 / 4.734. At D 64 it does not pay (dense 3.686 / 13.539 against 3.577 /
    13.357; ACP a tie). A few heads at a time (2 GiB chunks) it lost at 16k with ACP (4.734)
    and with grouped heads (16.391; dense without them 11.306, a 3% gain), so where dS would
    pass its budget the two kernels run. Measured at D 128 only: other head dims up to 128
    keep the two kernels.

    ``LOOPS=1`` in both D 128 ACP kernels (H100, the bench's workload, two runs), the backward
    kernels, ms: T 4k 2.721 against 2.920 and 2.862 against 2.872, 8k 4.372 against 4.465 and
    4.553 against 5.053, 16k 7.646 against 7.877; gradients equal bit for bit. Every
    comparison favours it, by 0.3-10%, in timings whose default moved 13% between the runs
    (8k), so the size of the gain is not pinned down.

    ``ROUTE`` in the dK/dV config (:func:`launch_bwd`: the key heads whose query heads ACP
    prunes nowhere through the dense tables' tiles without ACP, the query heads likewise in
    the dQ kernel), on an H200, the bench's workload (30% of the heads global), the backward
    kernels, ms at T 4k / 8k / 16k against one launch each: D 128 2.749 / 4.265 / 7.215
    against 2.711 / 4.338 / 7.596; D 64 1.749 / 2.873 / 4.907 against 1.688 / 2.813 / 4.935.
    So D 128 from ``LONG_ACP_KEYS`` keys on, without grouped heads (not measured with them: a
    key head goes dense only where all its query heads would).

    The D 64 dK/dV kernel takes 64 queries a step (H100). Capped at 168 registers it spills
    588 B a thread on the sm_90 compile and is still the fastest option; its gradients equal
    the 32-query steps' bit for bit. The backward, ms at T 4k / 8k / 16k, against 32 queries a
    step timed first and last: dense 3.255 / 6.178 / 12.007 against 3.572-3.619 / 6.860-6.958
    / 13.162-13.484; ACP 1.514 / 2.584 / 4.374 against 1.667-1.693 / 2.684-2.749 /
    4.749-5.066. Without the cap (254 registers, no spills) 3.344 / 6.177 / 13.857 and 1.600 /
    2.671 / 4.512; 8 warps 1.6-1.7x slower.
    """
    if d <= 64:
        if group > 1 and not acp:
            kv = dict(BM=32, BN=128, num_warps=4, num_stages=3, ROWS4=True, TMA="host", ROW_BIAS=True)
        else:  # 64 queries a step; at most 168 registers a thread: three programs a multiprocessor
            kv = dict(BM=64, BN=64, num_warps=4, num_stages=3, ROWS4=True, maxnreg=168, TMA="host",
                      ROW_BIAS=True)
        q = dict(BM=64, BN=64, num_warps=4, num_stages=3, PAIRS=True, MAKE_ROWS=True, TMA="host")
        if group == 1:  # with 176 registers a thread, two programs a multiprocessor; capped, three
            q = dict(q, maxnreg=168, ROW_BIAS=not acp)
        else:
            q = dict(q, ROW_BIAS=True)
        if acp:  # empty loops not entered
            kv, q = dict(kv, LOOPS=1), dict(q, LOOPS=1)
        return kv, q
    if d <= 128:  # D 128: dS kept where it fits (FUSE_DQ="ds"; else the dQ kernel below)
        route = {"ROUTE": 1} if acp and d == 128 and group == 1 and tk >= triton_fwd.LONG_ACP_KEYS else {}
        loops = {"LOOPS": 1} if acp else {}  # empty loops not entered
        return (dict(BM=32, BN=64, num_warps=4, num_stages=3, ROWS4=True, TMA="host", ROW_BIAS=True,
                     FUSE_DQ="ds" if d == 128 else False, **route, **loops),
                dict(BM=64, BN=64, num_warps=4, num_stages=2, PAIRS=acp and group == 1, MAKE_ROWS=True,
                     TMA="host", ROW_BIAS=group > 1 or not acp, **loops))
    return (dict(BM=16, BN=32, num_warps=4, num_stages=1),
            dict(BM=32, BN=16, num_warps=4, num_stages=1, MAKE_ROWS=True))




def _scratch(n: int, dtype, device, poison: bool):
    """An uninitialised buffer of ``n`` elements; with ``poison`` (the tests' poisoned
    outputs, ``triton_ops.POISON_OUTPUTS``) NaN, so that a slot read before any kernel wrote it
    shows in the result."""
    return torch.full((n,), float("nan"), dtype=dtype, device=device) if poison else \
        torch.empty(n, dtype=dtype, device=device)


def launch_bwd(q, k, v, o, do, lse2, dlse, c_hi, c_lo, block_start, block_end, cu, p,
               dq, dk, dv, dcc, dcr, configs=None, poison=False):
    """Runs the backward kernels; dk/dv/dq in the inputs' dtypes, dcc/dcr float32 [B, HQ, Tc].

    ``o`` and the base-2 ``lse2`` ``[B, HQ, Tc]`` are the forward's; ``dlse`` ``[B, HQ, Tq]``
    (or None) a gradient of the natural-log lse it returned. Each query's backward inputs
    (:func:`_query_rows`) are made by the dQ kernel, which then runs first (``MAKE_ROWS``
    in the dQ config), or else by one launch of ``_rows_kernel`` before the others.
    ``FUSE_DQ=True`` in the dK/dV config: one kernel, dQ through atomics (module doc).
    ``TMA="host"`` in either config: the loop's tiles (queries and output gradients for the
    dK/dV kernel, keys and values for the dQ kernel) through tensor descriptors made here over
    ``[B * T, H * D]`` views, where :func:`_host_tma` holds (else pointer loads).
    ``BIAS`` in either config is a timing diagnostic (what the gate costs), never
    for results: 1 (default) the FoX backward, 0 plain softmax attention's (no bias, no
    gate sums), 2 the gate sums without the bias, 3 the bias without the gate sums.
    ``poison``: scratch buffers NaN-filled (the tests' poisoned outputs)."""
    use_acp = block_start is not None
    run = _BwdRun.of(*(configs or bwd_config(p.d, p.hq // p.h, use_acp, p.tk)), q, k, v, do, p)
    runs = [run]
    if use_acp and run.route and p.batch * p.hq * p.tq >= triton_fwd.ROUTE_MIN_ROWS:
        # the kv heads (dK/dV) and query heads (dQ) that ACP prunes nowhere take the dense
        # tables' tiles without ACP (one launch each), the others the ACP tables' (a second):
        # where both tables keep dS or both do not, and make the rows the same way
        dense = _BwdRun.of(*bwd_config(p.d, p.hq // p.h, False, p.tk), q, k, v, do, p)
        if (dense.fuse, dense.make_rows) == (run.fuse, run.make_rows) and run.fuse in (0, 4):
            runs = [dense._replace(route=1), run._replace(route=2)]
        else:
            runs = [run._replace(route=0)]
    else:
        runs = [run._replace(route=0)]
    fuse, make_rows = run.fuse, run.make_rows
    bd = max(16, triton.next_power_of_2(p.d))
    dummy = c_hi
    varlen = cu is not None
    common = dict(D=p.d, BD=bd, G=64, IS_VARLEN=varlen, USE_ACP=use_acp,
                  DOT_PREC="ieee" if q.dtype.itemsize == 4 else "tf32")
    tc = c_hi.shape[-1]
    rows = torch.empty(*lse2.shape, 4, dtype=torch.float32, device=lse2.device)
    dl = dlse.float().contiguous() if dlse is not None else dummy
    launches_q = [_dq_launcher(q, k, v, o, do, lse2, dl, rows, c_hi, c_lo, block_start, cu, p, dq, dcr,
                               cfg_q, dict(common, USE_ACP=use_acp and route != 1),
                               dict(MAKE_ROWS=make_rows, HAS_DLSE=dlse is not None, USE_TMA=tma_q,
                                    **({"ROUTE": route} if route else {})))
                  for cfg_q, tma_q, route in ((r.q, r.tma_q, r.route) for r in runs)]
    if make_rows:
        for launch_q in launches_q:
            launch_q()
    else:
        bt = max(16, 4096 // bd)
        _rows_kernel[(triton.cdiv(p.tq, bt), p.batch * p.hq)](
            o, do, lse2, dl, c_hi, c_lo, rows, cu if varlen else dummy,
            o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
            p.tq, p.tk, tc, q.shape[1], p.hq, D=p.d, BD=bd, BT=bt, IS_VARLEN=varlen,
            HAS_DLSE=dlse is not None,
        )
    ds_strides = (0, 0, 0)
    if fuse == 4:  # dS kept: each head's staircase of key blocks
        ds_head = _ds_head(p)
        dqa = _scratch(p.batch * p.hq * ds_head, q.dtype, q.device, poison)
        ds_strides = (ds_head, 0, 0)
    elif fuse:
        dqa = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dcr.zero_()
    else:
        dqa = dummy
    for r in runs:
        cfg_kv, ds_tma, tma_kv, route = dict(r.kv), r.ds_tma, r.tma_kv, r.route
        bm, bn = cfg_kv.pop("BM"), cfg_kv.pop("BN")
        dqa_arg = head_rows_descriptor(dqa, bm, bd) if fuse == 2 else dqa
        qa, doa = (head_rows_descriptor(q, bm, bd), head_rows_descriptor(do, bm, bd)) if tma_kv else (q, do)
        if route:
            cfg_kv["ROUTE"] = route
        grid = tile_grid(triton.cdiv(p.tk, bn), p.batch * p.h, cfg_kv.get("HEADS_FIRST", False))
        with device_descriptors(ds_tma and q.is_cuda):  # the kept dS's, made by the programs
            _bwd_dkdv_kernel[grid](
                qa, k, v, doa, rows, c_hi, c_lo,
                block_start if use_acp else dummy, block_end if use_acp else dummy,
                cu if varlen else dummy, dk, dv, dcc, dqa_arg, dcr,
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                do.stride(0), do.stride(1), do.stride(2),
                dk.stride(0), dk.stride(1), dk.stride(2),
                dv.stride(0), dv.stride(1), dv.stride(2),
                *(dqa.stride()[:3] if fuse in (1, 2, 3) else ds_strides),
                p.scale * LOG2E, p.scale, p.tq, p.tk, tc, p.hq, p.h,
                block_start.shape[-1] if use_acp else 1, block_end.shape[-1] if use_acp else 1,
                q.shape[0] * q.shape[1],
                BM=bm, BN=bn, GROUP=p.hq // p.h, FUSE_DQ=fuse, USE_TMA=tma_kv, USE_TMA_DS=ds_tma,
                **dict(common, USE_ACP=use_acp and route != 1), **cfg_kv,
            )
    if fuse == 4:  # (routed or not, every head's kept blocks are written: one launch)
        _dq_from_ds_kernel[tile_grid(triton.cdiv(p.tq, 64), p.batch * p.hq, False)](
            dqa, k, block_start if use_acp else dummy, dq, dcr,
            k.stride(0), k.stride(1), k.stride(2), dq.stride(0), dq.stride(1), dq.stride(2),
            p.scale, p.tq, tc, p.hq, block_start.shape[-1] if use_acp else 1, ds_head,
            D=p.d, BD=bd, G=64, GROUP=p.hq // p.h, USE_ACP=use_acp,
            DOT_PREC=common["DOT_PREC"], num_warps=4, num_stages=3,
        )
    elif fuse:
        dq.copy_(dqa.mul_(p.scale))
    elif not make_rows:
        for launch_q in launches_q:
            launch_q()


class _BwdRun(NamedTuple):
    """One pair of configs as :func:`launch_bwd` runs it, the decided keys taken out of the
    options."""

    kv: dict  # the dK/dV kernel's remaining options
    q: dict  # the dQ kernel's
    fuse: int  # FUSE_DQ's mode (_fuse_mode)
    make_rows: bool  # the dQ kernel runs first and makes the rows
    ds_tma: bool  # kept dS stored through descriptors
    tma_kv: bool  # the dK/dV kernel's tiles through host descriptors
    tma_q: bool  # the dQ kernel's
    route: int  # ROUTE: asked by the config; then 0 one launch, 1 the dense launch, 2 the ACP one

    @classmethod
    def of(cls, cfg_kv, cfg_q, q, k, v, do, p) -> _BwdRun:
        cfg_kv, cfg_q = dict(cfg_kv), dict(cfg_q)
        if q.element_size() == 4:  # float32 keeps the exact order of the bias's terms
            cfg_kv.pop("ROW_BIAS", None)
            cfg_q.pop("ROW_BIAS", None)
        route = int(bool(cfg_kv.pop("ROUTE", False)))
        fuse = _fuse_mode(cfg_kv.pop("FUSE_DQ", False), q, p, cfg_kv)
        cfg_kv.pop("DS_MAX_BYTES", None)
        # kept dS stored through descriptors (DS_TMA, default): rows 16-byte aligned, Hopper or later
        ds_tma = (fuse == 4 and cfg_kv.pop("DS_TMA", True) and p.tq * q.element_size() % 16 == 0
                  and tma_device(q))
        cfg_kv.pop("DS_TMA", None)
        tma_kv, tma_q = (cfg.pop("TMA", False) == "host" and _host_tma(q, k, v, do, p)
                         for cfg in (cfg_kv, cfg_q))
        make_rows = bool(cfg_q.pop("MAKE_ROWS", False)) and not fuse
        return cls(cfg_kv, cfg_q, fuse, make_rows, bool(ds_tma), tma_kv, tma_q, route)


def _host_tma(q, k, v, do, p) -> bool:
    """Whether ``TMA="host"`` serves: the forward's conditions for descriptors made on the host
    (:func:`triton_fwd.tma_mode`), and ``do`` contiguous too."""
    return tma_mode("host", q, k, v, p) == 2 and do.is_contiguous() and tma_ready(do)


# FUSE_DQ="ds": kept dS at most this share of the GPU's memory (at 1/8 the bench's D 128, T 16k
# dS, 12.9 GB, missed an 80 GB H100's budget and its backward took the two kernels, 28.50
# against 26.35 ms forward+backward), and at most this share of what is free at the call (the
# driver's free memory and the allocator's cache); while a CUDA graph is captured, which cannot
# ask what is free and whose pool keeps the scratch for the graph's life, at most
# DS_MAX_CAPTURED of the GPU's memory
DS_MAX_FRACTION = 1 / 4
DS_MAX_FREE = 1 / 2
DS_MAX_CAPTURED = 1 / 8


def _ds_budget(device) -> int:
    """The most bytes of kept dS a backward may take: ``DS_MAX_FRACTION`` of the GPU's memory
    and ``DS_MAX_FREE`` of what is free now, so a run near its memory limit takes the two
    kernels (dS for all heads at once: taken a few heads at a time, the launches' tails made
    it slower than the two kernels at 16k, :func:`bwd_config`). While a CUDA
    graph is captured, ``DS_MAX_CAPTURED`` of the GPU's memory and no more."""
    if device.type != "cuda":
        return 2**40
    total = torch.cuda.get_device_properties(device).total_memory
    if torch.cuda.is_current_stream_capturing():
        return int(total * DS_MAX_CAPTURED)
    free = torch.cuda.mem_get_info(device)[0]
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(min(total * DS_MAX_FRACTION, (free + cached) * DS_MAX_FREE))


def _ds_head(p) -> int:
    """Elements of one head's kept dS: key block kb's 64 rows over the queries from 64 kb on."""
    nkb = triton.cdiv(p.tk, 64)
    return 64 * (nkb * p.tq - 64 * nkb * (nkb - 1) // 2)


def _fuse_mode(fuse, q, p, cfg_kv=None) -> int:
    """The dK/dV config's ``FUSE_DQ``: 0 two kernels; 1 (``True``) one, dQ added a thread an
    element; 2 (``"tma"``) one, each tile's dQ added in one bulk operation by the
    tensor-memory engine (Hopper or later, D a power of two, ``q`` contiguous; else 1, and
    3 on the CPU: the interpreter's stand-in, the same rows added by pointers); 4 (``"ds"``)
    the dK/dV kernel keeps dS (16-bit, each key block's rows over the queries from it on)
    and the row sums of its key tiles, and ``_dq_from_ds_kernel`` makes dQ from them: one
    product a tile instead of the dQ kernel's three. 4 needs ``Tq = Tk``, no packed
    sequences, key tiles of 64 with query steps dividing 64, and dS within the config's
    ``DS_MAX_BYTES`` (default :func:`_ds_budget`); else 0."""
    if fuse == "ds":
        cfg_kv = cfg_kv or {}
        bm = cfg_kv.get("BM", 0)
        serves = p.cu_seqlens is None and p.tq == p.tk and cfg_kv.get("BN") == 64 and bm > 0 and 64 % bm == 0
        budget = cfg_kv.get("DS_MAX_BYTES") or _ds_budget(q.device)
        return 4 if serves and p.batch * p.hq * _ds_head(p) * q.element_size() <= budget else 0
    if fuse != "tma":
        return int(bool(fuse))
    if not (p.d == max(16, triton.next_power_of_2(p.d)) and q.is_contiguous() and tma_device(q)):
        return 1
    return 2 if q.is_cuda else 3  # the interpreter has no bulk adds: 3 adds the same rows by pointers


def _dq_launcher(q, k, v, o, do, lse2, dl, rows, c_hi, c_lo, block_start, cu, p, dq, dcr, cfg_q,
                 common, switches):
    """The dQ kernel's launch, as a function :func:`launch_bwd` calls first or last."""
    cfg_q = dict(cfg_q)
    bm, bn = cfg_q.pop("BM"), cfg_q.pop("BN")
    pairs = cfg_q.pop("PAIRS", False)
    use_acp = block_start is not None

    ka, va = k, v
    if switches.get("USE_TMA"):  # a block is BN keys of one head
        ka, va = head_rows_descriptor(k, bn, common["BD"]), head_rows_descriptor(v, bn, common["BD"])

    def launch():
        _bwd_dq_kernel[tile_grid(triton.cdiv(p.tq, bm), p.batch * p.hq, cfg_q.get("HEADS_FIRST", False))](
            q, ka, va, o, do, lse2, dl, rows, c_hi, torch.stack((c_hi, c_lo), -1) if pairs else c_lo,
            block_start if use_acp else c_hi, cu if cu is not None else c_hi, dq, dcr,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            do.stride(0), do.stride(1), do.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
            p.scale * LOG2E, p.scale, p.tq, p.tk, c_hi.shape[-1], q.shape[1], p.hq,
            p.hq // p.h, block_start.shape[-1] if use_acp else 1, BM=bm, BN=bn, PAIRS=pairs,
            **switches, **common, **cfg_q,
        )

    return launch
