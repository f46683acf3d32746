"""Triton kernels of the accumulated attention per key (H2O, A2SF; SPEC section 7).

Two passes, no atomics, no ``[T, T]`` tensor:

1. ``_lse_kernel`` (only when the caller has no log-sum-exp): one program per (query
   block, batch x query head), an online max/sum over the causal keys, as the flash
   forward without V.
2. ``_scores_kernel``: one program per (key block, batch x key head). It keeps its keys
   in registers and walks the query heads of the group and, for each, the query blocks
   from the key block's diagonal (or the first query with a nonzero weight) to the end,
   adding ``exp2(s_ij - shift_i)`` over the rows: ``shift_i = log2 of (lse_i / w_i)``
   folds the row's normaliser and its A2SF weight into one number per row. Each program
   owns its output columns, so the result is deterministic.

Everything runs in base 2. The FoX bias comes from the float64 cumulative gate split into
float32 ``hi + lo`` (``common.split_hi_lo``) and is formed per pair as
``(hi_i - hi_j) + (lo_i - lo_j)``: the forward kernel's ``(hi - ref) + lo`` per position
rounds ``lo`` into a number as large as ``c_i - ref``, which after a floored gate
(``log f = -inf``, ``c`` jumps by 1000) gave 1.5e-5 relative error on the scores of the
keys behind it; per pair it stays relative to ``|D_ij|`` (measured 2e-7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import LOG2E, LOG2E_TL
from .forgetting.common import cumulative_log_gates, split_hi_lo

# Tests set this to fill the outputs with NaN before the launch, so an unwritten column
# shows up instead of passing on stale memory.
POISON_OUTPUTS = False


@triton.jit
def _bias2(b_hq, b_lq, b_hk, b_lk):
    # [BM, BN] D_ij in base 2 from c = hi + lo: close hi values subtract exactly, so the
    # rounding stays relative to |D_ij| even when c is -1e4 (floored gates, long prompts)
    return ((b_hq[:, None] - b_hk[None, :]) + (b_lq[:, None] - b_lk[None, :])) * LOG2E_TL


@triton.jit
def _lse_kernel(
    Q, K, CHI, CLO, LSE2,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    qk_scale, T, HQ, GROUP, M0,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    USE_GATE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_m = tl.program_id(0).to(tl.int64) + M0
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // HQ
    i_h = i_bh % HQ
    i_hk = i_h // GROUP
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < T
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    # [BM, BD]
    b_q = tl.load(Q + i_b * stride_qb + o_m[:, None] * stride_qt + i_h * stride_qh + o_d[None, :],
                  mask=m_m[:, None] & m_d[None, :], other=0.0)
    p_chi = CHI + i_bh * T
    p_clo = CLO + i_bh * T
    if USE_GATE:
        b_hq = tl.load(p_chi + o_m, mask=m_m, other=0.0)
        b_lq = tl.load(p_clo + o_m, mask=m_m, other=0.0)
    p_k = K + i_b * stride_kb + i_hk * stride_kh
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    for start in range(0, tl.minimum(i_m * BM + BM, T), BN):
        o_n = start + tl.arange(0, BN)
        m_n = o_n < T
        # [BD, BN]
        b_kt = tl.load(p_k + o_n[None, :] * stride_kt + o_d[:, None],
                       mask=m_d[:, None] & m_n[None, :], other=0.0)
        # [BM, BN], base-2 logits
        b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale
        if USE_GATE:
            b_hk = tl.load(p_chi + o_n, mask=m_n, other=0.0)
            b_lk = tl.load(p_clo + o_n, mask=m_n, other=0.0)
            b_s += _bias2(b_hq, b_lq, b_hk, b_lk)
        b_s = tl.where((o_n[None, :] <= o_m[:, None]) & m_n[None, :], b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        # rows past T have no key: shift by 0 so exp2 gives 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_use) + tl.sum(tl.math.exp2(b_s - m_use[:, None]), 1)
        m_i = m_new
    l_safe = tl.where(m_m, l_i, 1.0)
    tl.store(LSE2 + i_bh * T + o_m, m_i + tl.math.log2(l_safe), mask=m_m)


@triton.jit
def _scores_kernel(
    Q, K, CHI, CLO, SHIFT, A,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_ab, stride_at,
    qk_scale, T, HQ, H, GROUP, LIVE,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    USE_GATE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_hk = i_bh % H
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < T
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    # [BD, BN], kept for every query head of the group
    b_kt = tl.load(K + i_b * stride_kb + o_n[None, :] * stride_kt + i_hk * stride_kh + o_d[:, None],
                   mask=m_d[:, None] & m_n[None, :], other=0.0)
    b_a = tl.zeros([BN], dtype=tl.float32)
    # queries before the key block's first key are not causal, before LIVE weigh 0
    m_lo = tl.maximum(i_n * BN, LIVE) // BM
    for i_g in range(0, GROUP):
        i_h = i_hk * GROUP + i_g
        p_chi = CHI + (i_b * HQ + i_h) * T
        p_clo = CLO + (i_b * HQ + i_h) * T
        p_shift = SHIFT + (i_b * HQ + i_h) * T
        if USE_GATE:
            b_hk = tl.load(p_chi + o_n, mask=m_n, other=0.0)
            b_lk = tl.load(p_clo + o_n, mask=m_n, other=0.0)
        p_q = Q + i_b * stride_qb + i_h * stride_qh
        for i_m in range(m_lo, tl.cdiv(T, BM)):
            o_m = i_m * BM + tl.arange(0, BM)
            m_m = o_m < T
            # [BM, BD]
            b_q = tl.load(p_q + o_m[:, None] * stride_qt + o_d[None, :],
                          mask=m_m[:, None] & m_d[None, :], other=0.0)
            b_shift = tl.load(p_shift + o_m, mask=m_m, other=float("inf"))
            # [BM, BN], base-2 logits
            b_s = tl.dot(b_q, b_kt, input_precision=DOT_PREC) * qk_scale
            if USE_GATE:
                b_hq = tl.load(p_chi + o_m, mask=m_m, other=0.0)
                b_lq = tl.load(p_clo + o_m, mask=m_m, other=0.0)
                b_s += _bias2(b_hq, b_lq, b_hk, b_lk)
            keep = (o_n[None, :] <= o_m[:, None]) & m_m[:, None]
            b_p = tl.where(keep, tl.math.exp2(b_s - b_shift[:, None]), 0.0)
            b_a += tl.sum(b_p, 0)
    tl.store(A + i_b * stride_ab + o_n * stride_at + i_hk, b_a, mask=m_n)


def tile_config(d: int) -> dict:
    """Tile sizes by head dim (both kernels). D <= 128: measured on an H100 (4 x 4096, 9
    query heads over 3, bf16): 128 x 128 tiles, 4 warps,
    2 stages take 0.71 ms at D 64 and 0.80 at D 128 for both passes, against 0.89 and 0.92
    for the 64 x 64 tiles of before, the fastest or within the noise of it among 36 options.
    Wider heads: not measured, smaller query tiles to keep both blocks in registers."""
    if d <= 128:
        return dict(BM=128, BN=128, num_warps=4, num_stages=2)
    return dict(BM=32, BN=64, num_warps=4, num_stages=2)


def _empty(*shape, like: torch.Tensor) -> torch.Tensor:
    out = like.new_empty(*shape, dtype=torch.float32)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def triton_attention_key_scores(q, k, log_fgate, lse, p, chunk_size: int | None, log_w, live: int):
    """A(j) ``[B, T, H]`` float32 through the kernels; ``p`` the validated problem of
    :func:`lapse.ops.scores.attention_key_scores`, ``chunk_size`` the tile length, ``log_w``
    ``[T]`` float64 the queries' log weights and ``live`` the first query whose weight is
    not zero (``scores.log_weights``, ``scores.first_live_query``; passed in so that this
    file does not import its caller)."""
    if chunk_size is None:
        cfg = tile_config(p.d)
    else:
        if chunk_size < 16 or chunk_size > 256 or chunk_size & (chunk_size - 1):
            raise ValueError(
                f"chunk_size on the triton backend must be a power of two in [16, 256], "
                f"got {chunk_size}"
            )
        cfg = dict(BM=chunk_size, BN=chunk_size, num_warps=4, num_stages=2)
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    a = _empty(p.batch, p.t, p.h, like=q)
    if p.t == 0:
        return a
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    use_gate = log_fgate is not None
    if use_gate:
        c_hi, c_lo = split_hi_lo(cumulative_log_gates(log_fgate))  # [B, HQ, T] float32 each
    else:
        c_hi = c_lo = a  # never read
    consts = dict(D=p.d, BD=max(16, triton.next_power_of_2(p.d)), BM=bm, BN=bn,
                  USE_GATE=use_gate, DOT_PREC="ieee" if q.dtype.itemsize == 4 else "tf32")
    qk_scale = p.scale * LOG2E
    if lse is None:
        lse2 = _empty(p.batch, p.hq, p.t, like=q)  # rows before block `live // bm` unwritten
        m0 = live // bm
        _lse_kernel[(triton.cdiv(p.t, bm) - m0, p.batch * p.hq)](
            q, k, c_hi, c_lo, lse2,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            qk_scale, p.t, p.hq, p.hq // p.h, m0,
            **consts, **cfg,
        )
    else:
        lse2 = lse.double() * LOG2E
    # shift_i = log2(lse_i / w_i), from float64 weights; rows before `live` weigh 0: +inf
    logw2 = log_w * LOG2E  # [T]
    shift = (lse2.double() - logw2).to(torch.float32)  # [B, HQ, T]
    shift[..., :live] = float("inf")
    _scores_kernel[(triton.cdiv(p.t, bn), p.batch * p.h)](
        q, k, c_hi, c_lo, shift, a,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        a.stride(0), a.stride(1),
        qk_scale, p.t, p.hq, p.h, p.hq // p.h, live,
        **consts, **cfg,
    )
    return a
