"""Triton kernels of one decoding step over a KV cache that stores ``c_j``, and their launcher.

The public function and the plain torch reference are in ``decode.py``. Split-K
flash-decoding: program ``(split, b * H + h)`` owns one key head and all ``GROUP = HQ // H``
query heads that read it, so each K/V tile is loaded once per group; it runs an online
softmax (base 2) over its share of the keys and writes a float32 partial ``(acc, m, l)``;
a second kernel merges the splits. One split writes the output directly. The online
softmax step, the split epilogue, the launch options and the merge are shared with the
paged split kernel of ``paged_triton.py``.

The launch is wrapped in the custom op ``lapse::forgetting_decode`` so that
``torch.compile(fullgraph=True)`` and CUDA graphs see one opaque call with known output
shapes; the launcher never reads a tensor value back to the host.

Legend: B batch, S cache capacity, H key/value heads, HQ query heads, GROUP = HQ // H,
D head dim; in kernels BG (padded group rows), BN (keys per tile), BD (padded D) and
BS (padded number of splits).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import LN2_TL, LOG2E, LOG2E_TL, tl, triton, triton_jit

# A split below this many keys costs more in partial writes than it saves in parallelism.
_MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 128
# Tiles kept in flight per program by Triton's software pipelining (its default on Hopper).
_PIPELINE_STAGES = 3
# Launch options of the dense split kernel at D <= 64, by whether a [BG, BN] tile of the FoX
# bias is computed (bias with GQA; without GQA the bias is a [BN] vector): the best on average
# over B x prompt in {1, 8, 32} x 4k, 4 x 16k and 2 x 32k of tiles x warps x stages, on an H100
# (the kernel alone, replayed from a CUDA graph, 12 heads of 64, bf16). The [BG, BN] bias tile's
# float64 work favours small tiles; plain softmax and the vector bias stream best in large
# ones (bias, 8 x 4k: 37.9 us per layer, against 44.2 us when it was a padded [16, BN] tile).
_DENSE_TUNED = {
    True: dict(BN=32, num_warps=2, num_stages=3),
    False: dict(BN=128, num_warps=4, num_stages=4),
}


@triton_jit
def _online_softmax_update(b_s, b_v, b_m, b_l, b_acc, DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax (base 2): base-2 logits ``b_s`` [BG, BN] (-inf where
    masked) and values ``b_v`` [BN, BD] folded into the running ``(m, l, acc)``."""
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))  # [BG]
    # A row with no kept key yet has m = -inf; exp2(-inf - 0) = 0 keeps it NaN-free.
    b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_alpha = tl.exp2(b_m - b_m_safe)  # [BG]
    b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BG, BN]
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    b_pv = tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)  # [BG, BD]
    b_acc = b_acc * b_alpha[:, None] + b_pv
    return b_m_new, b_l, b_acc


@triton_jit
def _add_fox_bias(b_s, b_ct, b_c, VECTOR: tl.constexpr):
    """Base-2 logits ``b_s`` [BG, BN] plus the FoX bias ``c_t - c_j`` (taken in ``c``'s
    dtype, then rounded): ``VECTOR`` (one query head per kv head) ``b_ct`` [] and ``b_c``
    [BN], the same for every padded row; else ``b_ct`` [BG] and ``b_c`` [BG, BN]."""
    if VECTOR:
        return b_s + ((b_ct - b_c).to(tl.float32) * LOG2E_TL)[None, :]
    return b_s + (b_ct[:, None] - b_c).to(tl.float32) * LOG2E_TL


@triton_jit
def _rms_norm_rows(b_x, b_w, m_d, eps, D: tl.constexpr):
    """``x / sqrt(mean(x^2) + eps) * w`` over the last axis of float32 ``b_x`` (``D`` real
    columns, ``m_d`` their mask; padding columns read as zero)."""
    b_x = tl.where(m_d, b_x, 0.0)
    b_ms = tl.sum(b_x * b_x, axis=-1, keep_dims=True) / D
    return b_x * tl.rsqrt(b_ms + eps) * b_w


@triton_jit
def _gated_output(b_o, o, p_w, p_g, m_od, m_d, eps, D: tl.constexpr):
    """The Pro block's output side on the attention output ``b_o`` (float32, rows of
    ``D``): ``RMSNorm_head(o) * sigmoid(g)`` (SPEC section 2), rounded to ``o``'s dtype
    where the unfused layer rounds (the attention output, the norm, the gate)."""
    dtype = o.dtype.element_ty
    b_o = b_o.to(dtype).to(tl.float32)
    b_w = tl.load(p_w, mask=m_od, other=0.0).to(tl.float32)
    b_y = _rms_norm_rows(b_o, b_w, m_d, eps, D).to(dtype).to(tl.float32)
    b_g = tl.sigmoid(tl.load(p_g, mask=m_od, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    return (b_y * b_g).to(dtype)


@triton_jit
def _store_split_result(
    b_acc,
    b_m,
    b_l,
    o,
    lse,
    acc_part,
    m_part,
    l_part,
    i_b,
    i_s,
    o_hq,
    o_d,
    m_g,
    m_d,
    num_splits,
    stride_ob,
    stride_oh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    IS_SINGLE_SPLIT: tl.constexpr,
):
    """The epilogue of a split program over the query heads ``o_hq`` [BG] of batch ``i_b``:
    one split writes ``o`` and ``lse``; several write float32 partials ``(acc, m, l)``."""
    m_gd = m_g[:, None] & m_d[None, :]
    if IS_SINGLE_SPLIT:
        # The only split saw every key, the new token's among them (finite logit), so
        # l >= 1 on every real row.
        b_l_safe = tl.where(m_g, b_l, 1.0)
        p_o = o + i_b * stride_ob + o_hq[:, None] * stride_oh + o_d[None, :]
        tl.store(p_o, (b_acc / b_l_safe[:, None]).to(o.dtype.element_ty), mask=m_gd)
        b_lse = (b_m + tl.log2(b_l_safe)) * LN2_TL
        tl.store(lse + i_b * HQ + o_hq, b_lse, mask=m_g)
    else:
        o_row = (i_b * HQ + o_hq) * num_splits + i_s  # [BG] row of [B, HQ, splits]
        tl.store(acc_part + o_row[:, None] * D + o_d[None, :], b_acc, mask=m_gd)
        tl.store(m_part + o_row, b_m, mask=m_g)
        tl.store(l_part + o_row, b_l, mask=m_g)


@triton_jit
def _decode_split_kernel(
    q,
    k,
    v,
    c,
    cache_seqlens,
    window_start,
    acc_part,
    m_part,
    l_part,
    o,
    lse,
    out_w,
    out_g,
    out_eps,
    scale_log2,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_wb,
    stride_wh,
    stride_ob,
    stride_oh,
    stride_gb,
    stride_gh,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BG: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IS_SINGLE_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_GATE: tl.constexpr,
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

    n = tl.load(cache_seqlens + i_b).to(tl.int64)
    if USE_WINDOW:
        b_ws = tl.load(
            window_start + i_b * stride_wb + o_hq * stride_wh, mask=m_g, other=n - 1
        ).to(tl.int64)  # [BG]
        # Keys before the group's first kept key are never read: they may be freed memory.
        lo = tl.min(b_ws, axis=0)
    else:
        lo = tl.zeros([], dtype=tl.int64)
    chunk = tl.cdiv(tl.cdiv(n - lo, num_splits), BN) * BN
    start = lo + i_s * chunk
    end = tl.minimum(start + chunk, n)

    p_q = q + i_b * stride_qb + o_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)  # [BG, BD]
    if HAS_BIAS:
        # c_t in the cache's dtype: the difference is taken before any rounding to float32.
        if GROUP == 1:  # one real row of BG: c as a [BN] vector, not a padded [BG, BN] tile
            b_ct = tl.load(c + i_b * stride_cb + (n - 1) * stride_cs + i_h * stride_ch)  # []
        else:
            p_ct = c + i_b * stride_cb + (n - 1) * stride_cs + o_hq * stride_ch
            b_ct = tl.load(p_ct, mask=m_g, other=0.0)  # [BG]

    b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BG], dtype=tl.float32)
    b_acc = tl.zeros([BG, BD], dtype=tl.float32)
    for j0 in range(start, end, BN):
        o_j = j0 + tl.arange(0, BN)  # [BN]
        m_j = o_j < end
        p_k = k + i_b * stride_kb + i_h * stride_kh + o_j[:, None] * stride_ks + o_d[None, :]
        p_v = v + i_b * stride_vb + i_h * stride_vh + o_j[:, None] * stride_vs + o_d[None, :]
        b_k = tl.load(p_k, mask=m_j[:, None] & m_d[None, :], other=0.0)  # [BN, BD]
        b_v = tl.load(p_v, mask=m_j[:, None] & m_d[None, :], other=0.0)  # [BN, BD]
        m_gj = m_g[:, None] & m_j[None, :]  # [BG, BN]
        if USE_WINDOW:
            m_gj = m_gj & (o_j[None, :] >= b_ws[:, None])
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)  # [BG, BN]
        b_s = b_s * scale_log2
        if HAS_BIAS:  # the FoX bias
            if GROUP == 1:  # [start, end) begins at or after this row's window start
                b_c = tl.load(c + i_b * stride_cb + i_h * stride_ch + o_j * stride_cs, mask=m_j, other=0.0)
            else:
                p_c = c + i_b * stride_cb + o_j[None, :] * stride_cs + o_hq[:, None] * stride_ch
                b_c = tl.load(p_c, mask=m_gj, other=0.0)  # [BG, BN]
            b_s = _add_fox_bias(b_s, b_ct, b_c, GROUP == 1)
        b_s = tl.where(m_gj, b_s, float("-inf"))
        b_m, b_l, b_acc = _online_softmax_update(b_s, b_v, b_m, b_l, b_acc, DOT_PRECISION)

    if OUT_GATE and IS_SINGLE_SPLIT:  # the output norm and gate in the epilogue
        m_gd = m_g[:, None] & m_d[None, :]
        b_l_safe = tl.where(m_g, b_l, 1.0)
        p_w = out_w + o_hq[:, None] * D + o_d[None, :]
        p_g = out_g + i_b * stride_gb + o_hq[:, None] * stride_gh + o_d[None, :]
        b_o = _gated_output(b_acc / b_l_safe[:, None], o, p_w, p_g, m_gd, m_d[None, :], out_eps, D)
        tl.store(o + i_b * stride_ob + o_hq[:, None] * stride_oh + o_d[None, :], b_o, mask=m_gd)
        tl.store(lse + i_b * H * GROUP + o_hq, (b_m + tl.log2(b_l_safe)) * LN2_TL, mask=m_g)
    else:
        _store_split_result(b_acc, b_m, b_l, o, lse, acc_part, m_part, l_part, i_b, i_s, o_hq, o_d,
                            m_g, m_d, num_splits, stride_ob, stride_oh, H * GROUP, D, IS_SINGLE_SPLIT)


@triton_jit
def _decode_combine_kernel(
    acc_part,
    m_part,
    l_part,
    o,
    lse,
    out_w,
    out_g,
    out_eps,
    num_splits,
    stride_ob,
    stride_oh,
    stride_gb,
    stride_gh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    OUT_GATE: tl.constexpr,
):
    i_bhq = tl.program_id(0).to(tl.int64)
    i_b = i_bhq // HQ
    i_hq = i_bhq % HQ

    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    m_s = o_s < num_splits
    m_d = o_d < D
    o_row = i_bhq * num_splits + o_s  # [BS]
    b_m = tl.load(m_part + o_row, mask=m_s, other=float("-inf"))  # [BS]
    b_l = tl.load(l_part + o_row, mask=m_s, other=0.0)  # [BS]
    p_acc = acc_part + o_row[:, None] * D + o_d[None, :]
    b_acc = tl.load(p_acc, mask=m_s[:, None] & m_d[None, :], other=0.0)  # [BS, BD]
    # Key t lies in some split and has a finite logit, so the max is finite; empty splits
    # (m = -inf) get weight 0.
    b_m_max = tl.max(b_m, axis=0)
    b_w = tl.exp2(b_m - b_m_max)  # [BS]
    b_l_sum = tl.sum(b_w * b_l, axis=0)
    b_o = tl.sum(b_w[:, None] * b_acc, axis=0) / b_l_sum  # [BD]
    if OUT_GATE:
        p_g = out_g + i_b * stride_gb + i_hq * stride_gh + o_d
        b_o = _gated_output(b_o, o, out_w + i_hq * D + o_d, p_g, m_d, m_d, out_eps, D)
    tl.store(o + i_b * stride_ob + i_hq * stride_oh + o_d, b_o.to(o.dtype.element_ty), mask=m_d)
    tl.store(lse + i_bhq, (b_m_max + tl.log2(b_l_sum)) * LN2_TL)


def _resident_programs(device: torch.device, tile_bytes: int, stages: int = _PIPELINE_STAGES) -> int:
    """How many split programs the GPU runs at once: SMs x programs per SM.

    Shared memory bounds a program to ~_PIPELINE_STAGES K/V tile pairs, so it decides how
    many fit on an SM (2 for D = 128 in 16 bits, 4 for D = 64). The interpreter behaves
    as an H100.
    """
    n_sms, smem = 132, 228 * 1024
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        n_sms = props.multi_processor_count
        smem = getattr(props, "shared_memory_per_multiprocessor", smem)
    per_sm = max(1, min(4, int(0.9 * smem) // (stages * tile_bytes)))
    return n_sms * per_sm


def _choose_num_splits(capacity: int, programs: int, resident: int) -> int:
    """As many splits as fit in one wave of resident programs, each >= 256 keys long.

    One wave: a partial second wave costs nearly a full one (on an H200, 9 splits of
    32 heads ran 1.6x slower than 8). Decided from the capacity, a host number (no sync);
    with shorter sequences the kernel spreads the real length over the splits.
    """
    by_wave = resident // programs
    by_length = capacity // _MIN_KEYS_PER_SPLIT
    return max(1, min(by_wave, by_length, MAX_SPLITS))


def _split_launch(
    q: Tensor, group: int, keys: int, programs: int, num_splits: int | None,
    config: dict | None = None,
) -> tuple[int, dict]:
    """``(num_splits, options)`` of a split kernel over ``programs`` key heads of ``group``
    query heads each, at most ``keys`` keys per head: ``num_splits`` chosen when None, and
    the launch options both split kernels share (tiles ``BG``, ``BN``, ``BD``, dot
    precision, ``IS_SINGLE_SPLIT``, warps and stages). ``config`` overrides ``BN``,
    ``num_warps`` and ``num_stages`` (to time other options than ``_DENSE_TUNED``)."""
    config = config or {}
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    # tl.dot needs 16 rows: small groups are padded. A multiply-and-sum over an unpadded
    # [group, BN, BD] product spilled registers and ran 2-10x slower on an H100.
    block_g = max(16, triton.next_power_of_2(group))
    block_n = config.get("BN", 64 if block_d <= 128 else 32)
    stages = config.get("num_stages", _PIPELINE_STAGES)
    if num_splits is None:
        tile_bytes = 2 * block_n * block_d * q.element_size()  # one K and one V tile
        num_splits = _choose_num_splits(keys, programs, _resident_programs(q.device, tile_bytes, stages))
    options = dict(
        BG=block_g,
        BN=block_n,
        BD=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        IS_SINGLE_SPLIT=num_splits == 1,
        num_warps=config.get("num_warps", 4),
        num_stages=stages,
    )
    return num_splits, options


def _split_workspace(q: Tensor, num_splits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Fresh float32 partials of the splits for ``q`` [B, HQ, D]: ``acc [B, HQ, splits, D]``,
    ``m`` and ``l`` ``[B, HQ, splits]``."""
    b, hq, d = q.shape
    return (
        q.new_empty(b, hq, num_splits, d, dtype=torch.float32),
        q.new_empty(b, hq, num_splits, dtype=torch.float32),
        q.new_empty(b, hq, num_splits, dtype=torch.float32),
    )


def _combine_splits(
    acc_part: Tensor,
    m_part: Tensor,
    l_part: Tensor,
    o: Tensor,
    lse: Tensor,
    num_splits: int,
    block_d: int,
    out_gate: tuple[Tensor, Tensor, float] | None = None,
) -> None:
    """Merges the partials of several splits into ``o`` [B, HQ, D] and ``lse`` [B, HQ];
    nothing to do after one split, which wrote them itself. ``out_gate``: ``(weight
    [HQ, D] contiguous, gate [B, HQ, D], eps)``, the output norm and gate applied to ``o``."""
    b, hq, d = o.shape
    if num_splits > 1:
        w, g, eps = out_gate if out_gate is not None else (o, o, 0.0)  # placeholders: unread
        _decode_combine_kernel[(b * hq,)](
            acc_part,
            m_part,
            l_part,
            o,
            lse,
            w,
            g,
            eps,
            num_splits,
            o.stride(0),
            o.stride(1),
            g.stride(0),
            g.stride(1),
            HQ=hq,
            D=d,
            BS=triton.next_power_of_2(num_splits),
            BD=block_d,
            OUT_GATE=out_gate is not None,
            num_warps=4,
        )


def launch_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor | None,
    cache_seqlens: Tensor,
    window_start: Tensor | None,
    scale: float,
    o: Tensor,
    lse: Tensor,
    num_splits: int | None = None,
    workspace: tuple[Tensor, Tensor, Tensor] | None = None,
    config: dict | None = None,
    out_gate: tuple[Tensor, Tensor, float] | None = None,
) -> None:
    """Writes ``o`` [B, HQ, D] and ``lse`` [B, HQ] float32 (natural log) in place.

    ``out_gate``: ``(weight [HQ, D] contiguous, gate [B, HQ, D] unit-strided last dim,
    eps)``: ``o`` is ``RMSNorm_head(attention) * sigmoid(gate)`` (the Pro block's output
    side, SPEC section 2), applied in the epilogue of one split or in the merge of several.

    ``config``: launch options for :func:`_split_launch` (``BN``, ``num_warps``,
    ``num_stages``); by default the measured table ``_DENSE_TUNED`` at ``D <= 64``.

    ``c_cache`` ``None``: plain softmax attention (no FoX bias; the Transformer's step).

    ``workspace`` (``acc [B, HQ, splits, D]``, ``m`` and ``l`` ``[B, HQ, splits]``, all
    float32) can be passed in so tests can poison it with NaN.
    """
    b, hq, d = q.shape
    _, s, h, _ = k_cache.shape
    group = hq // h
    q, k_cache, v_cache = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache)
    )
    if config is None and d <= 64 and q.element_size() == 2:  # measured in bf16
        config = _DENSE_TUNED[c_cache is not None and group > 1]
    num_splits, options = _split_launch(q, group, s, b * h, num_splits, config)
    acc_part, m_part, l_part = _split_workspace(q, num_splits) if workspace is None else workspace
    ws = window_start if window_start is not None else cache_seqlens  # unread placeholder
    ws_strides = (ws.stride(0), ws.stride(1)) if window_start is not None else (0, 0)
    c = c_cache if c_cache is not None else k_cache  # unread placeholder
    c_strides = c_cache.stride() if c_cache is not None else (0, 0, 0)
    w, g, eps = out_gate if out_gate is not None else (o, o, 0.0)  # placeholders: unread
    _decode_split_kernel[(num_splits, b * h)](
        q,
        k_cache,
        v_cache,
        c,
        cache_seqlens,
        ws,
        acc_part,
        m_part,
        l_part,
        o,
        lse,
        w,
        g,
        eps,
        scale * LOG2E,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        *c_strides,
        *ws_strides,
        o.stride(0),
        o.stride(1),
        g.stride(0),
        g.stride(1),
        H=h,
        GROUP=group,
        D=d,
        USE_WINDOW=window_start is not None,
        HAS_BIAS=c_cache is not None,
        OUT_GATE=out_gate is not None,
        **options,
    )
    _combine_splits(acc_part, m_part, l_part, o, lse, num_splits, options["BD"], out_gate)


@torch.library.custom_op("lapse::forgetting_decode", mutates_args=())
def triton_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor | None,
    cache_seqlens: Tensor,
    window_start: Tensor | None,
    scale: float,
    num_splits: int | None,
    out_norm_weight: Tensor | None = None,
    out_gate: Tensor | None = None,
    out_norm_eps: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """``(o [B, HQ, D], lse [B, HQ] float32)`` of :func:`launch_decode` in fresh tensors,
    as one operator that ``torch.compile`` does not trace into (inputs already checked);
    with ``out_gate`` (and ``out_norm_weight``) ``o`` is normed and gated."""
    o = q.new_empty(q.shape)  # contiguous, as the kernel's stores assume
    lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    gated = None if out_gate is None else (out_norm_weight.contiguous(), out_gate, out_norm_eps)
    launch_decode(q, k_cache, v_cache, c_cache, cache_seqlens, window_start, scale, o, lse,
                  num_splits, out_gate=gated)
    return o, lse


@triton_decode.register_fake
def _(q, k_cache, v_cache, c_cache, cache_seqlens, window_start, scale, num_splits,
      out_norm_weight=None, out_gate=None, out_norm_eps=0.0):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)
