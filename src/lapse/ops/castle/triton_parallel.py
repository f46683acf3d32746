"""CASTLE in Triton without a wavefront: the key-major schedule (README.md, "A schedule
without a wavefront"; ``parallel.py`` is its plain PyTorch mirror).

One launch per pass, one program per (key block ``J``, batch x head). Program ``J``
holds its lookahead vectors ``U_J`` (float32, ``[BT, D]``, the SPEC's ``D[:, T_J]``) in
registers and walks the query blocks ``I = J, J + 1, ...``; per pair::

    G   = sigmoid(Q^U_J K^U_I^T * scale) * 1[s < j (<= s + W)]     [BT_s, BT_j]
    A   = (Q^C_I V^U_I^T * scale) * 1[j <= i]                       [BT_i, BT_j]
    S^U = Q^C_I U_J^T * scale + A G^T                               [BT_i, BT_s]
    Z   = Q^C_I K^C_J^T * scale - SiLU(S^U)   (causal on the diagonal pair)
    U_J += G V^U_I

No program waits on another: ``U_J`` depends only on column ``J`` and the query blocks
before ``I``. A query row meets its keys in many programs, so instead of an online
softmax every row is normalised by a bound ``M_i`` fixed before the pass
(``_bound_kernel``: the causal row max of ``Q^C K^C^T * scale`` raised by the largest
``-SiLU``, capped to ``HEADROOM`` above the diagonal logit) and the programs add
``exp(Z - M) V^C`` and ``exp(Z - M)`` into shared float32 rows with atomics.

The backward (``_bwd_kernel``) walks each column in reverse from the forward's final
``U_J``, undoing the update by subtraction, and carries ``R_J``, the gradient reaching
``U_J`` from later pairs; the column's gradients (``dK^C, dV^C, dQ^U``) stay in
registers, the rows' (``dQ^C, dK^U, dV^U``) are added atomically. Outside the SWL window
(``I > J + (BT - 1 + W) // BT``) ``G = 0``: those pairs run a loop without the lookahead
products.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..backend import LOG2E, LOG2E_TL
from .parallel import HEADROOM, NEG_SILU_MAX


@triton.jit
def _bound_kernel(
    QC, KC, M2, T, H, GROUP_C, scale, shift2,
    D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_i = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    hc = H // GROUP_C
    i_hc = i_h // GROUP_C
    o_i = i_i * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_i = o_i < T
    m_d = o_d < D
    b_qc = tl.load(QC + ((i_b * T + o_i[:, None]) * H + i_h) * D + o_d[None, :],
                   mask=m_i[:, None] & m_d[None, :], other=0.0)
    b_max = tl.full([BT], float("-inf"), dtype=tl.float32)
    b_diag = tl.full([BT], float("-inf"), dtype=tl.float32)
    for i_j in range(0, i_i + 1):
        o_s = i_j * BT + tl.arange(0, BT)
        b_kc = tl.load(KC + ((i_b * T + o_s[:, None]) * hc + i_hc) * D + o_d[None, :],
                       mask=(o_s < T)[:, None] & m_d[None, :], other=0.0)
        # [BT_i, BT_s] base-2 causal logits
        b_s = tl.dot(b_qc, tl.trans(b_kc), input_precision=DOT_PREC) * (scale * LOG2E_TL)
        b_max = tl.maximum(b_max, tl.max(tl.where(o_s[None, :] <= o_i[:, None], b_s, float("-inf")), 1))
        b_diag = tl.maximum(b_diag, tl.max(tl.where(o_s[None, :] == o_i[:, None], b_s, float("-inf")), 1))
    tl.store(M2 + i_bh * T + o_i, tl.maximum(b_diag, b_max + shift2), mask=m_i)


@triton.jit
def _fwd_tile(b_qc, b_kc, b_vc, b_su, M2, ACC, DEN, i_bh, o_i, o_s, o_d, m_i, m_d, T, scale,
              D: tl.constexpr, DOT_PREC: tl.constexpr):
    """Adds pair (I, J)'s ``exp(Z - M) V^C`` and ``exp(Z - M)`` to the rows of block I."""
    # [BT_i, BT_s] base-2 logits against the row bound
    b_sc = tl.dot(b_qc, tl.trans(b_kc), input_precision=DOT_PREC) * scale
    b_z = (b_sc - b_su * tl.sigmoid(b_su)) * LOG2E_TL
    b_m2 = tl.load(M2 + i_bh * T + o_i, mask=m_i, other=0.0)
    keep = (o_s[None, :] <= o_i[:, None]) & m_i[:, None]
    b_p = tl.where(keep, tl.math.exp2(b_z - b_m2[:, None]), 0.0)
    # [BT_i, BD]
    b_o = tl.dot(b_p.to(b_vc.dtype), b_vc, input_precision=DOT_PREC)
    tl.atomic_add(ACC + (i_bh * T + o_i[:, None]) * D + o_d[None, :], b_o,
                  mask=m_i[:, None] & m_d[None, :], sem="relaxed")
    tl.atomic_add(DEN + i_bh * T + o_i, tl.sum(b_p, 1), mask=m_i, sem="relaxed")


@triton.jit
def lookahead_tile(b_qc, b_qu, KU, VU, i_b, i_hu, hu, o_i, o_s, o_d, m_i, m_d, T, scale, window,
                    D: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr):
    """``(G, sigmoid, A, K^U_I, V^U_I)`` of pair (I, J) inside the window (the wavefront
    kernels call it too)."""
    m_id = m_i[:, None] & m_d[None, :]
    b_ku = tl.load(KU + ((i_b * T + o_i[:, None]) * hu + i_hu) * D + o_d[None, :], mask=m_id, other=0.0)
    b_vu = tl.load(VU + ((i_b * T + o_i[:, None]) * hu + i_hu) * D + o_d[None, :], mask=m_id, other=0.0)
    # [BT_s, BT_j]
    m_g = (o_i[None, :] > o_s[:, None]) & m_i[None, :]
    if USE_WINDOW:
        m_g = m_g & (o_i[None, :] <= o_s[:, None] + window)
    b_sg = tl.sigmoid(tl.dot(b_qu, tl.trans(b_ku), input_precision=DOT_PREC) * scale)
    b_g = tl.where(m_g, b_sg, 0.0)
    # [BT_i, BT_j]
    b_a = tl.dot(b_qc, tl.trans(b_vu), input_precision=DOT_PREC) * scale
    b_a = tl.where(o_i[None, :] <= o_i[:, None], b_a, 0.0)
    return b_g, b_sg, b_a, b_ku, b_vu


@triton.jit
def _column(KC, VC, QU, T, H, GROUP_C, GROUP_U, NB, window,
            D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, USE_WINDOW: tl.constexpr):
    """A key-major program's indices, its column block ``J``'s ``K^C, V^C, Q^U``
    ``[BT, BD]``, and ``i_last``, the last query block some row of ``J`` looks ahead to."""
    i_j = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    i_hc = i_h // GROUP_C
    i_hu = i_h // GROUP_U
    hc = H // GROUP_C
    hu = H // GROUP_U
    o_s = i_j * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_s = o_s < T
    m_d = o_d < D
    m_sd = m_s[:, None] & m_d[None, :]
    i_last = NB - 1
    if USE_WINDOW:
        i_last = tl.minimum(i_last, i_j + (BT - 1 + window) // BT)
    # [BT, BD] column block J
    b_kc = tl.load(KC + ((i_b * T + o_s[:, None]) * hc + i_hc) * D + o_d[None, :], mask=m_sd, other=0.0)
    b_vc = tl.load(VC + ((i_b * T + o_s[:, None]) * hc + i_hc) * D + o_d[None, :], mask=m_sd, other=0.0)
    b_qu = tl.load(QU + ((i_b * T + o_s[:, None]) * H + i_h) * D + o_d[None, :], mask=m_sd, other=0.0)
    return i_j, i_bh, i_b, i_h, i_hu, hu, o_s, o_d, m_d, m_sd, i_last, b_kc, b_vc, b_qu


@triton.jit
def _fwd_kernel(
    QC, KC, VC, QU, KU, VU, M2, ACC, DEN, UEND,
    T, H, GROUP_C, GROUP_U, NB, scale, window,
    D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_j, i_bh, i_b, i_h, i_hu, hu, o_s, o_d, m_d, m_sd, i_last, b_kc, b_vc, b_qu = _column(
        KC, VC, QU, T, H, GROUP_C, GROUP_U, NB, window, D, BD, BT, USE_WINDOW)

    dt = b_kc.dtype
    b_u = tl.zeros([BT, BD], dtype=tl.float32)
    for i_i in range(i_j, i_last + 1):
        o_i = i_i * BT + tl.arange(0, BT)
        m_i = o_i < T
        b_qc = tl.load(QC + ((i_b * T + o_i[:, None]) * H + i_h) * D + o_d[None, :],
                       mask=m_i[:, None] & m_d[None, :], other=0.0)
        b_g, b_sg, b_a, b_ku, b_vu = lookahead_tile(b_qc, b_qu, KU, VU, i_b, i_hu, hu, o_i, o_s, o_d,
                                                     m_i, m_d, T, scale, window, D, USE_WINDOW, DOT_PREC)
        # [BT_i, BT_s]
        b_su = tl.dot(b_qc, tl.trans(b_u.to(dt)), input_precision=DOT_PREC) * scale
        b_su = tl.dot(b_a.to(dt), tl.trans(b_g.to(dt)), b_su, input_precision=DOT_PREC)
        _fwd_tile(b_qc, b_kc, b_vc, b_su, M2, ACC, DEN, i_bh, o_i, o_s, o_d, m_i, m_d, T, scale,
                  D, DOT_PREC)
        # [BT_s, BD] for the next query block
        b_u = tl.dot(b_g.to(dt), b_vu, b_u, input_precision=DOT_PREC)
    # past the window U_J is final
    for i_i in range(i_last + 1, NB):
        o_i = i_i * BT + tl.arange(0, BT)
        m_i = o_i < T
        b_qc = tl.load(QC + ((i_b * T + o_i[:, None]) * H + i_h) * D + o_d[None, :],
                       mask=m_i[:, None] & m_d[None, :], other=0.0)
        b_su = tl.dot(b_qc, tl.trans(b_u.to(dt)), input_precision=DOT_PREC) * scale
        _fwd_tile(b_qc, b_kc, b_vc, b_su, M2, ACC, DEN, i_bh, o_i, o_s, o_d, m_i, m_d, T, scale,
                  D, DOT_PREC)
    tl.store(UEND + (i_bh * T + o_s[:, None]) * D + o_d[None, :], b_u, mask=m_sd)


@triton.jit
def _bwd_tile(b_qc, b_kc, b_vc, b_do, b_su, LSE2, DELTA, i_bh, o_i, o_s, m_i, T, scale,
              DOT_PREC: tl.constexpr):
    """``(P, dZ, dS)`` ``[BT_i, BT_s]`` of pair (I, J)."""
    b_lse2 = tl.load(LSE2 + i_bh * T + o_i, mask=m_i, other=0.0)
    b_delta = tl.load(DELTA + i_bh * T + o_i, mask=m_i, other=0.0)
    b_sc = tl.dot(b_qc, tl.trans(b_kc), input_precision=DOT_PREC) * scale
    b_ss = tl.sigmoid(b_su)
    b_z = (b_sc - b_su * b_ss) * LOG2E_TL
    keep = (o_s[None, :] <= o_i[:, None]) & m_i[:, None]
    b_p = tl.where(keep, tl.math.exp2(b_z - b_lse2[:, None]), 0.0)
    b_dp = tl.dot(b_do, tl.trans(b_vc), input_precision=DOT_PREC)
    b_dz = b_p * (b_dp - b_delta[:, None])
    b_ds = -b_ss * (1.0 + b_su * (1.0 - b_ss)) * b_dz
    return b_p, b_dz, b_ds


@triton.jit
def _bwd_kernel(
    QC, KC, VC, QU, KU, VU, DO, LSE2, DELTA, UEND,
    DQC, DKC, DVC, DQU, DKU, DVU,
    T, H, GROUP_C, GROUP_U, NB, scale, window,
    D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_j, i_bh, i_b, i_h, i_hu, hu, o_s, o_d, m_d, m_sd, i_last, b_kc, b_vc, b_qu = _column(
        KC, VC, QU, T, H, GROUP_C, GROUP_U, NB, window, D, BD, BT, USE_WINDOW)
    o_col = (i_bh * T + o_s[:, None]) * D + o_d[None, :]

    dt = b_kc.dtype
    b_u = tl.load(UEND + o_col, mask=m_sd, other=0.0)  # U_J after the last query block
    b_r = tl.zeros([BT, BD], dtype=tl.float32)  # gradient reaching U_J from later pairs
    b_dkc = tl.zeros([BT, BD], dtype=tl.float32)
    b_dvc = tl.zeros([BT, BD], dtype=tl.float32)
    b_dqu = tl.zeros([BT, BD], dtype=tl.float32)
    # past the window, in reverse: U_J is final, nothing reaches the lookahead inputs
    for n in range(0, NB - 1 - i_last):
        o_i = (NB - 1 - n) * BT + tl.arange(0, BT)
        m_i = o_i < T
        m_id = m_i[:, None] & m_d[None, :]
        o_row = ((i_b * T + o_i[:, None]) * H + i_h) * D + o_d[None, :]
        b_qc = tl.load(QC + o_row, mask=m_id, other=0.0)
        b_do = tl.load(DO + o_row, mask=m_id, other=0.0)
        b_su = tl.dot(b_qc, tl.trans(b_u.to(dt)), input_precision=DOT_PREC) * scale
        b_p, b_dz, b_ds = _bwd_tile(b_qc, b_kc, b_vc, b_do, b_su, LSE2, DELTA, i_bh, o_i, o_s, m_i,
                                    T, scale, DOT_PREC)
        b_dvc = tl.dot(tl.trans(b_p.to(dt)), b_do, b_dvc, input_precision=DOT_PREC)
        b_dkc += tl.dot(tl.trans(b_dz.to(dt)), b_qc, input_precision=DOT_PREC) * scale
        b_r += tl.dot(tl.trans(b_ds.to(dt)), b_qc, input_precision=DOT_PREC) * scale
        # [BT_i, BD]
        b_dqc = tl.dot(b_dz.to(dt), b_kc, input_precision=DOT_PREC)
        b_dqc = tl.dot(b_ds.to(dt), b_u.to(dt), b_dqc, input_precision=DOT_PREC)
        tl.atomic_add(DQC + (i_bh * T + o_i[:, None]) * D + o_d[None, :], b_dqc * scale, mask=m_id,
                      sem="relaxed")
    # inside the window, in reverse down to the diagonal pair
    for n in range(0, i_last - i_j + 1):
        i_i = i_last - n
        o_i = i_i * BT + tl.arange(0, BT)
        m_i = o_i < T
        m_id = m_i[:, None] & m_d[None, :]
        o_row = ((i_b * T + o_i[:, None]) * H + i_h) * D + o_d[None, :]
        o_acc = (i_bh * T + o_i[:, None]) * D + o_d[None, :]
        b_qc = tl.load(QC + o_row, mask=m_id, other=0.0)
        b_do = tl.load(DO + o_row, mask=m_id, other=0.0)
        b_g, b_sg, b_a, b_ku, b_vu = lookahead_tile(b_qc, b_qu, KU, VU, i_b, i_hu, hu, o_i, o_s, o_d,
                                                     m_i, m_d, T, scale, window, D, USE_WINDOW, DOT_PREC)
        # U_J before block I: the forward added exactly this product (nothing before J)
        b_u = tl.where(i_i > i_j, b_u - tl.dot(b_g.to(dt), b_vu, input_precision=DOT_PREC), 0.0)
        # the update U_J += G V^U_I receives R_J: [BT_s, BT_j] and [BT_j, BD]
        b_dg = tl.dot(b_r.to(dt), tl.trans(b_vu), input_precision=DOT_PREC)
        b_dvu = tl.dot(tl.trans(b_g.to(dt)), b_r.to(dt), input_precision=DOT_PREC)
        # [BT_i, BT_s]
        b_su = tl.dot(b_qc, tl.trans(b_u.to(dt)), input_precision=DOT_PREC) * scale
        b_su = tl.dot(b_a.to(dt), tl.trans(b_g.to(dt)), b_su, input_precision=DOT_PREC)
        b_p, b_dz, b_ds = _bwd_tile(b_qc, b_kc, b_vc, b_do, b_su, LSE2, DELTA, i_bh, o_i, o_s, m_i,
                                    T, scale, DOT_PREC)
        b_dvc = tl.dot(tl.trans(b_p.to(dt)), b_do, b_dvc, input_precision=DOT_PREC)
        b_dkc += tl.dot(tl.trans(b_dz.to(dt)), b_qc, input_precision=DOT_PREC) * scale
        b_r += tl.dot(tl.trans(b_ds.to(dt)), b_qc, input_precision=DOT_PREC) * scale
        # [BT_i, BT_j]
        b_da = tl.dot(b_ds.to(dt), b_g.to(dt), input_precision=DOT_PREC)
        b_da = tl.where(o_i[None, :] <= o_i[:, None], b_da, 0.0)
        # [BT_s, BT_j]
        b_dg = tl.dot(tl.trans(b_ds.to(dt)), b_a.to(dt), b_dg, input_precision=DOT_PREC)
        b_dx = b_dg * b_g * (1.0 - b_sg)
        b_dqu += tl.dot(b_dx.to(dt), b_ku, input_precision=DOT_PREC) * scale
        # [BT_i, BD]
        b_dqc = tl.dot(b_dz.to(dt), b_kc, input_precision=DOT_PREC)
        b_dqc = tl.dot(b_ds.to(dt), b_u.to(dt), b_dqc, input_precision=DOT_PREC)
        b_dqc = tl.dot(b_da.to(dt), b_vu, b_dqc, input_precision=DOT_PREC)
        b_dvu += tl.dot(tl.trans(b_da.to(dt)), b_qc, input_precision=DOT_PREC) * scale
        b_dku = tl.dot(tl.trans(b_dx.to(dt)), b_qu, input_precision=DOT_PREC) * scale
        tl.atomic_add(DQC + o_acc, b_dqc * scale, mask=m_id, sem="relaxed")
        tl.atomic_add(DKU + o_acc, b_dku, mask=m_id, sem="relaxed")
        tl.atomic_add(DVU + o_acc, b_dvu, mask=m_id, sem="relaxed")
    tl.store(DKC + o_col, b_dkc, mask=m_sd)
    tl.store(DVC + o_col, b_dvc, mask=m_sd)
    tl.store(DQU + o_col, b_dqu, mask=m_sd)


def parallel_config(d: int, interpret: bool, backward: bool = False, window: int | None = None) -> dict:
    """Block size, warps and stages by head dim, measured on an H100 (T 4096, B x T = 16k,
    8 heads, bf16): backward at D 64 with 32-position
    blocks, 4 warps, 2 stages 5.1 ms against 16.6 ms for the first guess (64, 8 warps, 1
    stage), 2.9 against 5.9 ms under SWL 512; forward at D 128 with 4 warps, 1 stage 2.66
    against 3.51 ms. Backward at D 128:
    without a window 16-position blocks, 4 warps, 2 stages take 7.3 / 14.7 / 28.5 ms at
    T 2k / 4k / 8k against 9.2 / 18.6 / 37.2 for 32-position blocks; under SWL 512 the
    32-position blocks with 4 warps, 1 stage are the faster at 4k and 8k (7.27 against 9.11
    ms for 8 warps at 4k). Other blockings round the float32 ``U`` to bf16 at other
    points, so their bf16 gradients differ by ~2e-2 relative (both within the GPU tests'
    float64 rule). The forward holds one
    float32 ``[BT, D]`` tile across its loop (``U_J``), the backward five (``U_J, R_J``,
    ``dK^C, dV^C, dQ^U``), hence its smaller blocks. The interpreter gets 16-position
    blocks, so small test shapes span several blocks."""
    if interpret:
        return dict(BT=16, num_warps=1, num_stages=1)
    if backward:
        if d <= 64:
            return dict(BT=32, num_warps=4, num_stages=2)
        if window is None:
            return dict(BT=16, num_warps=4, num_stages=2)
        return dict(BT=32, num_warps=4, num_stages=1)
    if d <= 64:
        return dict(BT=64, num_warps=4, num_stages=2)
    if d <= 128:
        return dict(BT=64, num_warps=4, num_stages=1)
    return dict(BT=32, num_warps=8, num_stages=2)


def _common(qc, kc, ku, window, cfg):
    b, t, h, d = qc.shape
    bt = cfg["BT"]
    grid = (triton.cdiv(t, bt), b * h)
    args = (t, h, h // kc.shape[2], h // ku.shape[2], grid[0])
    meta = dict(D=d, BD=max(16, triton.next_power_of_2(d)), BT=bt, USE_WINDOW=window is not None,
                DOT_PREC="ieee" if qc.dtype.itemsize == 4 else "tf32",
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return grid, args, meta


def launch_parallel_fwd(qc, kc, vc, qu, ku, vu, scale, window, m2, acc, den, u_end, cfg):
    """Two launches: the row bound ``m2`` (base 2, ``[B, H, T]``), then every key block at
    once. Inputs ``[B, T, H*, D]`` contiguous; ``acc`` ``[B, H, T, D]`` and ``den``
    ``[B, H, T]`` float32 must be zero (they are added into); writes ``m2`` and the final
    ``U`` ``u_end`` ``[B, H, T, D]`` float32. Then ``o = acc / den``, ``lse2 = m2 +
    log2(den)``."""
    grid, args, meta = _common(qc, kc, ku, window, cfg)
    t, h, group_c = args[:3]
    shift2 = (NEG_SILU_MAX - HEADROOM) * LOG2E
    _bound_kernel[grid](qc, kc, m2, t, h, group_c, scale, shift2, D=meta["D"], BD=meta["BD"],
                        BT=meta["BT"], DOT_PREC=meta["DOT_PREC"], num_warps=meta["num_warps"],
                        num_stages=meta["num_stages"])
    _fwd_kernel[grid](qc, kc, vc, qu, ku, vu, m2, acc, den, u_end, *args, scale, window or 0, **meta)


def launch_parallel_bwd(qc, kc, vc, qu, ku, vu, do, lse2, delta, u_end, grads, scale, window, cfg):
    """One launch. ``grads = (dqc, dkc, dvc, dqu, dku, dvu)`` float32 ``[B, H, T, D]`` per
    query head: ``dqc, dku, dvu`` must be zero (added into atomically), the others are
    written whole."""
    grid, args, meta = _common(qc, kc, ku, window, cfg)
    _bwd_kernel[grid](qc, kc, vc, qu, ku, vu, do, lse2, delta, u_end, *grads, *args, scale,
                      window or 0, **meta)
