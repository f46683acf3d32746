"""Fused forward kernel of forgetting attention with ACP (SPEC sections 1 and 3).

One program per (query tile, batch x query head). The key range of a query tile is cut
into three loops so the hot loop carries no mask:

    [ks_lo, mid)          ACP edge: rows of the tile start at different keys
    [mid, diag)           interior: every pair kept and causal, no mask
    [diag, last + 1)      diagonal: causal mask (and ACP's)

``ks_lo``/``ks_hi`` are the first kept keys of the tile's first and last row (multiples
of ACP_BLOCK; 0 without ACP), ``diag`` the first key tile past the tile's first row and
``mid = min(ks_hi, diag)``. Keys before ``ks_lo`` are pruned tiles: never loaded. A key
tile divides the ACP block, so ACP keeps or prunes it whole for each row: its mask is the
row's bias set to -inf, with no compare a pair; only the diagonal compares pairs.

The bias ``c_i - c_j`` comes from the float64 cumulative gate split into float32
``hi + lo``: ``((hi_i - ref) + lo_i) - ((hi_j - ref) + lo_j)`` with ``ref`` the ``hi`` of
the tile's first query is exact where it matters (nearby values subtract exactly), so
long contexts do not lose the bias to cancellation. Its limit: a gate far below 0 inside a
tile makes ``hi_i - ref`` large for the rows after it, and their biases are rounded at that
scale (float32: 6.9e-5 output error with one ``-inf`` gate, floored at ``LOG_GATE_FLOOR``;
5e-3 with a hundred gates of -999; README, "The op"). Everything runs in base 2.

Two options of the tables (16-bit inputs; :func:`fwd_config` has the measurements):
``ROW_BIAS`` leaves the query's own ``c_i`` out of the loops' logits (a per-row constant;
the lse adds it back), and ``FIXED_MAX`` runs the diagonal loop first and takes its row
maximum as the reference of every other key: a row's own key has bias 0 and every other
key at most 0, so the other loops need no online maximum and no rescaling. A tile whose
weights overflow that reference (a logit ~127 above it, base 2) is done again the usual way.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..backend import LOG2E, LOG2E_TL, cuda_capability, tma_ready


@triton.jit
def key_bias(p_chi, p_clo, o_n, m_n, c_ref, PAIRS: tl.constexpr):
    """``c_j - c_ref`` in base 2 for the keys ``o_n``: from ``c_hi`` and ``c_lo`` (two loads),
    or with ``PAIRS`` from ``(c_hi, c_lo)`` side by side at ``p_clo`` (one 8-byte load a key:
    each small load a loop pipelines costs a buffer, a copy and a wait per step)."""
    if PAIRS:
        o_2 = tl.arange(0, 2)[None, :]
        b_c = tl.load(p_clo + o_n[:, None] * 2 + o_2, mask=m_n[:, None], other=0.0)
        b_hi = tl.sum(tl.where(o_2 == 0, b_c, 0.0), 1)
        b_lo = tl.sum(tl.where(o_2 == 1, b_c, 0.0), 1)
    else:
        b_hi = tl.load(p_chi + o_n, mask=m_n, other=0.0)
        b_lo = tl.load(p_clo + o_n, mask=m_n, other=0.0)
    return ((b_hi - c_ref) + b_lo) * LOG2E_TL


@triton.jit
def program_tile(LONGEST_LAST: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """This program's ``(tile, batch x head)`` in a :func:`tile_grid`: with ``HEADS_FIRST``
    the grid's first axis runs over the heads, so every head's first tile is scheduled before
    any head's second (without it, a head's tiles in turn); with ``LONGEST_LAST`` the tiles are
    taken from the last (causal queries: the last tiles have the most keys)."""
    if HEADS_FIRST:
        i_t, n_t, i_bh = tl.program_id(1), tl.num_programs(1), tl.program_id(0)
    else:
        i_t, n_t, i_bh = tl.program_id(0), tl.num_programs(0), tl.program_id(1)
    if LONGEST_LAST:
        i_t = n_t - 1 - i_t
    return i_t.to(tl.int64), i_bh.to(tl.int64)


def tile_grid(tiles: int, heads: int, heads_first: bool) -> tuple[int, int]:
    """The launch grid that :func:`program_tile` reads."""
    return (heads, tiles) if heads_first else (tiles, heads)


@triton.jit
def keeps_every_key(BSTART, i_bh, MB, tq, G: tl.constexpr):
    """Whether ACP prunes nothing for (sequence x head) ``i_bh`` of ``tq`` queries: its last
    query block keeps every key. The boundary search's staircase never steps down along a
    sequence, so then no block prunes (``ROUTE``: which of two launches serves the head)."""
    return tl.load(BSTART + i_bh * MB + (tq - 1) // G) == 0


@triton.jit
def loop_runs(a, b, c, d, LOOPS: tl.constexpr):
    """Whether each of three consecutive loops ``[a, b)``, ``[b, c)``, ``[c, d)`` is entered:
    every one (``LOOPS`` even: the loops as they are), or those with a step (odd: a
    pipelined loop runs its peeled last steps, predicated off, even when it has none)."""
    if LOOPS % 2 == 1:
        return a < b, b < c, c < d
    else:
        return True, True, True


@triton.jit
def _fwd_inner(
    acc, l_i, m_i,
    b_q, b_cq, o_abs, b_kstart,
    p_k, p_v, p_chi, p_clo, c_ref,
    stride_kt, stride_vt,
    lo, hi, tk, qk_scale,
    o_d, m_d,
    BN: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
    BIAS: tl.constexpr = True, PAIRS: tl.constexpr = False, STAGES: tl.constexpr = None,
    kv_row=0, kv_col=0, ROW_BIAS: tl.constexpr = False, FIXED: tl.constexpr = False,
):
    # FIXED: m_i is final (finite; the kernel's FIXED_MAX): no row maximum, no rescaling
    # p_k, p_v: pointers to the (sequence, kv head)'s first key and value, or with USE_TMA
    # tensor descriptors whose block (kv_row + start, kv_col) is the keys from start on;
    # STAGES: this loop's software pipeline depth (None: the launch's)
    for start in tl.range(lo, hi, BN, num_stages=STAGES):
        o_n = start + tl.arange(0, BN)
        m_n = o_n < tk
        # [BD, BN]
        if USE_TMA:  # the tensor-memory engine: rows past the tensor and columns past D come as 0
            b_kt = tl.trans(p_k.load([tl.cast(kv_row + start, tl.int32), kv_col]))  # 32-bit offsets only
        else:
            b_kt = tl.load(p_k + o_n[None, :] * stride_kt + o_d[:, None],
                           mask=m_d[:, None] & m_n[None, :], other=0.0)
        # [BM, BN], base-2 logits
        # MASKED: with ACP a row whose first kept key is past this tile gets -inf through its
        # own bias (BN divides the ACP block: a tile is kept or pruned whole for each row, so
        # no pair needs a compare); MASKED 2, the diagonal, also the causal mask
        b_row = b_cq
        if MASKED and b_kstart is not None:
            b_row = tl.where(start >= b_kstart, b_cq, float("-inf"))
        if BIAS and ROW_BIAS and not (MASKED and b_kstart is not None):
            # the query's own c_i left out (a per-row constant: the lse takes it back), so
            # one multiply-add a pair makes the biased logit
            b_ck = key_bias(p_chi, p_clo, o_n, m_n, c_ref, PAIRS)
            b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale - b_ck[None, :]
        elif BIAS:  # (ROW_BIAS: b_cq is 0 here, so the row's term is its ACP mask alone)
            b_ck = key_bias(p_chi, p_clo, o_n, m_n, c_ref, PAIRS)
            b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale + (b_row[:, None] - b_ck[None, :])
        else:  # plain causal softmax attention: a timing diagnostic only (BIAS=False)
            b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale
            if MASKED and b_kstart is not None:
                b_s += (b_row - b_cq)[:, None]
        if MASKED == 2:  # 32-bit positions: a 64-bit compare takes two instructions a pair
            b_s = tl.where(o_n.to(tl.int32)[None, :] <= o_abs.to(tl.int32)[:, None], b_s, float("-inf"))
        if FIXED:
            b_p = tl.math.exp2(b_s - m_i[:, None])
            l_i += tl.sum(b_p, 1)
        else:
            if MASKED:
                m_new = tl.maximum(m_i, tl.max(b_s, 1))
                # a row with no kept key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_new = tl.maximum(m_i, tl.max(b_s, 1))
                m_use = m_new
            b_p = tl.math.exp2(b_s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(b_p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        # [BN, BD]
        if USE_TMA:
            b_v = p_v.load([tl.cast(kv_row + start, tl.int32), kv_col])
        else:
            b_v = tl.load(p_v + o_n[:, None] * stride_vt + o_d[None, :],
                          mask=m_n[:, None] & m_d[None, :], other=0.0)
        acc = tl.dot(b_p.to(b_v.dtype), b_v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, CHI, CLO, BSTART, O, LSE, CU,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    qk_scale, TQ, TK, TC, HQ, GROUP, MB,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    G: tl.constexpr, IS_VARLEN: tl.constexpr, USE_ACP: tl.constexpr, DOT_PREC: tl.constexpr,
    USE_TMA: tl.constexpr, BIAS: tl.constexpr = True, PAIRS: tl.constexpr = False,
    LOOPS: tl.constexpr = 0, ROW_BIAS: tl.constexpr = False, FIXED_MAX: tl.constexpr = False,
    HEADS_FIRST: tl.constexpr = False, ROUTE: tl.constexpr = 0, ONE_LOOP: tl.constexpr = False,
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
        i_bt = i_b * 0  # packed: tensors have batch 1
    else:
        bos = i_b * 0
        tq = TQ
        tk = TK
        i_bt = i_b
    if i_m * BM >= tq:
        return
    if ROUTE:  # one of two launches (launch_fwd's ROUTE): 1 serves the (sequence, head)s that
        # ACP prunes nowhere, 2 the others
        if keeps_every_key(BSTART, i_bh, MB, tq, G) != (ROUTE == 1):
            return
    off = tk - tq
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < tq
    o_abs = o_m + off
    o_d = tl.arange(0, BD)
    m_d = o_d < D

    if USE_TMA == 2:  # descriptors made on the host over [B * T, H * D] (launch_fwd): rows
        # past this tile's sequence belong to the next one; they are masked (the causal mask
        # for keys, the store's for queries)
        b_q = Q.load([tl.cast(i_bt * TQ + bos + i_m * BM, tl.int32), tl.cast(i_h * D, tl.int32)])
    else:
        p_q = Q + i_bt * stride_qb + (bos + o_m[:, None]) * stride_qt + i_h * stride_qh + o_d[None, :]
        b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)
    p_chi = CHI + (i_bt * HQ + i_h) * TC + bos
    p_clo = CLO + ((i_bt * HQ + i_h) * TC + bos) * (2 if PAIRS else 1)  # PAIRS: (c_hi, c_lo)
    first_abs = i_m * BM + off
    last_abs = tl.minimum(i_m * BM + BM, tq) - 1 + off
    c_ref = tl.load(p_chi + first_abs)
    o_absc = tl.minimum(o_abs, tk - 1)
    b_cq = ((tl.load(p_chi + o_absc) - c_ref)
            + tl.load(p_clo + (o_absc * 2 + 1 if PAIRS else o_absc))) * LOG2E_TL

    if USE_ACP:
        tl.static_assert(G % BN == 0, "with ACP a key tile divides the ACP block")
        p_bs = BSTART + (i_b * HQ + i_h) * MB
        b_kstart = tl.load(p_bs + o_m // G, mask=m_m, other=0) * G
        ks_lo = tl.load(p_bs + (i_m * BM) // G) * G
        ks_hi = tl.load(p_bs + (tl.minimum(i_m * BM + BM, tq) - 1) // G) * G
    else:
        b_kstart = None
        ks_lo = 0
        ks_hi = 0
    # keys before diag are at or before every row of the tile; from mid on every row keeps them
    diag = ((first_abs + 1) // BN) * BN
    mid = tl.minimum(ks_hi, diag) if USE_ACP else 0  # dense: no edge loop, even in the code

    kv_row = 0
    kv_col = 0
    if USE_TMA == 2:
        p_k = K
        p_v = V
        kv_row = tl.cast(i_bt * TK + bos, tl.int32)
        kv_col = tl.cast(i_hk * D, tl.int32)
    else:
        p_k = K + i_bt * stride_kb + bos * stride_kt + i_hk * stride_kh
        p_v = V + i_bt * stride_vb + bos * stride_vt + i_hk * stride_vh
    if USE_TMA == 1:  # this (sequence, kv head)'s keys and values as [tk, D] matrices
        p_k = tl.make_tensor_descriptor(p_k, shape=[tl.cast(tk, tl.int32), D], strides=[stride_kt, 1],
                                        block_shape=[BN, BD])
        p_v = tl.make_tensor_descriptor(p_v, shape=[tl.cast(tk, tl.int32), D], strides=[stride_vt, 1],
                                        block_shape=[BN, BD])
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    # LOOPS: 1, a loop with no step is not entered (a pipelined loop
    # runs its peeled last steps, predicated off, even then); 2, the masked loops (a step or
    # two) not pipelined; 3, both
    ns_m: tl.constexpr = 1 if LOOPS >= 2 else None
    run_edge, run_mid, run_diag = loop_runs(ks_lo, mid, diag, last_abs + 1, LOOPS)
    # ROW_BIAS: the loops' logits leave out the query's own c_i; the lse adds it at the end
    b_cl = tl.zeros_like(b_cq) if ROW_BIAS else b_cq
    if ONE_LOOP:  # one pipelined loop over every kept key, each tile masked (causal and ACP):
        # for short rows, one pipeline start instead of three
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, b_cl, o_abs, b_kstart, p_k, p_v, p_chi, p_clo,
                                   c_ref, stride_kt, stride_vt, ks_lo, last_abs + 1, tk, qk_scale, o_d, m_d,
                                   BN, 2, DOT_PREC, USE_TMA, BIAS, PAIRS, None, kv_row, kv_col, ROW_BIAS)
        redo = False
    elif FIXED_MAX:  # the diagonal keys first, with the online maximum; then their maximum, which
        # every row has (its own key, bias 0), is every other key's reference: no row maximum
        # and no rescaling there. A logit more than ~127 (base 2) above it overflows l or acc
        # to inf: the tile is done again the usual way (one branch a program)
        if run_diag:
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, b_cl, o_abs, b_kstart, p_k, p_v, p_chi, p_clo,
                                       c_ref, stride_kt, stride_vt, diag, last_abs + 1, tk, qk_scale, o_d,
                                       m_d, BN, 2, DOT_PREC, USE_TMA, BIAS, PAIRS, ns_m, kv_row, kv_col,
                                       ROW_BIAS)
        m_i = tl.where(m_i == float("-inf"), 0.0, m_i)
        if run_edge:
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, b_cl, o_abs, b_kstart, p_k, p_v, p_chi, p_clo,
                                       c_ref, stride_kt, stride_vt, ks_lo, mid, tk, qk_scale, o_d, m_d,
                                       BN, 1, DOT_PREC, USE_TMA, BIAS, PAIRS, ns_m, kv_row, kv_col, ROW_BIAS,
                                       True)
        if run_mid:
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, b_cl, o_abs, b_kstart, p_k, p_v, p_chi, p_clo,
                                       c_ref, stride_kt, stride_vt, mid, diag, tk, qk_scale, o_d, m_d,
                                       BN, 0, DOT_PREC, USE_TMA, BIAS, PAIRS, None, kv_row, kv_col, ROW_BIAS,
                                       True)
        finite = (l_i < float("inf")) & (tl.max(tl.abs(acc), 1) < float("inf"))  # NaN: False
        redo = tl.max(tl.where(m_m & ~finite, 1, 0), 0) > 0
    else:
        redo = True
    if redo:
        if FIXED_MAX:
            acc = tl.zeros([BM, BD], dtype=tl.float32)
            l_i = tl.zeros([BM], dtype=tl.float32)
            m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        if run_edge:
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, b_cl, o_abs, b_kstart, p_k, p_v, p_chi, p_clo,
                                       c_ref, stride_kt, stride_vt, ks_lo, mid, tk, qk_scale, o_d, m_d,
                                       BN, 1, DOT_PREC, USE_TMA, BIAS, PAIRS, ns_m, kv_row, kv_col, ROW_BIAS)
        if run_mid:
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, b_cl, o_abs, b_kstart, p_k, p_v, p_chi, p_clo,
                                       c_ref, stride_kt, stride_vt, mid, diag, tk, qk_scale, o_d, m_d,
                                       BN, 0, DOT_PREC, USE_TMA, BIAS, PAIRS, None, kv_row, kv_col, ROW_BIAS)
        if run_diag:
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, b_cl, o_abs, b_kstart, p_k, p_v, p_chi, p_clo,
                                       c_ref, stride_kt, stride_vt, diag, last_abs + 1, tk, qk_scale, o_d,
                                       m_d, BN, 2, DOT_PREC, USE_TMA, BIAS, PAIRS, ns_m, kv_row, kv_col,
                                       ROW_BIAS)
    # every valid row has its own key (D_ii = 0), so l_i > 0 there
    l_safe = tl.where(m_m, l_i, 1.0)
    b_o = acc / l_safe[:, None]
    p_o = O + i_bt * stride_ob + (bos + o_m[:, None]) * stride_ot + i_h * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
    # log-sum-exp in base 2 of the true logits (the ref shift cancels between c_i and c_j)
    p_lse = LSE + (i_bt * HQ + i_h) * TC + bos + o_m
    b_lse = m_i + tl.math.log2(l_safe)
    if ROW_BIAS:
        b_lse += b_cq
    tl.store(p_lse, b_lse, mask=m_m)


LONG_ACP_KEYS = 8192  # D 128 with ACP: from this many keys on, 128-row tiles (fwd_config)
ROUTE_D64_KEYS = 16384  # D 64 with ACP: from this many keys on, ROUTE (fwd_config)
SHORT_DENSE_KEYS = 8192  # D 64 dense, 16-bit: below this many keys, 64-row tiles (fwd_config)
# ROUTE serves calls of at least this many query rows (B x HQ x Tq): below, its second launch's
# host time (a Triton launch) would be a larger share, and its waves shorter. Not measured
# there: the bench's workload has 786,432
ROUTE_MIN_ROWS = 1 << 18
GLUON_ACP_TRITON = "3.6."  # the Triton whose Gluon the table's GLUON_ACP="routed" was measured with


def fwd_config(d: int, dtype_bytes: int, acp: bool = False, tk: int = 0) -> dict:
    """Tile sizes and launch options by head dim, ACP (BN must divide ACP_BLOCK with ACP) and,
    at D 128 with ACP, the key length ``tk``.

    The figures below are the forward on the benchmark's shapes (bf16, B x T = 32k, 24 heads;
    a tuning workload with a fixed 70% of the heads local, or ``lapse bench attention``'s own,
    which draws them: where it matters the text says which), ms at T 4k / 16k unless it says
    otherwise, against the option it replaced. ``lapse bench attention --sweep fwd`` times the
    tile options against this table.

    ``TMA``: keys and values through tensor descriptors (taken on Hopper and later only,
    :func:`launch_fwd`). The tiles, on an H100:

    - D 64 dense: 128 x 64, 4 warps, 2 stages, TMA: 1.427 / 4.930 (pointer loads, 3 stages:
      1.439 / 5.118; TMA with 3 stages 1.362 / 5.464);
    - D 64 ACP: 128 x 64, 4 warps, 3 stages, TMA: 0.757 / 1.918 (pointer loads 0.836 / 2.028);
    - D 128 dense: 128 x 128, 8 warps, 3 stages, TMA: 1.229 / 3.990 (64 x 64, 4 warps,
      pointer loads: 1.264 / 4.483);
    - D 128 ACP: 64 x 64, 4 warps, 3 stages, pointer loads: 0.672 / 1.888 (the 128-row
      tiles, with or without TMA, 0.81 / 2.04 or slower).

    ``PAIRS`` (the keys' ``c_hi, c_lo`` in one load, :func:`key_bias`), on an H200, with /
    without: D 128 dense 1.126 / 3.680 against 1.238 / 4.061; D 64 ACP 0.754 / 1.859 against
    0.763 / 1.927; it loses at D 64 dense (1.477 / 5.216 against 1.455 / 5.107) and D 128 ACP
    (0.776 / 1.948 against 0.660 / 1.780).

    ``TMA="host"`` (descriptors made on the host: each program's own, written and fenced,
    cost it about 10% of a short program's time in Nsight Compute) and ``LOOPS=3`` (empty
    loops not entered, the masked ones not pipelined), on an H200 with every head's gate
    constant so that each row keeps a band of ``kept`` 64-key blocks (``t = fixed + slope x
    kept`` at T 4k): D 64 ACP with host descriptors 0.224 + 1.108 x kept ms against 0.289 +
    1.089 (16k: 0.213 + 4.499 against 0.282 + 4.429); D 128 dense 1.051 against 1.111 ms;
    D 128 ACP with ``LOOPS=3`` 0.110 + 1.128 against 0.154 + 1.085 (host descriptors lose
    there, 0.245 + 1.399). D 64 dense with host descriptors: 1.463 / 5.235 against 1.462 /
    5.102 ms, so it keeps the program's own (``TMA=True``).

    D 64 dense takes 3 stages, its diagonal loop without 64-bit compares and without an edge
    loop, against 2 stages: H200 1.351 / 4.847 against 1.447 / 5.194; H100 1.339 / 5.034
    against 1.428 / 5.073. Host descriptors were faster on the H100 at 4k (1.286) and not at
    16k (5.424), within that run's noise (the same config timed twice differed by 6% at 16k):
    not taken. D 64 ACP takes 64-row tiles (one ACP block: every row of a tile keeps the same
    keys, so no edge loop runs; H200): 0.612 / 1.724 ms against 0.652 / 1.797 with 128 rows.

    ``ROW_BIAS`` (16-bit inputs: the loops' logits leave out the query's own ``c_i``, one
    multiply-add a pair for scale and bias, and the lse adds it back; float32 keeps the
    exact order), with ``PAIRS`` (without it the key loads lose their width and the kernel
    gets slower), on an H200, two runs: D 64 dense 1.265 / 4.562 and 1.267 / 4.546 against
    1.351 / 4.875 and 1.352 / 4.886; D 64 ACP 0.599 / 1.714 and 0.600 / 1.689 against 0.608 /
    1.774 and 0.619 / 1.827; D 128 dense 1.019 / 3.596 and 1.023 / 3.583 against 1.045 / 3.696
    and 1.057 / 3.719. At D 128 ACP it loses (1.853 against 1.796 at 16k; with ``PAIRS``
    2.002): not taken there.

    ``FIXED_MAX`` (16-bit inputs; :func:`launch_fwd` drops it for float16, whose range the
    weights can leave: the diagonal keys first, and their maximum the reference of every other
    key, so the interior loop has no row maximum, no rescaling of the accumulator and no
    shuffles: 457 instructions a step at D 64 dense against 612), on an H200, against the
    tables with ``ROW_BIAS``: D 64 dense 1.141 / 3.970 against 1.264 / 4.439; D 64 ACP, capped
    at 168 registers (180 without the cap: two programs a multiprocessor instead of three,
    0.703 / 1.835), 0.558 / 1.481 against 0.603 / 1.675; D 128 dense 0.929 / 3.071 against
    1.010 / 3.496; D 128 ACP 0.600 / 1.616 against 0.631 / 1.740 (the cap loses at D 128).

    D 128 with ACP from ``LONG_ACP_KEYS`` keys on: 128 x 64 tiles, 8 warps, host descriptors,
    ``ROW_BIAS`` and ``PAIRS`` (H200): 0.643 / 1.482 against 0.598 / 1.649 with the 64-row
    table. Where the rows keep few keys (4k) the 64-row tiles stay ahead.

    ``ROUTE`` (16-bit inputs with ACP at D 128, and at D 64 from ``ROUTE_D64_KEYS`` keys on;
    :func:`launch_fwd`): the (sequence, head)s that ACP prunes nowhere go through a launch
    with the dense table's tiles, the others through this table's, so that heads which keep
    every key do not run on tiles chosen for short rows. On an H200 (30% of the heads
    global), the forward kernels alone, against one launch: D 128 1.035 / 2.412 against 1.124
    / 2.683, at 8k 1.594 against 1.673; D 64 0.612 / 1.528 against 0.572 / 1.614, at 8k 0.925
    against 0.888 (at D 64 and T below 16k the two launches' tails cost more than the dense
    tiles gain).

    Four programs a multiprocessor at D 64 (16-bit inputs, H200): capped at 128 registers with
    2 stages, the ACP forward's 64 x 64 tiles spill 24 B a thread on the sm_90 compile and fit
    four programs of 4 warps (42 KB of shared memory each) where the 168-register cap fit
    three. The kernels alone, ms at T 4k / 8k / 16k against the 168-register, 3-stage table:
    0.523 / 0.844 / 1.444 against 0.553 / 0.901 / 1.472 (all heads / the local heads at 4k in
    another run: 0.528 / 0.195 against 0.564 / 0.221). The dense forward takes the same
    64-row tiles at 128 registers and 2 stages (no spills) below ``SHORT_DENSE_KEYS`` keys:
    1.097 and 1.102 ms against 1.133 and 1.148 at 4k in two runs, but 2.373 against 2.349 at
    8k and 4.583 against 4.409 at 16k.

    ``LOOPS=1`` in the D 64 ACP table (a loop with no step not entered: with one ACP block a
    tile the edge loop never has one, and a local head's rows rarely reach the interior; on an
    H100): the kernels alone 0.526 / 0.849 / 1.460 ms at T 4k / 8k / 16k against 0.540 / 0.865
    / 1.461 (``LOOPS=3`` 0.526 / 0.854 / 1.449); through the op, best of three CUDA-graph
    replays, forward 0.625 / 0.944 / 1.567 against 0.631 / 0.957 / 1.565 and forward+backward
    2.245 / 3.553 / 6.057 against 2.253 / 3.565 / 6.045, outputs and gradients equal bit for
    bit. On an H200 it made no change to the forward's fixed part that the timing could show.

    ``HEADS_FIRST`` in the D 128 ACP table below ``LONG_ACP_KEYS`` keys (16-bit inputs: every
    head's longest query tile first, then every head's next, so a global head's long tiles do
    not come last; H200, two runs): 1.001 and 1.002 ms against 1.019 and 1.022 at T 4k. At D 64
    it lost at 4k and 8k (0.643 / 0.920 against 0.536 / 0.866) and won 1% at 16k, within two
    runs' spread: not taken there.

    ``GLUON_ACP="routed"`` (D 128 with ACP, 16-bit inputs): where ``ROUTE`` splits the heads,
    the second launch (the heads ACP prunes) runs ``gluon_fwd.py``'s persistent kernel on
    Hopper. On an H200 that launch took 0.219-0.221 / 0.225-0.226 ms at T 4k / 16k against the
    Triton kernel's 0.244-0.245 / 0.303-0.305; at D 64 it loses (0.263-0.275 against
    0.204-0.209), so D 64 keeps the Triton kernel. The op on an H100 (the tuning workload,
    replayed from CUDA graphs, best of three), ms at T 4k / 8k / 16k:
    forward 0.625 / 0.896 / 1.382 against 0.639 / 0.955 / 1.430; forward+backward 2.216 /
    3.397 / 5.679 against 2.224 / 3.458 / 5.688. Taken with Triton 3.6 only
    (``GLUON_ACP_TRITON``), and only from ``LONG_ACP_KEYS`` keys on: on the bench's own
    workload (its random choice of local heads) the Gluon launch lost at T 4k on an H200,
    forward 1.187 against 1.121 ms and forward+backward 3.953 against 3.895 (graph times), and
    the bench on an H100 put the ACP forward at 1.366 ms against 1.184 with the Triton kernel.
    From 8k on it wins: 1.580 against 1.667 (the tuning workload), and on the bench's workload
    1.636 / 2.493 against 1.683 / 2.560 at 8k / 16k.
    """
    rb = dtype_bytes < 4
    if d <= 64:
        if acp:
            cfg = dict(BM=64, BN=64, num_warps=4, num_stages=3, TMA="host", PAIRS=True, ROW_BIAS=rb, LOOPS=1)
            if rb and d == 64 and tk >= ROUTE_D64_KEYS:
                cfg["ROUTE"] = 1
            return dict(cfg, FIXED_MAX=True, maxnreg=128, num_stages=2) if rb else cfg
        cfg = dict(BM=128, BN=64, num_warps=4, num_stages=3, TMA=True, PAIRS=rb, ROW_BIAS=rb, FIXED_MAX=rb)
        return dict(cfg, BM=64, num_stages=2, maxnreg=128) if rb and tk < SHORT_DENSE_KEYS else cfg
    if d <= 128:
        if acp and rb and d == 128 and tk >= LONG_ACP_KEYS:  # measured at D 128 only
            return dict(BM=128, BN=64, num_warps=8, num_stages=3, TMA="host", PAIRS=True, ROW_BIAS=True,
                        LOOPS=3, FIXED_MAX=True, ROUTE=1, GLUON_ACP="routed")
        if acp:
            cfg = dict(BM=64, BN=64, num_warps=4, num_stages=3, PAIRS=False, LOOPS=3, FIXED_MAX=rb)
            return dict(cfg, ROUTE=1, HEADS_FIRST=True) if rb and d == 128 else cfg
        return dict(BM=128, BN=128, num_warps=8, num_stages=3, TMA="host", PAIRS=True, ROW_BIAS=rb,
                    FIXED_MAX=rb)
    return dict(BM=64, BN=32, num_warps=4, num_stages=2)


def _tma_allocator(size: int, alignment: int, stream):
    """Scratch that Triton asks for to build tensor descriptors on the device (the current
    one, where Triton launches; the caching allocator's blocks are 512-byte aligned)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def launch_fwd(q, k, v, c_hi, c_lo, block_start, cu, p, o, lse2, config=None):
    """Runs the forward kernel; writes o [B, Tq, HQ, D] and base-2 lse [B, HQ, Tc].

    ``config`` (default :func:`fwd_config`) may ask for ``TMA=True``: keys and values read
    through tensor descriptors (Hopper's tensor-memory engine), taken where
    :func:`tma_ready` holds and, on a GPU, on compute capability 9 or later (else the
    pointer loads; the CPU interpreter takes it when asked, for the tests); ``TMA="host"``
    makes the descriptors on the host over ``[B * T, H * D]`` views (:func:`_host_tma_ready`;
    no descriptor is written and fenced by each program), else as ``True``. ``GLUON=True``
    runs ``gluon_fwd.py``'s Hopper kernel (its options: ``BM, BN, num_warps, STAGES``)
    where it serves the inputs, else this kernel with the default options."""
    cfg = dict(config or fwd_config(p.d, q.element_size(), block_start is not None, p.tk))
    if cfg.pop("GLUON", False):
        gluon_fwd = _gluon()
        if gluon_fwd is not None and gluon_fwd.supported(q, k, v, block_start, cu, p):
            gluon_fwd.launch(q, k, v, c_hi, c_lo, p, o, lse2, cfg)
            return
        cfg = dict(fwd_config(p.d, q.element_size(), block_start is not None, p.tk))
        cfg.pop("GLUON", None)
    gluon_acp = cfg.pop("GLUON_ACP", None)  # options of gluon_fwd.launch_acp for the ACP launch
    runs = [(cfg, False)]
    route = cfg.pop("ROUTE", False)
    if route and block_start is not None and p.batch * p.hq * p.tq >= ROUTE_MIN_ROWS:
        # the (sequence, head)s that ACP prunes nowhere take the dense kernel's tiles (one
        # launch), the others the ACP table's (a second; first with ROUTE=2): ACP's tiles
        # suit short rows
        dense = fwd_config(p.d, q.element_size(), False, p.tk)
        dense.pop("GLUON_ACP", None)
        runs = [(dict(dense, ROUTE=1), True), (dict(cfg, ROUTE=2), False)]
        runs = runs[::-1] if route == 2 else runs
    pairs = None  # the keys' (c_hi, c_lo) side by side, made once for either launch
    for cfg, no_acp in runs:
        if (gluon_acp is not None and not no_acp
                and _launch_gluon_acp(q, k, v, c_hi, c_lo, block_start, cu, p, o, lse2, gluon_acp,
                                      cfg.get("ROUTE") == 2)):
            continue
        use_tma = tma_mode(cfg.pop("TMA", False), q, k, v, p)
        if q.element_size() == 4:  # float32 keeps the exact order of the bias's terms
            cfg.pop("ROW_BIAS", None)
        if q.dtype == torch.float16:  # FIXED_MAX's weights may pass float16's range (65504), and
            cfg.pop("FIXED_MAX", None)  # every such tile would be done twice
        if cfg.get("PAIRS") and pairs is None:
            pairs = torch.stack((c_hi, c_lo), -1)
        with device_descriptors(use_tma == 1 and q.is_cuda):
            _launch_fwd(q, k, v, c_hi, c_lo, block_start, cu, p, o, lse2, cfg, use_tma, no_acp, pairs)


def _gluon():
    """``gluon_fwd.py``, or None where Triton lacks Gluon's Hopper API (it has no CPU
    interpreter either: its ``supported`` checks say so)."""
    try:
        from . import gluon_fwd
    except ImportError:
        return None
    return gluon_fwd


def _launch_gluon_acp(q, k, v, c_hi, c_lo, block_start, cu, p, o, lse2, options, routed: bool) -> bool:
    """Runs ACP's launch with ``gluon_fwd.py``'s persistent kernel where it serves the inputs
    (``routed``: the (sequence, head)s ACP prunes somewhere only); False where it does not.
    ``options`` (``GLUON_ACP`` in the config): a dict of the kernel's options over its defaults,
    or ``"routed"``: its defaults, for the routed launch only (the table's choice at D 128: on the
    heads ACP prunes nowhere the kernel is slower than the dense tiles)."""
    if options == "routed":  # the table's choice, measured with Triton 3.6's Gluon (experimental:
        # its API moves between releases), so other Tritons keep the Triton kernel
        if not routed or not triton.__version__.startswith(GLUON_ACP_TRITON):
            return False
        options = {}
    gluon_fwd = _gluon()
    if gluon_fwd is None or not gluon_fwd.acp_supported(q, k, v, block_start, cu, p):
        return False
    gluon_fwd.launch_acp(q, k, v, c_hi, c_lo, block_start, p, o, lse2,
                         {**gluon_fwd.acp_config(p.d), **options}, skip_full=routed)
    return True


@contextlib.contextmanager
def device_descriptors(active: bool):
    """Inside, Triton's allocator serves the tensor descriptors that programs make (with
    ``active``: a launch on CUDA that makes them); a context variable, reset on the way out."""
    if not active:
        yield
        return
    from triton.runtime import _allocation

    token = _allocation._allocator.set(_tma_allocator)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def tma_mode(tma, q, k, v, p) -> int:
    """How the forward reads its tiles for the config's ``TMA`` option: 0 pointer loads, 1
    descriptors each program makes, 2 descriptors made on the host (``TMA="host"`` where
    :func:`_host_tma_ready` holds). Descriptors need :func:`tma_ready` inputs on Hopper or
    later, and two or more queries or keys: with one of each (Triton then compiles
    ``T_q = T_k = 1`` in) ptxas 12.8 of Triton 3.6 crashes on the descriptor kernel for
    sm_90 (compiling the kernel for sm_90 on a CPU shows it); one key needs no
    tensor-memory engine anyway."""
    if not (tma and max(p.tq, p.tk) > 1 and tma_ready(k, v) and tma_device(q)):
        return 0
    return 2 if tma == "host" and _host_tma_ready(q, k, v, p) else 1


def _host_tma_ready(q, k, v, p) -> bool:
    """Whether descriptors made on the host over ``[B * T, H * D]`` views serve: every tensor
    contiguous and 16-byte aligned, D a power of two (a block is one head's D columns)."""
    return (p.d == max(16, triton.next_power_of_2(p.d)) and tma_ready(q)
            and all(x.is_contiguous() for x in (q, k, v)))


def head_rows_descriptor(x, rows: int, bd: int):
    """A tensor descriptor made on the host over ``x`` ``[B, T, H, D]`` viewed as
    ``[B * T, H * D]`` (contiguous: :func:`_host_tma_ready`): a block is ``rows`` rows of one
    head's ``bd`` columns, so rows past a sequence are the next one's."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(x.view(-1, x.shape[-2] * x.shape[-1]), [rows, bd])


def tma_device(x) -> bool:
    """Whether ``x``'s device has the tensor-memory engine (Hopper, sm_90, or later); the
    CPU interpreter emulates descriptors."""
    return not x.is_cuda or cuda_capability(x)[0] >= 9


def _launch_fwd(q, k, v, c_hi, c_lo, block_start, cu, p, o, lse2, cfg, use_tma, dense=False, pairs=None):
    """The launch of :func:`launch_fwd` (``cfg`` its options, ``TMA`` taken out). ``BIAS=False``
    leaves out the FoX bias: plain causal softmax attention in the same kernel, a timing
    diagnostic of what the bias costs (``tune_fox_fwd.py --bias-off``), never for results.
    ``ROUTE`` 1 or 2 in ``cfg`` runs the programs of the (sequence, head)s ACP prunes
    nowhere, or of the others, only; ``dense``: without ACP (``block_start`` then routes
    only). ``pairs``: ``(c_hi, c_lo)`` stacked on a last axis, where ``PAIRS`` is asked."""
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    if cfg.pop("PAIRS", False):
        c_lo = pairs if pairs is not None else torch.stack((c_hi, c_lo), -1)
        pairs = True
    else:
        pairs = False
    grid = tile_grid(triton.cdiv(p.tq, bm), p.batch * p.hq, cfg.get("HEADS_FIRST", False))
    mb = block_start.shape[-1] if block_start is not None else 1
    bd = max(16, triton.next_power_of_2(p.d))
    qa, ka, va = q, k, v
    if use_tma == 2:
        qa = head_rows_descriptor(q, bm, bd)
        ka, va = head_rows_descriptor(k, bn, bd), head_rows_descriptor(v, bn, bd)
    _fwd_kernel[grid](
        qa, ka, va, c_hi, c_lo, block_start if block_start is not None else c_hi, o, lse2,
        cu if cu is not None else c_hi,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        p.scale * LOG2E, p.tq, p.tk, c_hi.shape[-1], p.hq, p.hq // p.h, mb,
        D=p.d, BD=bd, BM=bm, BN=bn, G=64,
        IS_VARLEN=cu is not None, USE_ACP=block_start is not None and not dense,
        DOT_PREC="ieee" if q.dtype.itemsize == 4 else "tf32",
        USE_TMA=use_tma, PAIRS=pairs,
        **cfg,
    )
