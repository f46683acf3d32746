"""Triton kernels of one decoding step over a paged, per-head KV store, and their launcher.

The public function and the plain torch reference are in ``paged.py``. The kernels follow
``decode_triton.py`` (split-K flash-decoding): program ``(split, b * H + h)`` owns one key
head and the ``GROUP = HQ // H`` query heads that read it and runs an online softmax
(base 2) over its share of the head's ``lengths[b, h]`` logical slots, finding each
slot's page through the page table (a gathered load per key row, so a tile may span
pages of any size); the online softmax step, the epilogue, the launch options and the
kernel that merges the splits are ``decode_triton``'s. With ``return_key_probs`` the
split kernel also writes its base-2 logits to a float32 scratch, and a third kernel
turns them into probabilities with the final log-sum-exp and sums them over the group
(what H2O/A2SF accumulate): re-reading ``G`` floats per slot is cheaper than re-reading
the key (``2 D`` bytes in 16 bits).

The launch is wrapped in the custom op ``lapse::forgetting_paged_decode`` so that
``torch.compile(fullgraph=True)`` and CUDA graphs see one opaque call with known output
shapes; the launcher never reads a tensor value back to the host.

Legend: B batch, H key/value heads, HQ query heads, GROUP = HQ // H, D head dim, P pages,
PS page size, MP pages per head in the table, L = MP * PS logical slots per head; in
kernels BG (padded group rows), BN (keys per tile), BD (padded D), BL (slots per
probability tile).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import LOG2E, LOG2E_TL, tl, triton, triton_jit
from .decode_triton import (
    _add_fox_bias,
    _combine_splits,
    _online_softmax_update,
    _split_launch,
    _split_workspace,
    _store_split_result,
)

_BLOCK_PROBS = 256


# Launch options of the paged split kernel at D <= 64 in 16 bits, unless a [BG, BN] tile of
# the FoX bias is computed (bias with GQA): measured on an H100 over BN {32, 64, 128} x
# warps {2, 4, 8} x stages {2, 3, 4} at 8 x 4k, 4 x 16k and 1 x 4k, 12 heads of 64, pages
# of 16 scattered. The best everywhere with the bias, 1.26-1.44x faster than the
# launcher's default (BN 64, 4 warps, 3 stages): 8 x 4k 42.6 against 61.3 us, 4 x 16k 77.4
# against 109.5 us; within 1-6% of the best without it.
_PAGED_TUNED = dict(BN=128, num_warps=4, num_stages=2)


@triton_jit
def _paged_split_kernel(
    q,
    k_pages,
    v_pages,
    c_pages,
    c_query,
    page_table,
    lengths,
    acc_part,
    m_part,
    l_part,
    s_part,
    o,
    lse,
    scale_log2,
    num_splits,
    n_slots,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    stride_cp,
    stride_cs,
    stride_cg,
    stride_cqb,
    stride_cqh,
    stride_tb,
    stride_th,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BG: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_BIAS: tl.constexpr,
    RETURN_PROBS: tl.constexpr,
    IS_SINGLE_SPLIT: tl.constexpr,
):
    i_s = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H

    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    m_g = o_g < GROUP
    m_d = o_d < D
    o_hq = i_h * GROUP + o_g  # [BG] the query heads of key head i_h

    n = tl.load(lengths + i_b * stride_lb + i_h * stride_lh).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(n, num_splits), BN) * BN
    start = i_s * chunk
    end = tl.minimum(start + chunk, n)

    p_q = q + i_b * stride_qb + o_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)  # [BG, BD]
    if USE_BIAS:
        # c_t in c's dtype: the difference is taken before any rounding to float32.
        if GROUP == 1:  # one real row of BG: c as a [BN] vector (as in decode_triton.py)
            b_ct = tl.load(c_query + i_b * stride_cqb + i_h * stride_cqh)  # []
        else:
            b_ct = tl.load(c_query + i_b * stride_cqb + o_hq * stride_cqh, mask=m_g, other=0.0)  # [BG]
    p_table = page_table + i_b * stride_tb + i_h * stride_th
    o_srow = (i_bh * GROUP + o_g) * n_slots  # [BG] rows of s_part [B, H, GROUP, L]

    b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BG], dtype=tl.float32)
    b_acc = tl.zeros([BG, BD], dtype=tl.float32)
    for j0 in range(start, end, BN):
        o_j = j0 + tl.arange(0, BN)  # [BN] logical slots
        m_j = o_j < end
        # Table entries past the head's pages may hold anything: only slots < n look one up.
        b_page = tl.load(p_table + o_j // PAGE_SIZE, mask=m_j, other=0).to(tl.int64)  # [BN]
        o_off = o_j % PAGE_SIZE  # [BN]
        p_k = k_pages + b_page[:, None] * stride_kp + o_off[:, None] * stride_ks + o_d[None, :]
        p_v = v_pages + b_page[:, None] * stride_vp + o_off[:, None] * stride_vs + o_d[None, :]
        b_k = tl.load(p_k, mask=m_j[:, None] & m_d[None, :], other=0.0)  # [BN, BD]
        b_v = tl.load(p_v, mask=m_j[:, None] & m_d[None, :], other=0.0)  # [BN, BD]
        m_gj = m_g[:, None] & m_j[None, :]  # [BG, BN]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * scale_log2  # [BG, BN]
        if USE_BIAS:
            if GROUP == 1:  # [BN]
                b_c = tl.load(c_pages + b_page * stride_cp + o_off * stride_cs, mask=m_j, other=0.0)
            else:
                p_c = (c_pages + b_page[None, :] * stride_cp + o_off[None, :] * stride_cs
                       + o_g[:, None] * stride_cg)
                b_c = tl.load(p_c, mask=m_gj, other=0.0)  # [BG, BN]
            b_s = _add_fox_bias(b_s, b_ct, b_c, GROUP == 1)
        b_s = tl.where(m_gj, b_s, float("-inf"))
        if RETURN_PROBS:
            tl.store(s_part + o_srow[:, None] + o_j[None, :], b_s, mask=m_gj)
        b_m, b_l, b_acc = _online_softmax_update(b_s, b_v, b_m, b_l, b_acc, DOT_PRECISION)

    _store_split_result(b_acc, b_m, b_l, o, lse, acc_part, m_part, l_part, i_b, i_s, o_hq, o_d,
                        m_g, m_d, num_splits, stride_ob, stride_oh, H * GROUP, D, IS_SINGLE_SPLIT)


@triton_jit
def _paged_key_probs_kernel(
    s_part,
    lse,
    lengths,
    key_probs,
    n_slots,
    stride_lb,
    stride_lh,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    BG: tl.constexpr,
    BL: tl.constexpr,
):
    i_l = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H

    o_g = tl.arange(0, BG)
    m_g = o_g < GROUP
    o_j = i_l * BL + tl.arange(0, BL)  # [BL]
    n = tl.load(lengths + i_b * stride_lb + i_h * stride_lh).to(tl.int64)
    m_j = o_j < n
    b_lse = tl.load(lse + i_b * (H * GROUP) + i_h * GROUP + o_g, mask=m_g, other=0.0)  # [BG]
    p_s = s_part + (i_bh * GROUP + o_g[:, None]) * n_slots + o_j[None, :]
    # Only slots below the length were written; the rest read as -inf (probability 0).
    b_s = tl.load(p_s, mask=m_g[:, None] & m_j[None, :], other=float("-inf"))  # [BG, BL]
    b_p = tl.exp2(b_s - b_lse[:, None] * LOG2E_TL)  # [BG, BL]
    tl.store(key_probs + i_bh * n_slots + o_j, tl.sum(b_p, axis=0), mask=o_j < n_slots)


def launch_paged_decode(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_table: Tensor,
    lengths: Tensor,
    c_pages: Tensor | None,
    c_query: Tensor | None,
    scale: float,
    o: Tensor,
    lse: Tensor,
    key_probs: Tensor | None = None,
    num_splits: int | None = None,
    workspace: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    config: dict | None = None,
) -> None:
    """Writes ``o`` [B, HQ, D], ``lse`` [B, HQ] float32 (natural log) and, when given,
    ``key_probs`` [B, H, L] float32 in place (``o`` and ``key_probs`` contiguous).

    ``config``: launch options (``BN``, ``num_warps``, ``num_stages``) for the split
    kernel (to time other options); by default the
    measured ``_PAGED_TUNED`` where it applies.

    ``workspace`` (``acc [B, HQ, splits, D]``, ``m`` and ``l`` ``[B, HQ, splits]``,
    ``s [B, H, GROUP, L]``, all float32) can be passed in so tests can poison it with NaN.
    """
    b, hq, d = q.shape
    _, h, max_pages = page_table.shape
    page_size = k_pages.shape[1]
    n_slots = max_pages * page_size
    group = hq // h
    q, k_pages, v_pages, page_table = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_pages, v_pages, page_table)
    )
    if config is None and d <= 64 and q.element_size() == 2 and not (c_pages is not None and group > 1):
        config = _PAGED_TUNED
    num_splits, options = _split_launch(q, group, n_slots, b * h, num_splits, config)
    return_probs = key_probs is not None
    if workspace is None:
        acc_part, m_part, l_part = _split_workspace(q, num_splits)
        # without key probabilities the logits are not kept: an unread placeholder
        s_part = q.new_empty(b, h, group, n_slots, dtype=torch.float32) if return_probs else m_part
    else:
        acc_part, m_part, l_part, s_part = workspace
    use_bias = c_pages is not None
    # unread placeholders for softmax attention
    c_pages_ = c_pages if use_bias else q
    c_query_ = c_query if use_bias else q
    c_strides = (c_pages.stride(0), c_pages.stride(1), c_pages.stride(2)) if use_bias else (0, 0, 0)
    cq_strides = (c_query.stride(0), c_query.stride(1)) if use_bias else (0, 0)
    _paged_split_kernel[(num_splits, b * h)](
        q,
        k_pages,
        v_pages,
        c_pages_,
        c_query_,
        page_table,
        lengths,
        acc_part,
        m_part,
        l_part,
        s_part,
        o,
        lse,
        scale * LOG2E,
        num_splits,
        n_slots,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        v_pages.stride(0),
        v_pages.stride(1),
        *c_strides,
        *cq_strides,
        page_table.stride(0),
        page_table.stride(1),
        lengths.stride(0),
        lengths.stride(1),
        o.stride(0),
        o.stride(1),
        H=h,
        GROUP=group,
        D=d,
        PAGE_SIZE=page_size,
        USE_BIAS=use_bias,
        RETURN_PROBS=return_probs,
        **options,
    )
    finish_paged_decode(acc_part, m_part, l_part, s_part, o, lse, lengths, key_probs, num_splits,
                        options["BD"], group, return_probs)


def finish_paged_decode(
    acc_part: Tensor,
    m_part: Tensor,
    l_part: Tensor,
    s_part: Tensor,
    o: Tensor,
    lse: Tensor,
    lengths: Tensor,
    key_probs: Tensor | None,
    num_splits: int,
    block_d: int,
    group: int,
    return_probs: bool,
) -> None:
    """After a paged split-K pass (FoX's here, CASTLE's in ``ops/castle``): the splits
    combined into ``o`` and ``lse``, then, with ``return_probs``, each slot's probability
    summed over the group, from the split pass's scaled scores ``s_part`` and the final
    log-sum-exp."""
    _combine_splits(acc_part, m_part, l_part, o, lse, num_splits, block_d)
    if return_probs:
        b, h, n_slots = key_probs.shape
        _paged_key_probs_kernel[(triton.cdiv(n_slots, _BLOCK_PROBS), b * h)](
            s_part,
            lse,
            lengths,
            key_probs,
            n_slots,
            lengths.stride(0),
            lengths.stride(1),
            H=h,
            GROUP=group,
            BG=triton.next_power_of_2(group),
            BL=_BLOCK_PROBS,
            num_warps=4,
        )


@torch.library.custom_op("lapse::forgetting_paged_decode", mutates_args=())
def triton_paged_decode(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_table: Tensor,
    lengths: Tensor,
    c_pages: Tensor | None,
    c_query: Tensor | None,
    scale: float,
    return_key_probs: bool,
    num_splits: int | None,
) -> tuple[Tensor, Tensor]:
    """``(o [B, HQ, D], key_probs)`` of :func:`launch_paged_decode` in fresh tensors, as
    one operator that ``torch.compile`` does not trace into (inputs already checked).
    ``key_probs`` is ``[B, H, L]`` float32 with ``return_key_probs``, else empty ``[0]``."""
    b, hq, _ = q.shape
    h, max_pages = page_table.shape[1:]
    o = q.new_empty(q.shape)  # contiguous, as the kernel's stores assume
    lse = q.new_empty(b, hq, dtype=torch.float32)
    if return_key_probs:
        key_probs = q.new_empty(b, h, max_pages * k_pages.shape[1], dtype=torch.float32)
    else:
        key_probs = q.new_empty(0, dtype=torch.float32)
    launch_paged_decode(q, k_pages, v_pages, page_table, lengths, c_pages, c_query, scale, o,
                        lse, key_probs if return_key_probs else None, num_splits)
    return o, key_probs


@triton_paged_decode.register_fake
def _(q, k_pages, v_pages, page_table, lengths, c_pages, c_query, scale, return_key_probs,
      num_splits):
    b, h, max_pages = page_table.shape
    o = q.new_empty(q.shape)
    if not return_key_probs:
        return o, q.new_empty(0, dtype=torch.float32)
    return o, q.new_empty(b, h, max_pages * k_pages.shape[1], dtype=torch.float32)
