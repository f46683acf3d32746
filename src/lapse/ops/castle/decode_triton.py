"""The fused UQ-KV decode step of CASTLE: one Triton kernel that updates each held slot's
lookahead vector ``u_s`` and attends with it in the same pass, and its launcher.

The public function and the plain torch reference are in ``decode.py``. Split-K
flash-decoding: program ``(split, b * HC + h)`` owns causal kv head ``h`` and the
``GROUP = H // HC`` query heads that read it, and a share of the slots ``[0, t]`` of
sequence ``b`` (``t = cache_seqlens[b] - 1``, the new token). Per tile of slots it

1. loads ``u_s`` (float32) and, for the slots whose ``u`` changes (``s < t``; SWL
   ``t - W <= s < t``), ``q^U_s``; forms ``u_s += sigmoid(q^U_s . k^U_t * scale) v^U_t``,
   sets ``u_t = 0``, and stores back only the changed slots;
2. loads ``k^C_s, v^C_s`` once for the group and runs an online softmax (base 2) over
   ``q^C . k^C_s * scale - SiLU(q^C . u_s * scale)`` with the ``u_s`` just formed.

So each held slot's bytes are read once and ``u`` written once (SWL: only the ``W``
changing rows are written, and ``q^U`` read only there), and no slot at or past a
sequence's length is touched. A split writes a float32 partial ``(acc, m, l)``, merged by
the combine kernel of the forgetting decode op; one split writes the output directly.

With ``IS_DEFERRED`` (the deferred step, ``pending`` ring of ``M`` entries) step 1 adds,
instead of the new token's term, the terms of every pending token ``p_i <= t`` whose
slot ``s < p_i`` (SWL: ``p_i - W <= s``) it reaches, in position order, and stores ``u``
only on the sequence's fold step (``t mod M = M - 1``; ``u_t = 0`` at every step). The
kernel pushes the token into entry ``t mod M`` itself (split 0's programs; every program
takes that entry from ``k_u, v_u``, so none reads what another writes), so the step
stays one launch; the ring's few rows are re-read per tile from cache.

Products are multiply-and-sum in float32 (a matrix-vector per query head: the step is
bound by memory, and ``tl.dot`` would pad the group to 16 rows).

The launch is wrapped in the custom op ``lapse::castle_decode`` (it mutates ``u_cache``)
so that ``torch.compile(fullgraph=True)`` and CUDA graphs see one opaque call; the
launcher never reads a tensor value back to the host.

Legend: B batch, S capacity, H query heads, HC causal kv heads, HU lookahead kv heads,
GROUP = H // HC, D head dim; in kernels BG (padded group), BN (slots per tile), BD
(padded D).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import LOG2E_TL, tl, triton, triton_jit
from ..forgetting.decode_triton import (
    _PIPELINE_STAGES,
    _choose_num_splits,
    _combine_splits,
    _resident_programs,
    _split_workspace,
    _store_split_result,
)
from ..splits import split_program, split_range

# Elements of one [BG, BN, BD] tile: 2048 float32 keep a program's u and q^U tiles in
# registers at 4 warps.
_TILE_ELEMENTS = 2048
# Tiles in flight per program: the slot loop's software pipeline (tl.range's num_stages;
# 1 issues each tile's loads only when the loop reaches it), as many as fit in 70% of
# the shared memory a program may have (227 KiB on an H100: _PIPELINE_SMEM; 99 KiB on
# an RTX 4090). The tile's bytes overestimate what Triton keeps there (bf16 full CASTLE
# at 64-slot tiles: 120 KiB counted for 3 stages, 33 KiB compiled), so this errs safe.
_LOOP_STAGES = 3
_PIPELINE_SMEM = 160 * 1024


def tile_bytes(block_n: int, block_d: int, block_g: int, u: Tensor, q_u: Tensor, k_c: Tensor) -> int:
    """Bytes of one tile of slots: ``u`` and ``q^U`` for the group's heads, ``k^C, v^C``."""
    return block_n * block_d * (block_g * (u.element_size() + q_u.element_size()) + 2 * k_c.element_size())


def loop_stages(tile_bytes: int, wanted: int = _LOOP_STAGES, device: torch.device | None = None) -> int:
    """Pipeline stages for tiles of ``tile_bytes``: ``wanted``, fewer where they would not
    fit in the device's shared memory (1: no pipeline)."""
    budget = _PIPELINE_SMEM
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        budget = int(0.7 * getattr(props, "shared_memory_per_block_optin", 227 * 1024))
    return max(1, min(wanted, budget // tile_bytes))


@triton_jit
def _castle_decode_split_kernel(
    q_c,
    k_u,
    v_u,
    u,
    q_u,
    k_c,
    v_c,
    cache_seqlens,
    acc_part,
    m_part,
    l_part,
    o,
    lse,
    pend_k,
    pend_v,
    pend_pos,
    scale,
    window,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kub,
    stride_kuh,
    stride_vub,
    stride_vuh,
    stride_ub,
    stride_us,
    stride_uh,
    stride_qub,
    stride_qus,
    stride_quh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_pkb,
    stride_pkm,
    stride_pkh,
    stride_pvb,
    stride_pvm,
    stride_pvh,
    stride_ppb,
    HC: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_U: tl.constexpr,
    D: tl.constexpr,
    BG: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IS_SINGLE_SPLIT: tl.constexpr,
    M: tl.constexpr,
    IS_DEFERRED: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    # o_hq [BG]: the query heads of causal kv head i_h
    i_s, i_b, i_h, o_hq, o_d, m_g, m_d = split_program(HC, GROUP, D, BG, BD)
    m_gd = m_g[:, None] & m_d[None, :]  # [BG, BD]
    o_hu = o_hq // GROUP_U  # [BG] their lookahead kv heads

    n = tl.load(cache_seqlens + i_b).to(tl.int64)
    t = n - 1  # the new token's slot
    start, end = split_range(0, n, i_s, num_splits, BN)
    if IS_DEFERRED:
        e = t % M  # the new token's ring entry
        base = t - e  # the slot of entry 0's token: the first since the last fold
        is_fold = e == M - 1
    else:
        base = t
    if USE_WINDOW:
        lo = base - window  # the first slot whose u any term changes
    else:
        lo = 0

    p_q = q_c + i_b * stride_qb + o_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_gd, other=0.0).to(tl.float32)  # [BG, BD]
    p_ku = k_u + i_b * stride_kub + o_hu[:, None] * stride_kuh + o_d[None, :]
    b_ku = tl.load(p_ku, mask=m_gd, other=0.0).to(tl.float32)  # [BG, BD]
    p_vu = v_u + i_b * stride_vub + o_hu[:, None] * stride_vuh + o_d[None, :]
    b_vu = tl.load(p_vu, mask=m_gd, other=0.0).to(tl.float32)  # [BG, BD]
    if IS_DEFERRED:
        # push the token (every head's program stores the same bytes); the other
        # programs take entry e from k_u, v_u, so no program reads what another writes
        if i_s == 0:
            p_pk = pend_k + i_b * stride_pkb + e * stride_pkm + o_hu[:, None] * stride_pkh + o_d[None, :]
            p_pv = pend_v + i_b * stride_pvb + e * stride_pvm + o_hu[:, None] * stride_pvh + o_d[None, :]
            tl.store(p_pk, b_ku.to(pend_k.dtype.element_ty), mask=m_gd)
            tl.store(p_pv, b_vu.to(pend_v.dtype.element_ty), mask=m_gd)
            if i_h == 0:
                tl.store(pend_pos + i_b * stride_ppb + e, t.to(tl.int32))

    b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BG], dtype=tl.float32)
    b_acc = tl.zeros([BG, BD], dtype=tl.float32)
    # the loop's own stages pipeline every load (the kernel's num_stages only those that
    # feed a tl.dot, and there is none here)
    for j0 in tl.range(start, end, BN, num_stages=LOOP_STAGES):
        o_j = j0 + tl.arange(0, BN)  # [BN]
        m_j = o_j < end
        m_upd = m_j & (o_j < t) & (o_j >= lo)  # slots whose u changes
        m_gjd = m_gd[:, None, :] & m_j[None, :, None]  # [BG, BN, BD]
        m_upd3 = m_gd[:, None, :] & m_upd[None, :, None]  # [BG, BN, BD]

        p_u = (u + i_b * stride_ub + o_j[None, :, None] * stride_us
               + o_hq[:, None, None] * stride_uh + o_d[None, None, :])
        b_u = tl.load(p_u, mask=m_gjd, other=0.0).to(tl.float32)  # [BG, BN, BD]
        p_qu = (q_u + i_b * stride_qub + o_j[None, :, None] * stride_qus
                + o_hq[:, None, None] * stride_quh + o_d[None, None, :])
        b_qu = tl.load(p_qu, mask=m_upd3, other=0.0).to(tl.float32)  # [BG, BN, BD]
        if IS_DEFERRED:
            # the pending tokens in position order (the immediate update's order); the
            # ring's few [BG, BD] rows stay in cache across the tiles
            for i in tl.static_range(M):
                p_i = base + i  # the slot of entry i's token, if valid
                pos_i = tl.load(pend_pos + i_b * stride_ppb + i).to(tl.int64)
                is_new = i == e
                m_i = ((pos_i == p_i) | is_new) & (p_i <= t)  # is_new: pushed by this launch
                m_old = m_gd & (m_i & (i != e))
                p_pk = pend_k + i_b * stride_pkb + i * stride_pkm + o_hu[:, None] * stride_pkh + o_d[None, :]
                p_pv = pend_v + i_b * stride_pvb + i * stride_pvm + o_hu[:, None] * stride_pvh + o_d[None, :]
                b_ki = tl.load(p_pk, mask=m_old, other=0.0).to(tl.float32)  # [BG, BD]
                b_vi = tl.load(p_pv, mask=m_old, other=0.0).to(tl.float32)  # [BG, BD]
                b_ki = tl.where(is_new, b_ku, b_ki)
                b_vi = tl.where(is_new, b_vu, b_vi)
                m_ij = m_upd & m_i & (o_j < p_i)  # [BN] token p_i updates the slots before it
                if USE_WINDOW:
                    m_ij = m_ij & (o_j >= p_i - window)
                b_gate = tl.sigmoid(tl.sum(b_qu * b_ki[:, None, :], axis=2) * scale)  # [BG, BN]
                b_gate = tl.where(m_ij[None, :], b_gate, 0.0)
                b_u = b_u + b_gate[:, :, None] * b_vi[:, None, :]
            b_u = tl.where((o_j == t)[None, :, None], 0.0, b_u)
            m_write = (m_upd & is_fold) | (o_j == t)  # the changed rows on the fold step only
        else:
            b_gate = tl.sigmoid(tl.sum(b_qu * b_ku[:, None, :], axis=2) * scale)  # [BG, BN]
            b_gate = tl.where(m_upd[None, :], b_gate, 0.0)
            # u_t = 0 replaces whatever slot t held (NaN included)
            b_u = tl.where((o_j == t)[None, :, None], 0.0, b_u + b_gate[:, :, None] * b_vu[:, None, :])
            m_write = m_upd | (o_j == t)
        b_u_held = b_u.to(u.dtype.element_ty)
        tl.store(p_u, b_u_held, mask=m_gd[:, None, :] & m_write[None, :, None])
        b_u = b_u_held.to(tl.float32)  # attend with u as stored, as the reference does

        p_k = k_c + i_b * stride_kb + i_h * stride_kh + o_j[:, None] * stride_ks + o_d[None, :]
        p_v = v_c + i_b * stride_vb + i_h * stride_vh + o_j[:, None] * stride_vs + o_d[None, :]
        b_k = tl.load(p_k, mask=m_j[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BN, BD]
        b_v = tl.load(p_v, mask=m_j[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BN, BD]
        b_sc = tl.sum(b_q[:, None, :] * b_k[None, :, :], axis=2) * scale  # [BG, BN]
        b_su = tl.sum(b_q[:, None, :] * b_u, axis=2) * scale  # [BG, BN]
        b_s = (b_sc - b_su * tl.sigmoid(b_su)) * LOG2E_TL
        b_s = tl.where(m_g[:, None] & m_j[None, :], b_s, float("-inf"))

        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))  # [BG]
        # padded group rows keep m = -inf; exp2(-inf - 0) = 0 keeps them NaN-free
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_m_safe)  # [BG]
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BG, BN]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.sum(b_p[:, :, None] * b_v[None, :, :], axis=1)
        b_m = b_m_new

    _store_split_result(b_acc, b_m, b_l, o, lse, acc_part, m_part, l_part, i_b, i_s, o_hq, o_d,
                        m_g, m_d, num_splits, stride_ob, stride_oh, HC * GROUP, D, IS_SINGLE_SPLIT)


def _launch_options(q_c: Tensor, u_cache: Tensor, k_c_cache: Tensor, qu_cache: Tensor,
                    group: int, window: int | None, num_splits: int | None,
                    config: dict | None) -> tuple[int, dict]:
    """``(num_splits, options)``: tiles of about ``_TILE_ELEMENTS`` per ``[BG, BN, BD]``,
    and as many splits as fit in one wave of resident programs (``num_splits`` chosen
    when None), each >= 256 slots long. ``config`` overrides ``BN``, ``num_warps``,
    ``num_stages`` and ``loop_stages`` (for tuning on a GPU)."""
    b, _, d = q_c.shape
    if config is None and b == 1 and triton.next_power_of_2(group) * 128 * d <= 4 * _TILE_ELEMENTS:
        # one sequence: few programs, each streaming long tiles, no loop pipeline. On an
        # H100 at 7 heads of 64 and 4096 slots, 13.5 against 19.5 us for the defaults below
        # without the loop pipeline and 13.5 against 14.5 us with two stages
        config = dict(BN=128, num_warps=8, num_stages=2, loop_stages=1)
    elif config is None and window is None and group == 1 and d <= 64:
        # full CASTLE, every held u rewritten: 64-slot tiles over 8 warps, 3 stages where
        # they fit. At B 8 x 4096 slots, 7 heads of 64, on an H100: 81 against 89 us for
        # the defaults below (112 without the loop pipeline); under SWL, where most u are
        # only read, the defaults stay the best (57 us against 76)
        config = dict(BN=64, num_warps=8)
    config = config or {}
    s, hc = k_c_cache.shape[1], k_c_cache.shape[2]
    block_d = max(16, triton.next_power_of_2(d))
    block_g = triton.next_power_of_2(group)
    block_n = config.get("BN", max(16, min(64, _TILE_ELEMENTS // (block_g * block_d))))
    stages = config.get("num_stages", _PIPELINE_STAGES)
    tile = tile_bytes(block_n, block_d, block_g, u_cache, qu_cache, k_c_cache)
    n_loop = config.get("loop_stages", loop_stages(tile, device=q_c.device))
    if num_splits is None:
        resident = _resident_programs(q_c.device, tile, max(n_loop, _PIPELINE_STAGES))
        num_splits = _choose_num_splits(s, b * hc, resident)
    # large groups (GQA) cannot shrink BN below 16: more warps share their tiles' registers
    num_warps = config.get("num_warps", 4 if block_g * block_n * block_d <= 2 * _TILE_ELEMENTS else 8)
    options = dict(BG=block_g, BN=block_n, BD=block_d, IS_SINGLE_SPLIT=num_splits == 1,
                   num_warps=num_warps, num_stages=stages, LOOP_STAGES=n_loop)
    return num_splits, options


def launch_castle_decode(
    q_c: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    u_cache: Tensor,
    qu_cache: Tensor,
    k_c_cache: Tensor,
    v_c_cache: Tensor,
    cache_seqlens: Tensor,
    scale: float,
    window: int | None,
    o: Tensor,
    lse: Tensor,
    num_splits: int | None = None,
    workspace: tuple[Tensor, Tensor, Tensor] | None = None,
    config: dict | None = None,
    pending: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """Updates ``u_cache`` in place and writes ``o`` [B, H, D] and ``lse`` [B, H] float32
    (natural log). Every tensor must be contiguous in its last dim (``u_cache`` is
    written in place, so it is not copied here). ``pending``: the deferred step's ring
    ``(k, v, pos)`` (``castle_decode_step``), updated in place.

    ``workspace`` (``acc [B, H, splits, D]``, ``m`` and ``l`` ``[B, H, splits]``, float32)
    can be passed in so tests can poison it with NaN; ``config`` overrides the tile
    ``BN``, ``num_warps`` and ``num_stages`` (tuning).
    """
    b, h, d = q_c.shape
    hc, hu = k_c_cache.shape[2], k_u.shape[1]
    group = h // hc
    num_splits, options = _launch_options(q_c, u_cache, k_c_cache, qu_cache, group, window,
                                          num_splits, config)
    acc_part, m_part, l_part = _split_workspace(q_c, num_splits) if workspace is None else workspace
    # without a ring the kernel never touches these: any tensors do
    pend_k, pend_v, pend_pos = (u_cache[:, :1], u_cache[:, :1], cache_seqlens[:, None]) if pending is None \
        else pending
    _castle_decode_split_kernel[(num_splits, b * hc)](
        q_c,
        k_u,
        v_u,
        u_cache,
        qu_cache,
        k_c_cache,
        v_c_cache,
        cache_seqlens,
        acc_part,
        m_part,
        l_part,
        o,
        lse,
        pend_k,
        pend_v,
        pend_pos,
        scale,
        0 if window is None else window,
        num_splits,
        q_c.stride(0),
        q_c.stride(1),
        k_u.stride(0),
        k_u.stride(1),
        v_u.stride(0),
        v_u.stride(1),
        u_cache.stride(0),
        u_cache.stride(1),
        u_cache.stride(2),
        qu_cache.stride(0),
        qu_cache.stride(1),
        qu_cache.stride(2),
        k_c_cache.stride(0),
        k_c_cache.stride(1),
        k_c_cache.stride(2),
        v_c_cache.stride(0),
        v_c_cache.stride(1),
        v_c_cache.stride(2),
        o.stride(0),
        o.stride(1),
        pend_k.stride(0),
        pend_k.stride(1),
        pend_k.stride(2),
        pend_v.stride(0),
        pend_v.stride(1),
        pend_v.stride(2),
        pend_pos.stride(0),
        HC=hc,
        GROUP=group,
        GROUP_U=h // hu,
        D=d,
        USE_WINDOW=window is not None,
        M=pend_k.shape[1],
        IS_DEFERRED=pending is not None,
        **options,
    )
    _combine_splits(acc_part, m_part, l_part, o, lse, num_splits, options["BD"])


@torch.library.custom_op("lapse::castle_decode", mutates_args=("u_cache",))
def triton_castle_decode(
    q_c: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    u_cache: Tensor,
    qu_cache: Tensor,
    k_c_cache: Tensor,
    v_c_cache: Tensor,
    cache_seqlens: Tensor,
    scale: float,
    window: int | None,
    num_splits: int | None,
) -> tuple[Tensor, Tensor]:
    """``(o [B, H, D], lse [B, H] float32)`` of :func:`launch_castle_decode` in fresh
    tensors, ``u_cache`` updated in place, as one operator that ``torch.compile`` does not
    trace into (inputs already checked)."""
    q_c, k_u, v_u, qu_cache, k_c_cache, v_c_cache = (
        x if x.stride(-1) == 1 else x.contiguous()
        for x in (q_c, k_u, v_u, qu_cache, k_c_cache, v_c_cache)
    )
    o = q_c.new_empty(q_c.shape)  # contiguous, as the kernel's stores assume
    lse = q_c.new_empty(q_c.shape[:2], dtype=torch.float32)
    launch_castle_decode(q_c, k_u, v_u, u_cache, qu_cache, k_c_cache, v_c_cache, cache_seqlens,
                         scale, window, o, lse, num_splits)
    return o, lse


@triton_castle_decode.register_fake
def _(q_c, k_u, v_u, u_cache, qu_cache, k_c_cache, v_c_cache, cache_seqlens, scale, window,
      num_splits):
    return q_c.new_empty(q_c.shape), q_c.new_empty(q_c.shape[:2], dtype=torch.float32)


@torch.library.custom_op("lapse::castle_decode_deferred",
                         mutates_args=("u_cache", "pend_k", "pend_v", "pend_pos"))
def triton_castle_decode_deferred(
    q_c: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    u_cache: Tensor,
    qu_cache: Tensor,
    k_c_cache: Tensor,
    v_c_cache: Tensor,
    cache_seqlens: Tensor,
    pend_k: Tensor,
    pend_v: Tensor,
    pend_pos: Tensor,
    scale: float,
    window: int | None,
    num_splits: int | None,
) -> tuple[Tensor, Tensor]:
    """The deferred step (``castle_decode_step(..., pending=...)``) as one operator:
    ``(o, lse)`` in fresh tensors; ``u_cache`` (slot ``t``, and the fold) and the ring
    updated in place by the kernel itself, so the step stays one launch (inputs already
    checked; the ring is contiguous in its last dim)."""
    q_c, k_u, v_u, qu_cache, k_c_cache, v_c_cache = (
        x if x.stride(-1) == 1 else x.contiguous()
        for x in (q_c, k_u, v_u, qu_cache, k_c_cache, v_c_cache)
    )
    o = q_c.new_empty(q_c.shape)
    lse = q_c.new_empty(q_c.shape[:2], dtype=torch.float32)
    launch_castle_decode(q_c, k_u, v_u, u_cache, qu_cache, k_c_cache, v_c_cache, cache_seqlens,
                         scale, window, o, lse, num_splits, pending=(pend_k, pend_v, pend_pos))
    return o, lse


@triton_castle_decode_deferred.register_fake
def _(q_c, k_u, v_u, u_cache, qu_cache, k_c_cache, v_c_cache, cache_seqlens, pend_k, pend_v, pend_pos,
      scale, window, num_splits):
    return q_c.new_empty(q_c.shape), q_c.new_empty(q_c.shape[:2], dtype=torch.float32)
