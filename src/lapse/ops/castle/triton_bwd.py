"""Backward kernel of CASTLE: the forward's wavefront in reverse (SPEC section 5).

Step ``k`` runs from ``nb - 1`` down to 0, again one program per pair ``(I, J) =
(J + k, J)``. Per pair, with the forward's quantities recomputed (``G, A, S^U, P``)::

    U_J  -= G V^U_I                   undo the forward's update: U_J before block I
    dG    = R_J V^U_I^T               R_J: gradient reaching U_J from the pairs (I' > I, J)
    dV^U_I += G^T R_J
    dZ    = P * (dP - Delta),  dP = dO_I V^C_J^T
    dS    = -SiLU'(S^U) * dZ,  SiLU'(x) = s(x) (1 + x (1 - s(x)))
    dQ^C_I += scale (dZ K^C_J + dS U_J + dA V^U_I),  dA = (dS G) * 1[j <= i]
    dK^C_J += scale dZ^T Q^C_I,  dV^C_J += P^T dO_I
    R_J  += scale dS^T Q^C_I
    dG   += dS^T A_I,  dX = dG * G * (1 - sigmoid(X))
    dQ^U_J += scale dX K^U_I,  dK^U_I += scale dX^T Q^U_J,  dV^U_I += scale dA^T Q^C_I

Every pair writes the row block ``I`` (dQ^C, dK^U, dV^U) and the column block ``J``
(U, R, dK^C, dV^C, dQ^U), and within a step each row and each column belongs to one
program. The SPEC's two buffers for neighbouring dK^U / dV^U blocks are not needed:
here the ``D`` update of a pair uses block ``I`` itself (see triton_fwd.py), so both of
a pair's lookahead-key gradients land on row ``I``. All accumulators are float32
``[B, H, T, D]`` (per query head; grouped heads are summed on the host) and are written,
not zeroed, at their first touch, so nothing is read before it is written.

First touches in reverse order: a column at ``I = nb - 1``; a row at ``J = 0``; the
lookahead gradients (only inside the window) at the last in-window step ``K_LAST``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..backend import LOG2E_TL
from .triton_parallel import lookahead_tile


@triton.jit
def _bwd_step_kernel(
    QC, KC, VC, QU, KU, VU, DO, LSE, DELTA, UEND, U, R,
    DQC, DKC, DVC, DQU, DKU, DVU,
    T, H, GROUP_C, GROUP_U, k, K_LAST, NB, scale, window,
    D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    IN_WINDOW: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_j = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    i_hc = i_h // GROUP_C
    i_hu = i_h // GROUP_U
    hc = H // GROUP_C
    hu = H // GROUP_U
    i_i = i_j + k
    o_s = i_j * BT + tl.arange(0, BT)
    o_i = i_i * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_s = o_s < T
    m_i = o_i < T
    m_d = o_d < D
    m_sd = m_s[:, None] & m_d[None, :]
    m_id = m_i[:, None] & m_d[None, :]
    first_col = i_i == NB - 1
    first_row = i_j == 0

    # [BT, BD] column block J
    b_kc = tl.load(KC + ((i_b * T + o_s[:, None]) * hc + i_hc) * D + o_d[None, :], mask=m_sd, other=0.0)
    b_vc = tl.load(VC + ((i_b * T + o_s[:, None]) * hc + i_hc) * D + o_d[None, :], mask=m_sd, other=0.0)
    o_col = (i_bh * T + o_s[:, None]) * D + o_d[None, :]
    # [BT, BD] row block I
    b_qc = tl.load(QC + ((i_b * T + o_i[:, None]) * H + i_h) * D + o_d[None, :], mask=m_id, other=0.0)
    b_do = tl.load(DO + ((i_b * T + o_i[:, None]) * H + i_h) * D + o_d[None, :], mask=m_id, other=0.0)
    b_lse = tl.load(LSE + i_bh * T + o_i, mask=m_i, other=0.0)
    b_delta = tl.load(DELTA + i_bh * T + o_i, mask=m_i, other=0.0)
    o_row = (i_bh * T + o_i[:, None]) * D + o_d[None, :]
    dt = b_qc.dtype

    if first_col:
        b_r = tl.zeros([BT, BD], dtype=tl.float32)
        b_dkc = tl.zeros([BT, BD], dtype=tl.float32)
        b_dvc = tl.zeros([BT, BD], dtype=tl.float32)
    else:
        b_r = tl.load(R + o_col, mask=m_sd, other=0.0)
        b_dkc = tl.load(DKC + o_col, mask=m_sd, other=0.0)
        b_dvc = tl.load(DVC + o_col, mask=m_sd, other=0.0)
    if first_row:
        b_dqc = tl.zeros([BT, BD], dtype=tl.float32)
    else:
        b_dqc = tl.load(DQC + o_row, mask=m_id, other=0.0)

    # [BT_i, BT_s]
    b_sc = tl.dot(b_qc, tl.trans(b_kc), input_precision=DOT_PREC) * scale
    if IN_WINDOW:
        # the first in-window touch of a column reads the forward's final U
        if first_col | (k == K_LAST):
            b_u = tl.load(UEND + o_col, mask=m_sd, other=0.0)
            b_dqu = tl.zeros([BT, BD], dtype=tl.float32)
        else:
            b_u = tl.load(U + o_col, mask=m_sd, other=0.0)
            b_dqu = tl.load(DQU + o_col, mask=m_sd, other=0.0)
        if first_row | (k == K_LAST):
            b_dku = tl.zeros([BT, BD], dtype=tl.float32)
            b_dvu = tl.zeros([BT, BD], dtype=tl.float32)
        else:
            b_dku = tl.load(DKU + o_row, mask=m_id, other=0.0)
            b_dvu = tl.load(DVU + o_row, mask=m_id, other=0.0)
        b_qu = tl.load(QU + ((i_b * T + o_s[:, None]) * H + i_h) * D + o_d[None, :], mask=m_sd,
                       other=0.0)
        # [BT_s, BT_j] G and its sigmoid, [BT_i, BT_j] A
        b_g, b_sg, b_a, b_ku, b_vu = lookahead_tile(b_qc, b_qu, KU, VU, i_b, i_hu, hu, o_i, o_s, o_d,
                                                    m_i, m_d, T, scale, window, D, USE_WINDOW, DOT_PREC)
        # the forward added exactly this product: subtracting it gives U_J before block I
        b_u -= tl.dot(b_g.to(dt), b_vu, input_precision=DOT_PREC)
        tl.store(U + o_col, b_u, mask=m_sd)
        # [BT_s, BT_j] and [BT_j, BD]: the update U_J += G V^U_I receives R_J
        b_dg = tl.dot(b_r.to(dt), tl.trans(b_vu), input_precision=DOT_PREC)
        b_dvu = tl.dot(tl.trans(b_g.to(dt)), b_r.to(dt), b_dvu, input_precision=DOT_PREC)
        b_su = tl.dot(b_qc, tl.trans(b_u.to(dt)), input_precision=DOT_PREC) * scale
        b_su += tl.dot(b_a.to(dt), tl.trans(b_g.to(dt)), input_precision=DOT_PREC)
    else:
        b_u = tl.load(UEND + o_col, mask=m_sd, other=0.0)  # final: no update after the window
        b_su = tl.dot(b_qc, tl.trans(b_u.to(dt)), input_precision=DOT_PREC) * scale

    # [BT_i, BT_s]
    b_ss = tl.sigmoid(b_su)
    b_z = (b_sc - b_su * b_ss) * LOG2E_TL
    keep = (o_s[None, :] <= o_i[:, None]) & m_i[:, None]
    b_p = tl.where(keep, tl.math.exp2(b_z - b_lse[:, None]), 0.0)
    b_dvc = tl.dot(tl.trans(b_p.to(dt)), b_do, b_dvc, input_precision=DOT_PREC)
    b_dp = tl.dot(b_do, tl.trans(b_vc), input_precision=DOT_PREC)
    b_dz = b_p * (b_dp - b_delta[:, None])
    b_ds = -b_ss * (1.0 + b_su * (1.0 - b_ss)) * b_dz
    # [BT_i, BD]
    b_dqc += tl.dot(b_dz.to(dt), b_kc, input_precision=DOT_PREC) * scale
    b_dqc += tl.dot(b_ds.to(dt), b_u.to(dt), input_precision=DOT_PREC) * scale
    # [BT_s, BD]
    b_dkc += tl.dot(tl.trans(b_dz.to(dt)), b_qc, input_precision=DOT_PREC) * scale
    b_r += tl.dot(tl.trans(b_ds.to(dt)), b_qc, input_precision=DOT_PREC) * scale
    if IN_WINDOW:
        # [BT_i, BT_j]
        b_da = tl.dot(b_ds.to(dt), b_g.to(dt), input_precision=DOT_PREC)
        b_da = tl.where(o_i[None, :] <= o_i[:, None], b_da, 0.0)
        # [BT_s, BT_j]
        b_dg = tl.dot(tl.trans(b_ds.to(dt)), b_a.to(dt), b_dg, input_precision=DOT_PREC)
        b_dx = b_dg * b_g * (1.0 - b_sg)
        b_dqc += tl.dot(b_da.to(dt), b_vu, input_precision=DOT_PREC) * scale
        b_dvu += tl.dot(tl.trans(b_da.to(dt)), b_qc, input_precision=DOT_PREC) * scale
        b_dqu += tl.dot(b_dx.to(dt), b_ku, input_precision=DOT_PREC) * scale
        b_dku += tl.dot(tl.trans(b_dx.to(dt)), b_qu, input_precision=DOT_PREC) * scale
        tl.store(DQU + o_col, b_dqu, mask=m_sd)
        tl.store(DKU + o_row, b_dku, mask=m_id)
        tl.store(DVU + o_row, b_dvu, mask=m_id)
    tl.store(R + o_col, b_r, mask=m_sd)
    tl.store(DKC + o_col, b_dkc, mask=m_sd)
    tl.store(DVC + o_col, b_dvc, mask=m_sd)
    tl.store(DQC + o_row, b_dqc, mask=m_id)


def launch_bwd(qc, kc, vc, qu, ku, vu, do, lse2, delta, u_end, scratch, grads, scale, window, cfg):
    """Runs the backward wavefront: ``nb`` launches, ``k = nb - 1`` down to 0.

    ``scratch = (u, r)`` and ``grads = (dqc, dkc, dvc, dqu, dku, dvu)`` are float32
    ``[B, H, T, D]`` (any contents: each is written before it is read); ``u_end`` is
    the forward's final U, only read."""
    from .triton_fwd import last_window_step

    b, t, h, d = qc.shape
    bt = cfg["BT"]
    nb = triton.cdiv(t, bt)
    k_last = last_window_step(t, bt, window)
    u, r = scratch
    for k in reversed(range(nb)):
        _bwd_step_kernel[(nb - k, b * h)](
            qc, kc, vc, qu, ku, vu, do, lse2, delta, u_end, u, r, *grads,
            t, h, h // kc.shape[2], h // ku.shape[2], k, k_last, nb, scale, window or 0,
            D=d, BD=max(16, triton.next_power_of_2(d)), BT=bt,
            IN_WINDOW=k <= k_last, USE_WINDOW=window is not None,
            DOT_PREC="ieee" if qc.dtype.itemsize == 4 else "tf32",
            num_warps=cfg["num_warps"], num_stages=1,
        )
