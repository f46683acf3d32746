"""The fused CASTLE decode step over a paged, per-kv-head UQ-KV store: one Triton kernel
that updates each held slot's lookahead vector ``u_j`` in its page and attends with it
in the same pass, and its launcher.

The public function and the plain torch references are in ``paged.py``. The kernel is
``decode_triton.py``'s fused step read through a page table, as ``forgetting/
paged_triton.py`` reads FoX's pages: program ``(split, b * H + h)`` owns kv head ``h``
of sequence ``b``, the ``GROUP = HQ // H`` query heads that read it, and a share of the
head's ``n = lengths[b, h]`` logical slots (the new token's at ``n - 1``); slot ``j``
is row ``j % PS`` of page ``page_table[b, h, j // PS]``. Per tile of slots it

1. looks up each slot's page (a gathered load per slot, so a tile may span pages), loads
   ``u_j`` (float32, ``[P, PS, G, D]``: channel ``g`` is query head ``h * G + g``) and,
   for the slots whose ``u`` changes (``j < n - 1``; SWL: stored position ``pos_j >=
   pos_{n-1} - W``), ``q^U_j``; forms ``u_j += sigmoid(q^U_j . k^U_t * scale) v^U_t``,
   sets the new token's ``u = 0``, and stores back only the changed rows;
2. loads ``k^C_j, v^C_j`` once for the group and runs an online softmax (base 2) over
   ``q^C . k^C_j * scale - SiLU(q^C . u_j * scale)`` with the ``u_j`` just formed.

Each held slot's bytes are read once and ``u`` written once (SWL: only the rows in the
window); no slot at or past a head's length, and no table entry past its pages, is
touched. A split writes a float32 partial ``(acc, m, l)``, merged by the forgetting
decode op's combine kernel; one split writes the output directly. With
``return_key_probs`` the split kernel also writes its base-2 logits to a float32
scratch, and the FoX paged op's probability kernel turns them into probabilities with
the final log-sum-exp, summed over the group.

Products are multiply-and-sum in float32, as in the dense fused step (a matrix-vector
per query head; ``tl.dot`` would pad the group to 16 rows).

The launch is wrapped in the custom op ``lapse::castle_paged_decode`` (it mutates
``u_pages``) so that ``torch.compile(fullgraph=True)`` and CUDA graphs see one opaque
call; the launcher never reads a tensor value back to the host (the number of splits
comes from the shapes).

Legend: B batch, H kv heads, HQ query heads, HU lookahead kv heads, GROUP = HQ // H, D
head dim, P pages, PS page size, MP pages per head in the table, L = MP * PS logical
slots per head; in kernels BG (padded group), BN (slots per tile), BD (padded D).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import LOG2E_TL, tl, triton, triton_jit
from ..forgetting.decode_triton import (
    _PIPELINE_STAGES,
    _choose_num_splits,
    _resident_programs,
    _split_workspace,
    _store_split_result,
)
from ..forgetting.paged_triton import finish_paged_decode
from ..splits import split_program, split_range
from .decode_triton import loop_stages, tile_bytes

# Elements of one [BG, BN, BD] tile: as in decode_triton.py, 2048 float32 keep a
# program's u and q^U tiles in registers at 4 warps.
_TILE_ELEMENTS = 2048


@triton_jit
def _castle_paged_split_kernel(
    q_c,
    k_u,
    v_u,
    k_pages,
    v_pages,
    u_pages,
    qu_pages,
    pos_pages,
    page_table,
    lengths,
    acc_part,
    m_part,
    l_part,
    s_part,
    o,
    lse,
    scale,
    window,
    num_splits,
    n_slots,
    stride_qb,
    stride_qh,
    stride_kub,
    stride_kuh,
    stride_vub,
    stride_vuh,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    stride_up,
    stride_us,
    stride_ug,
    stride_qup,
    stride_qus,
    stride_qug,
    stride_pp,
    stride_ps,
    stride_tb,
    stride_th,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_U: tl.constexpr,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BG: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    RETURN_PROBS: tl.constexpr,
    IS_SINGLE_SPLIT: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    # o_hq [BG]: the query heads of kv head i_h; o_g [BG] their channels in the pools
    i_s, i_b, i_h, o_hq, o_d, m_g, m_d = split_program(H, GROUP, D, BG, BD)
    o_g = o_hq - i_h * GROUP
    m_gd = m_g[:, None] & m_d[None, :]  # [BG, BD]
    o_hu = o_hq // GROUP_U  # [BG] their lookahead kv heads

    n = tl.load(lengths + i_b * stride_lb + i_h * stride_lh).to(tl.int64)
    t = n - 1  # the new token's logical slot
    start, end = split_range(0, n, i_s, num_splits, BN)
    p_table = page_table + i_b * stride_tb + i_h * stride_th
    if USE_WINDOW:
        # the window goes by stored positions: under eviction a slot is not its position
        page_t = tl.load(p_table + t // PAGE_SIZE).to(tl.int64)
        pos_t = tl.load(pos_pages + page_t * stride_pp + (t % PAGE_SIZE) * stride_ps).to(tl.int64)
        pos_lo = pos_t - window  # the first position whose u the token changes

    p_q = q_c + i_b * stride_qb + o_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_gd, other=0.0).to(tl.float32)  # [BG, BD]
    p_ku = k_u + i_b * stride_kub + o_hu[:, None] * stride_kuh + o_d[None, :]
    b_ku = tl.load(p_ku, mask=m_gd, other=0.0).to(tl.float32)  # [BG, BD]
    p_vu = v_u + i_b * stride_vub + o_hu[:, None] * stride_vuh + o_d[None, :]
    b_vu = tl.load(p_vu, mask=m_gd, other=0.0).to(tl.float32)  # [BG, BD]
    o_srow = ((i_b * H + i_h) * GROUP + o_g) * n_slots  # [BG] rows of s_part [B, H, GROUP, L]

    b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BG], dtype=tl.float32)
    b_acc = tl.zeros([BG, BD], dtype=tl.float32)
    for j0 in tl.range(start, end, BN, num_stages=LOOP_STAGES):  # every load pipelined
        o_j = j0 + tl.arange(0, BN)  # [BN] logical slots
        m_j = o_j < end
        # table entries past the head's pages may hold anything: only slots < n look one up
        b_page = tl.load(p_table + o_j // PAGE_SIZE, mask=m_j, other=0).to(tl.int64)  # [BN]
        o_off = o_j % PAGE_SIZE  # [BN]
        m_upd = m_j & (o_j < t)  # slots whose u changes
        if USE_WINDOW:
            b_pos = tl.load(pos_pages + b_page * stride_pp + o_off * stride_ps, mask=m_upd, other=0)
            m_upd = m_upd & (b_pos.to(tl.int64) >= pos_lo)
        m_gjd = m_gd[:, None, :] & m_j[None, :, None]  # [BG, BN, BD]
        m_upd3 = m_gd[:, None, :] & m_upd[None, :, None]  # [BG, BN, BD]

        p_u = (u_pages + b_page[None, :, None] * stride_up + o_off[None, :, None] * stride_us
               + o_g[:, None, None] * stride_ug + o_d[None, None, :])
        b_u = tl.load(p_u, mask=m_gjd, other=0.0).to(tl.float32)  # [BG, BN, BD]
        p_qu = (qu_pages + b_page[None, :, None] * stride_qup + o_off[None, :, None] * stride_qus
                + o_g[:, None, None] * stride_qug + o_d[None, None, :])
        b_qu = tl.load(p_qu, mask=m_upd3, other=0.0).to(tl.float32)  # [BG, BN, BD]
        b_gate = tl.sigmoid(tl.sum(b_qu * b_ku[:, None, :], axis=2) * scale)  # [BG, BN]
        b_gate = tl.where(m_upd[None, :], b_gate, 0.0)
        # u_t = 0 replaces whatever the new token's slot held (NaN included)
        b_u = tl.where((o_j == t)[None, :, None], 0.0, b_u + b_gate[:, :, None] * b_vu[:, None, :])
        m_write = m_upd | (o_j == t)
        b_u_held = b_u.to(u_pages.dtype.element_ty)
        tl.store(p_u, b_u_held, mask=m_gd[:, None, :] & m_write[None, :, None])
        b_u = b_u_held.to(tl.float32)  # attend with u as stored, as the reference does

        p_k = k_pages + b_page[:, None] * stride_kp + o_off[:, None] * stride_ks + o_d[None, :]
        p_v = v_pages + b_page[:, None] * stride_vp + o_off[:, None] * stride_vs + o_d[None, :]
        b_k = tl.load(p_k, mask=m_j[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BN, BD]
        b_v = tl.load(p_v, mask=m_j[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BN, BD]
        b_sc = tl.sum(b_q[:, None, :] * b_k[None, :, :], axis=2) * scale  # [BG, BN]
        b_su = tl.sum(b_q[:, None, :] * b_u, axis=2) * scale  # [BG, BN]
        m_gj = m_g[:, None] & m_j[None, :]  # [BG, BN]
        b_s = (b_sc - b_su * tl.sigmoid(b_su)) * LOG2E_TL
        b_s = tl.where(m_gj, b_s, float("-inf"))
        if RETURN_PROBS:
            tl.store(s_part + o_srow[:, None] + o_j[None, :], b_s, mask=m_gj)

        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))  # [BG]
        # padded group rows keep m = -inf; exp2(-inf - 0) = 0 keeps them NaN-free
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_m_safe)  # [BG]
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BG, BN]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.sum(b_p[:, :, None] * b_v[None, :, :], axis=1)
        b_m = b_m_new

    _store_split_result(b_acc, b_m, b_l, o, lse, acc_part, m_part, l_part, i_b, i_s, o_hq, o_d,
                        m_g, m_d, num_splits, stride_ob, stride_oh, H * GROUP, D, IS_SINGLE_SPLIT)


def _launch_options(q_c: Tensor, k_pages: Tensor, u_pages: Tensor, qu_pages: Tensor, group: int,
                    n_slots: int, programs: int, num_splits: int | None) -> tuple[int, dict]:
    """``(num_splits, options)``: tiles of about ``_TILE_ELEMENTS`` per ``[BG, BN, BD]``
    (``decode_triton.py``'s defaults; nothing is tuned for pages yet), and as many splits
    as fit in one wave of resident programs, each >= 256 slots of the ``n_slots`` a head
    can hold (``num_splits`` chosen when None; shapes only, no host read)."""
    block_d = max(16, triton.next_power_of_2(q_c.shape[-1]))
    block_g = triton.next_power_of_2(group)
    block_n = max(16, min(64, _TILE_ELEMENTS // (block_g * block_d)))
    tile = tile_bytes(block_n, block_d, block_g, u_pages, qu_pages, k_pages)
    if num_splits is None:
        num_splits = _choose_num_splits(n_slots, programs, _resident_programs(q_c.device, tile))
    # large groups (GQA) cannot shrink BN below 16: more warps share their tiles' registers
    num_warps = 4 if block_g * block_n * block_d <= 2 * _TILE_ELEMENTS else 8
    options = dict(BG=block_g, BN=block_n, BD=block_d, IS_SINGLE_SPLIT=num_splits == 1,
                   num_warps=num_warps, num_stages=_PIPELINE_STAGES,
                   LOOP_STAGES=loop_stages(tile, device=q_c.device))
    return num_splits, options


def launch_castle_paged_decode(
    q_c: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    u_pages: Tensor,
    qu_pages: Tensor,
    pos_pages: Tensor | None,
    page_table: Tensor,
    lengths: Tensor,
    scale: float,
    window: int | None,
    o: Tensor,
    lse: Tensor,
    key_probs: Tensor | None = None,
    num_splits: int | None = None,
    workspace: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> None:
    """Updates ``u_pages`` in place and writes ``o`` [B, HQ, D], ``lse`` [B, HQ] float32
    (natural log) and, when given, ``key_probs`` [B, H, L] float32 (``o`` and
    ``key_probs`` contiguous). Every tensor must be contiguous in its last dim
    (``u_pages`` is written in place, so it is not copied here).

    ``workspace`` (``acc [B, HQ, splits, D]``, ``m`` and ``l`` ``[B, HQ, splits]``,
    ``s [B, H, GROUP, L]``, all float32) can be passed in so tests can poison it with NaN.
    """
    b, hq, d = q_c.shape
    _, h, max_pages = page_table.shape
    page_size = k_pages.shape[1]
    n_slots = max_pages * page_size
    group = hq // h
    num_splits, options = _launch_options(q_c, k_pages, u_pages, qu_pages, group, n_slots, b * h,
                                          num_splits)
    return_probs = key_probs is not None
    if workspace is None:
        acc_part, m_part, l_part = _split_workspace(q_c, num_splits)
        # without key probabilities the logits are not kept: an unread placeholder
        s_part = q_c.new_empty(b, h, group, n_slots, dtype=torch.float32) if return_probs else m_part
    else:
        acc_part, m_part, l_part, s_part = workspace
    # without a window the kernel never reads positions: any int32 tensor does
    pos = pos_pages if window is not None else lengths
    pos_strides = (pos_pages.stride(0), pos_pages.stride(1)) if window is not None else (0, 0)
    _castle_paged_split_kernel[(num_splits, b * h)](
        q_c,
        k_u,
        v_u,
        k_pages,
        v_pages,
        u_pages,
        qu_pages,
        pos,
        page_table,
        lengths,
        acc_part,
        m_part,
        l_part,
        s_part,
        o,
        lse,
        scale,
        0 if window is None else window,
        num_splits,
        n_slots,
        q_c.stride(0),
        q_c.stride(1),
        k_u.stride(0),
        k_u.stride(1),
        v_u.stride(0),
        v_u.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        v_pages.stride(0),
        v_pages.stride(1),
        u_pages.stride(0),
        u_pages.stride(1),
        u_pages.stride(2),
        qu_pages.stride(0),
        qu_pages.stride(1),
        qu_pages.stride(2),
        *pos_strides,
        page_table.stride(0),
        page_table.stride(1),
        lengths.stride(0),
        lengths.stride(1),
        o.stride(0),
        o.stride(1),
        H=h,
        GROUP=group,
        GROUP_U=hq // k_u.shape[1],
        D=d,
        PAGE_SIZE=page_size,
        USE_WINDOW=window is not None,
        RETURN_PROBS=return_probs,
        **options,
    )
    finish_paged_decode(acc_part, m_part, l_part, s_part, o, lse, lengths, key_probs, num_splits,
                        options["BD"], group, return_probs)


@torch.library.custom_op("lapse::castle_paged_decode", mutates_args=("u_pages",))
def triton_castle_paged_decode(
    q_c: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    u_pages: Tensor,
    qu_pages: Tensor,
    pos_pages: Tensor | None,
    page_table: Tensor,
    lengths: Tensor,
    scale: float,
    window: int | None,
    return_key_probs: bool,
    num_splits: int | None,
) -> tuple[Tensor, Tensor]:
    """``(o [B, HQ, D], key_probs)`` of :func:`launch_castle_paged_decode` in fresh
    tensors, ``u_pages`` updated in place, as one operator that ``torch.compile`` does not
    trace into (inputs already checked). ``key_probs`` is ``[B, H, L]`` float32 with
    ``return_key_probs``, else empty ``[0]``."""
    q_c, k_u, v_u, k_pages, v_pages, qu_pages, page_table = (
        x if x.stride(-1) == 1 else x.contiguous()
        for x in (q_c, k_u, v_u, k_pages, v_pages, qu_pages, page_table)
    )
    b, hq, _ = q_c.shape
    h, max_pages = page_table.shape[1:]
    o = q_c.new_empty(q_c.shape)  # contiguous, as the kernel's stores assume
    lse = q_c.new_empty(b, hq, dtype=torch.float32)
    n_slots = max_pages * k_pages.shape[1]
    key_probs = q_c.new_empty((b, h, n_slots) if return_key_probs else (0,), dtype=torch.float32)
    launch_castle_paged_decode(q_c, k_u, v_u, k_pages, v_pages, u_pages, qu_pages, pos_pages,
                               page_table, lengths, scale, window, o, lse,
                               key_probs if return_key_probs else None, num_splits)
    return o, key_probs


@triton_castle_paged_decode.register_fake
def _(q_c, k_u, v_u, k_pages, v_pages, u_pages, qu_pages, pos_pages, page_table, lengths, scale,
      window, return_key_probs, num_splits):
    b, h, max_pages = page_table.shape
    shape = (b, h, max_pages * k_pages.shape[1]) if return_key_probs else (0,)
    return q_c.new_empty(q_c.shape), q_c.new_empty(shape, dtype=torch.float32)
