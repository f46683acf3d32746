"""Forward kernel of CASTLE: one wavefront step of the blocked algorithm (SPEC section 5).

The sequence is cut into blocks of ``BT`` positions. Step ``k`` (one launch) handles the
block pairs ``(I, J) = (J + k, J)`` for every ``J`` at once: query block ``I`` against
key block ``J``. Per pair, with ``U_J`` the lookahead vectors of block ``J``'s rows
before block ``I`` (the SPEC's ``D[:, T_J]``, float32, ``[BT, D]``)::

    S^U = Q^C_I U_J^T * scale + A_I G^T                    [BT_i, BT_s]
    A_I = (Q^C_I V^U_I^T * scale) * 1[j <= i]              [BT_i, BT_j]
    G   = sigmoid(Q^U_J K^U_I^T * scale) * 1[s < j (<= s + W)]    [BT_s, BT_j]
    Z   = Q^C_I K^C_J^T * scale - SiLU(S^U)   (causal mask on the diagonal pair)
    U_J += G V^U_I                                          (for the pair (I + 1, J))

so the update of ``D`` uses the same ``G`` as the intra-block term, one pair later than
the SPEC writes it. Every program owns column ``J`` (``U_J``) and row ``I`` (the online
softmax state ``m, l, acc`` of block ``I``); within a step no two programs share
either, and launches order the steps, so there are no atomics and no locks. Row ``I``
meets its columns from the diagonal (``k = 0``) to ``J = 0`` (``k = I``), whose
program normalises and writes the output and the log-sum-exp.

Under SWL the pairs of a step are all inside the window or all outside it (``j - s`` is
at least ``(k - 1) BT + 1``): outside, ``G = 0`` and ``U_J`` is final, so those launches
compile without the lookahead branch (``IN_WINDOW``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..backend import LOG2E_TL
from .triton_parallel import lookahead_tile


@triton.jit
def _fwd_step_kernel(
    QC, KC, VC, QU, KU, VU, U, ACC, M, L, O, LSE,
    T, H, GROUP_C, GROUP_U, k, scale, window,
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

    # [BT, BD] column block J
    b_kc = tl.load(KC + ((i_b * T + o_s[:, None]) * hc + i_hc) * D + o_d[None, :], mask=m_sd, other=0.0)
    b_vc = tl.load(VC + ((i_b * T + o_s[:, None]) * hc + i_hc) * D + o_d[None, :], mask=m_sd, other=0.0)
    p_u = U + (i_bh * T + o_s[:, None]) * D + o_d[None, :]
    if k == 0:
        b_u = tl.zeros([BT, BD], dtype=tl.float32)
    else:
        b_u = tl.load(p_u, mask=m_sd, other=0.0)
    # [BT, BD] row block I
    b_qc = tl.load(QC + ((i_b * T + o_i[:, None]) * H + i_h) * D + o_d[None, :], mask=m_id, other=0.0)
    dt = b_qc.dtype

    # [BT_i, BT_s]
    b_sc = tl.dot(b_qc, tl.trans(b_kc), input_precision=DOT_PREC) * scale
    b_su = tl.dot(b_qc, tl.trans(b_u.to(dt)), input_precision=DOT_PREC) * scale
    if IN_WINDOW:
        b_qu = tl.load(QU + ((i_b * T + o_s[:, None]) * H + i_h) * D + o_d[None, :], mask=m_sd,
                       other=0.0)
        # [BT_s, BT_j] G, [BT_i, BT_j] A
        b_g, _, b_a, _, b_vu = lookahead_tile(b_qc, b_qu, KU, VU, i_b, i_hu, hu, o_i, o_s, o_d,
                                              m_i, m_d, T, scale, window, D, USE_WINDOW, DOT_PREC)
        b_su += tl.dot(b_a.to(dt), tl.trans(b_g.to(dt)), input_precision=DOT_PREC)
        # [BT_s, BD]
        b_u = tl.dot(b_g.to(dt), b_vu, b_u, input_precision=DOT_PREC)
        tl.store(p_u, b_u, mask=m_sd)

    # [BT_i, BT_s] base-2 logits
    b_z = (b_sc - b_su * tl.sigmoid(b_su)) * LOG2E_TL
    b_z = tl.where(o_s[None, :] <= o_i[:, None], b_z, float("-inf"))
    p_m = M + i_bh * T + o_i
    p_l = L + i_bh * T + o_i
    p_acc = ACC + (i_bh * T + o_i[:, None]) * D + o_d[None, :]
    if k == 0:
        b_m = tl.full([BT], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([BT], dtype=tl.float32)
        b_acc = tl.zeros([BT, BD], dtype=tl.float32)
    else:
        b_m = tl.load(p_m, mask=m_i, other=0.0)
        b_l = tl.load(p_l, mask=m_i, other=1.0)
        b_acc = tl.load(p_acc, mask=m_id, other=0.0)
    # every row sees a finite logit on the diagonal pair (its own key), so m_new is finite
    m_new = tl.maximum(b_m, tl.max(b_z, 1))
    b_p = tl.math.exp2(b_z - m_new[:, None])
    alpha = tl.math.exp2(b_m - m_new)
    b_l = b_l * alpha + tl.sum(b_p, 1)
    b_acc = tl.dot(b_p.to(dt), b_vc, b_acc * alpha[:, None], input_precision=DOT_PREC)
    if i_j == 0:
        b_o = b_acc / b_l[:, None]
        tl.store(O + ((i_b * T + o_i[:, None]) * H + i_h) * D + o_d[None, :],
                 b_o.to(O.dtype.element_ty), mask=m_id)
        tl.store(LSE + i_bh * T + o_i, m_new + tl.math.log2(b_l), mask=m_i)
    else:
        tl.store(p_m, m_new, mask=m_i)
        tl.store(p_l, b_l, mask=m_i)
        tl.store(p_acc, b_acc, mask=m_id)


def block_config(d: int, interpret: bool, backward: bool = False) -> dict:
    """Block size and warps by head dim; the forward and the backward may tile
    differently (they share only per-position tensors: lse and the final U).

    Not tuned on a GPU yet. The forward holds two float32 ``[BT, D]`` tiles (U, acc), so
    64-position blocks; the backward holds eight (U, R and six gradient accumulators),
    so 32-position blocks keep it within the register file at D <= 128. The interpreter
    gets 16-position blocks, so small test shapes span several wavefront steps.
    """
    if interpret:
        return dict(BT=16, num_warps=1)
    if backward:
        return dict(BT=32, num_warps=4 if d <= 64 else 8)
    if d <= 64:
        return dict(BT=64, num_warps=4)
    if d <= 128:
        return dict(BT=64, num_warps=8)
    return dict(BT=32, num_warps=8)


def last_window_step(t: int, bt: int, window: int | None) -> int:
    """The last wavefront step whose pairs meet inside the lookahead window: pairs of step
    ``k`` have ``j - s >= (k - 1) bt + 1``, so steps past ``(W - 1) // bt + 1`` have G = 0."""
    nb = triton.cdiv(t, bt)
    return nb - 1 if window is None else min(nb - 1, (window - 1) // bt + 1)


def launch_fwd(qc, kc, vc, qu, ku, vu, scale, window, o, lse2, u, acc, m, l, cfg):
    """Runs the forward wavefront: ``nb`` launches. Inputs ``[B, T, H*, D]`` contiguous;
    writes o ``[B, T, H, D]``, base-2 lse ``[B, H, T]`` and the final ``U`` ``[B, H, T, D]``
    float32; ``acc, m, l`` are scratch of the shapes of ``u`` and ``lse2``."""
    b, t, h, d = qc.shape
    bt = cfg["BT"]
    nb = triton.cdiv(t, bt)
    k_last = last_window_step(t, bt, window)
    for k in range(nb):
        _fwd_step_kernel[(nb - k, b * h)](
            qc, kc, vc, qu, ku, vu, u, acc, m, l, o, lse2,
            t, h, h // kc.shape[2], h // ku.shape[2], k, scale, window or 0,
            D=d, BD=max(16, triton.next_power_of_2(d)), BT=bt,
            IN_WINDOW=k <= k_last, USE_WINDOW=window is not None,
            DOT_PREC="ieee" if qc.dtype.itemsize == 4 else "tf32",
            num_warps=cfg["num_warps"], num_stages=1,
        )
