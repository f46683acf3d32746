"""One decoding step of forgetting attention over a KV cache that stores ``c_j``.

SPEC section 1 (Decoding) and section 3 (ACP decoding). The new token's query attends
to every cached key ``j`` in ``[s_h, t]`` with logit ``scale * q . k_j + (c_t - c_j)``;
the cache keeps the cumulative log gate ``c_j`` of every key, so nothing is recomputed
per step. ``s_h`` (``window_start``) is where ACP eviction has cut a head's cache.

The Triton path is split-K flash-decoding: program ``(split, b * H + h)`` owns one key
head and all ``GROUP = HQ // H`` query heads that read it, so each K/V tile is loaded
once per group; it runs an online softmax (base 2) over its share of the keys and writes
a float32 partial ``(acc, m, l)``; a second kernel merges the splits. One split writes
the output directly.

Legend: B batch, S cache capacity, H key/value heads, HQ query heads, GROUP = HQ // H,
D head dim; in kernels BG (padded group rows), BN (keys per tile), BD (padded D) and
BS (padded number of splits).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..backend import BACKENDS, LN2_TL, LOG2E, LOG2E_TL, check_backend, resolve_backend, tl, triton
from ..backend import triton_jit as _triton_jit
from .common import _shape

# the torch path is the plain reference, so there is no separate naive one
DECODE_BACKENDS = tuple(b for b in BACKENDS if b != "naive")

# A split below this many keys costs more in partial writes than it saves in parallelism.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 128
# Tiles kept in flight per program by Triton's software pipelining (its default on Hopper).
_PIPELINE_STAGES = 3


@_triton_jit
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
    H: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BG: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
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
    # c_t in the cache's dtype: the difference is taken before any rounding to float32.
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
        p_c = c + i_b * stride_cb + o_j[None, :] * stride_cs + o_hq[:, None] * stride_ch
        b_c = tl.load(p_c, mask=m_gj, other=0.0)  # [BG, BN]
        b_bias = (b_ct[:, None] - b_c).to(tl.float32)  # [BG, BN]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)  # [BG, BN]
        b_s = b_s * scale_log2 + b_bias * LOG2E_TL
        b_s = tl.where(m_gj, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))  # [BG]
        # A row with no kept key yet has m = -inf; exp2(-inf - 0) = 0 keeps it NaN-free.
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_m_safe)  # [BG]
        b_p = tl.exp2(b_s - b_m_safe[:, None])  # [BG, BN]
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_pv = tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)  # [BG, BD]
        b_acc = b_acc * b_alpha[:, None] + b_pv
        b_m = b_m_new

    m_gd = m_g[:, None] & m_d[None, :]
    if IS_SINGLE_SPLIT:
        # The only split saw key t (bias 0, finite logit), so l >= 1 on every real row.
        b_l_safe = tl.where(m_g, b_l, 1.0)
        p_o = o + i_b * stride_ob + o_hq[:, None] * stride_oh + o_d[None, :]
        tl.store(p_o, (b_acc / b_l_safe[:, None]).to(o.dtype.element_ty), mask=m_gd)
        b_lse = (b_m + tl.log2(b_l_safe)) * LN2_TL
        tl.store(lse + i_b * (H * GROUP) + o_hq, b_lse, mask=m_g)
    else:
        o_row = (i_b * (H * GROUP) + o_hq) * num_splits + i_s  # [BG] row of [B, HQ, splits]
        tl.store(acc_part + o_row[:, None] * D + o_d[None, :], b_acc, mask=m_gd)
        tl.store(m_part + o_row, b_m, mask=m_g)
        tl.store(l_part + o_row, b_l, mask=m_g)


@_triton_jit
def _decode_combine_kernel(
    acc_part,
    m_part,
    l_part,
    o,
    lse,
    num_splits,
    stride_ob,
    stride_oh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
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
    tl.store(o + i_b * stride_ob + i_hq * stride_oh + o_d, b_o.to(o.dtype.element_ty), mask=m_d)
    tl.store(lse + i_bhq, (b_m_max + tl.log2(b_l_sum)) * LN2_TL)


def _resident_programs(device: torch.device, tile_bytes: int) -> int:
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
    per_sm = max(1, min(4, int(0.9 * smem) // (_PIPELINE_STAGES * tile_bytes)))
    return n_sms * per_sm


def _choose_num_splits(capacity: int, programs: int, resident: int) -> int:
    """As many splits as fit in one wave of resident programs, each >= 256 keys long.

    One wave: a partial second wave costs nearly a full one (on an H200, 9 splits of
    32 heads ran 1.6x slower than 8). Decided from the capacity, a host number (no sync);
    with shorter sequences the kernel spreads the real length over the splits.
    """
    by_wave = resident // programs
    by_length = capacity // _MIN_KEYS_PER_SPLIT
    return max(1, min(by_wave, by_length, _MAX_SPLITS))


def _decode_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor,
    cache_seqlens: Tensor,
    window_start: Tensor | None,
    scale: float,
    o: Tensor,
    lse: Tensor,
    num_splits: int | None = None,
    workspace: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """Writes ``o`` [B, HQ, D] and ``lse`` [B, HQ] float32 (natural log) in place.

    ``workspace`` (``acc [B, HQ, splits, D]``, ``m`` and ``l`` ``[B, HQ, splits]``, all
    float32) can be passed in so tests can poison it with NaN.
    """
    b, hq, d = q.shape
    _, s, h, _ = k_cache.shape
    group = hq // h
    q, k_cache, v_cache = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache)
    )
    block_d = max(16, triton.next_power_of_2(d))
    # tl.dot needs 16 rows: small groups are padded. A multiply-and-sum over an unpadded
    # [group, BN, BD] product spilled registers and ran 2-10x slower on an H100.
    block_g = max(16, triton.next_power_of_2(group))
    block_n = 64 if block_d <= 128 else 32
    if num_splits is None:
        tile_bytes = 2 * block_n * block_d * q.element_size()  # one K and one V tile
        num_splits = _choose_num_splits(s, b * h, _resident_programs(q.device, tile_bytes))
    if workspace is None:
        acc_part = q.new_empty(b, hq, num_splits, d, dtype=torch.float32)
        m_part = q.new_empty(b, hq, num_splits, dtype=torch.float32)
        l_part = q.new_empty(b, hq, num_splits, dtype=torch.float32)
    else:
        acc_part, m_part, l_part = workspace
    ws = window_start if window_start is not None else cache_seqlens  # unread placeholder
    ws_strides = (ws.stride(0), ws.stride(1)) if window_start is not None else (0, 0)
    _decode_split_kernel[(num_splits, b * h)](
        q,
        k_cache,
        v_cache,
        c_cache,
        cache_seqlens,
        ws,
        acc_part,
        m_part,
        l_part,
        o,
        lse,
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
        c_cache.stride(0),
        c_cache.stride(1),
        c_cache.stride(2),
        *ws_strides,
        o.stride(0),
        o.stride(1),
        H=h,
        GROUP=group,
        D=d,
        BG=block_g,
        BN=block_n,
        BD=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        USE_WINDOW=window_start is not None,
        IS_SINGLE_SPLIT=num_splits == 1,
        num_warps=4,
        num_stages=_PIPELINE_STAGES,
    )
    if num_splits > 1:
        _decode_combine_kernel[(b * hq,)](
            acc_part,
            m_part,
            l_part,
            o,
            lse,
            num_splits,
            o.stride(0),
            o.stride(1),
            HQ=hq,
            D=d,
            BS=triton.next_power_of_2(num_splits),
            BD=block_d,
            num_warps=4,
        )


def _decode_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor,
    cache_seqlens: Tensor,
    window_start: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """The plain reference: every cache slot scored, invalid ones masked explicitly.

    Float32 math (float64 for float64 ``q``); masked slots are zeroed before use, so
    garbage (NaN included) anywhere outside a row's kept keys cannot leak in.
    """
    b, hq, d = q.shape
    s, h = k_cache.shape[1], k_cache.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = k_cache.repeat_interleave(hq // h, dim=2).to(acc)  # [B, S, HQ, D]
    v = v_cache.repeat_interleave(hq // h, dim=2).to(acc)  # [B, S, HQ, D]
    pos = torch.arange(s, device=q.device)
    keep = (pos[None, :] < cache_seqlens[:, None].long())[:, :, None]  # [B, S, 1]
    if window_start is not None:
        keep = keep & (pos[None, :, None] >= window_start[:, None, :].long())  # [B, S, HQ]
    keep = keep.expand(b, s, hq)  # [B, S, HQ]
    last = (cache_seqlens.long() - 1)[:, None, None].expand(b, 1, hq)  # [B, 1, HQ]
    c_t = torch.gather(c_cache, 1, last)  # [B, 1, HQ], the cache's dtype
    bias = torch.where(keep, c_t - c_cache, 0.0).to(acc)  # [B, S, HQ]
    k = torch.where(keep[..., None], k, 0.0)
    v = torch.where(keep[..., None], v, 0.0)
    logits = torch.einsum("bhd,bshd->bhs", q.to(acc), k) * scale + bias.transpose(1, 2)
    logits = torch.where(keep.transpose(1, 2), logits, float("-inf"))  # [B, HQ, S]
    lse = torch.logsumexp(logits, dim=-1)  # [B, HQ]
    p = torch.softmax(logits, dim=-1)  # [B, HQ, S]
    o = torch.einsum("bhs,bshd->bhd", p, v)  # [B, HQ, D]
    return o.to(q.dtype), lse.float()


def _validate(q, k_cache, v_cache, c_cache, cache_seqlens, window_start, scale, backend, out,
              check_values) -> float:
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "c_cache": c_cache,
               "cache_seqlens": cache_seqlens}
    if window_start is not None:
        tensors["window_start"] = window_start
    if out is not None:
        tensors["out"] = out
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    check_backend(backend, DECODE_BACKENDS)
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, query_heads, head_dim], got {_shape(q)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be [batch, capacity, heads, head_dim], got {_shape(t)}"
            )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(
            "q, k_cache, v_cache must share a dtype, got "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {_shape(k_cache)} and "
            f"{_shape(v_cache)}"
        )
    b, hq, d = q.shape
    bk, s, h, dk = k_cache.shape
    if bk != b:
        raise ValueError(f"k_cache has batch {bk} but q has batch {b}")
    if dk != d:
        raise ValueError(f"k_cache has head_dim {dk} but q has head_dim {d}")
    if d < 1 or d > 256:
        raise ValueError(f"head_dim must be in [1, 256], got {d}")
    if s < 1:
        raise ValueError(f"k_cache must have a capacity of at least 1, got {_shape(k_cache)}")
    if h < 1 or hq % h != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({h}) (grouped-query)"
        )
    if c_cache.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"c_cache must be float32 or float64, got {c_cache.dtype}")
    if tuple(c_cache.shape) != (b, s, hq):
        raise ValueError(
            f"c_cache must be [batch, capacity, query_heads] = {(b, s, hq)}, "
            f"got {_shape(c_cache)}"
        )
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (b,):
        raise ValueError(
            f"cache_seqlens must be int32 [batch] = [{b}], got {_shape(cache_seqlens)}"
        )
    if window_start is not None and (
        window_start.dtype != torch.int32 or tuple(window_start.shape) != (b, hq)
    ):
        raise ValueError(
            f"window_start must be int32 [batch, query_heads] = {(b, hq)}, "
            f"got {_shape(window_start)}"
        )
    if out is not None:
        if tuple(out.shape) != (b, hq, d) or out.dtype != q.dtype:
            raise ValueError(f"out must be {q.dtype} {(b, hq, d)}, got {_shape(out)}")
        if out.stride(-1) != 1:
            raise ValueError(f"out must be contiguous in its last dim, got strides {out.stride()}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if check_values:
        if bool(((cache_seqlens < 1) | (cache_seqlens > s)).any()):
            raise ValueError(
                f"cache_seqlens must be in [1, capacity = {s}], got {cache_seqlens.tolist()[:16]}"
            )
        if window_start is not None and bool(
            ((window_start < 0) | (window_start > cache_seqlens[:, None] - 1)).any()
        ):
            raise ValueError(
                "window_start must be in [0, cache_seqlens - 1] (the new token is always kept)"
            )
    return float(scale)


def forgetting_attention_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor,
    cache_seqlens: Tensor,
    *,
    scale: float | None = None,
    window_start: Tensor | None = None,
    return_lse: bool = False,
    out: Tensor | None = None,
    num_splits: int | None = None,
    check_values: bool = True,
    backend: str = "auto",
):
    """Attention of one new token per sequence over its cache, with the forget-gate bias.

    ``o_h = softmax_j(scale * q_h . k_j + c_t,h - c_j,h) v_j`` over the kept keys
    ``j`` in ``[window_start[b, h], t]``, ``t = cache_seqlens[b] - 1`` (SPEC section 1).
    The new token's own key, value and ``c_t`` are already in the cache at slot ``t``,
    so it attends to itself with bias 0. For ``cache_seqlens = [3, 5]``, capacity 6 and
    a window starting at 1 in the second sequence, the keys read are::

        1 1 1 0 0 0
        0 1 1 1 1 0

    Args:
        q: ``[B, HQ, D]`` float16, bfloat16 or float32 (float64 on the torch backend),
            the new token's queries. ``D`` up to 256, any value.
        k_cache, v_cache: ``[B, S, H, D]``, same dtype as ``q``, capacity ``S``; ``HQ`` a
            multiple of ``H`` (grouped-query). Slots outside ``[min over the group of
            window_start, cache_seqlens)`` are never read and may hold anything.
        c_cache: ``[B, S, HQ]`` float32 or float64, the cumulative log gate ``c_j`` of
            every cached key for every query head (finite: build it with the floor
            ``LOG_GATE_FLOOR`` as ``cumulative_log_gates`` does). The bias ``c_t - c_j``
            is taken in this dtype and only then rounded to float32, so a float64 cache
            keeps the bias exact at long context, where ``c`` grows large and a float32
            difference cancels digits (SPEC section 1, Numerics).
        cache_seqlens: ``[B]`` int32, the number of valid slots, in ``[1, S]``.
        scale: logit scale, ``1 / sqrt(D)`` by default.
        window_start: optional ``[B, HQ]`` int32, the first kept key of each (sequence,
            query head), in ``[0, cache_seqlens - 1]``: keys before it are ignored. ACP
            decoding evicts keys for good this way, leaving a suffix per head (SPEC
            section 3).
        return_lse: also return the log-sum-exp ``[B, HQ]`` float32 (natural log).
        out: optional preallocated ``[B, HQ, D]`` output in ``q``'s dtype, written in place.
        num_splits: Triton only, how many splits share each head's keys; by default
            chosen from ``S`` and ``B * H`` to fill the GPU.
        check_values: check the values of ``cache_seqlens`` and ``window_start`` (one
            host-device sync); pass False inside a captured or compiled decode step.
        backend: ``"auto"`` (Triton on CUDA, else torch), ``"triton"`` or ``"torch"``
            (the plain reference, any device).

    Returns:
        ``o`` ``[B, HQ, D]`` in ``q``'s dtype (``out`` if given), or ``(o, lse)`` with
        ``return_lse``. An inference op: the Triton path records no gradient.
    """
    scale = _validate(q, k_cache, v_cache, c_cache, cache_seqlens, window_start, scale,
                      backend, out, check_values)
    backend = resolve_backend(backend, q, DECODE_BACKENDS)
    if backend == "triton":
        if num_splits is not None and not (
            isinstance(num_splits, int) and 1 <= num_splits <= _MAX_SPLITS
        ):
            raise ValueError(f"num_splits must be an int in [1, {_MAX_SPLITS}], got {num_splits!r}")
        o = out if out is not None else torch.empty_like(q)
        lse = q.new_empty(q.shape[:2], dtype=torch.float32)
        _decode_triton(q, k_cache, v_cache, c_cache, cache_seqlens, window_start, scale, o,
                       lse, num_splits)
    else:
        o, lse = _decode_torch(q, k_cache, v_cache, c_cache, cache_seqlens, window_start, scale)
        if out is not None:
            o = out.copy_(o)
    return (o, lse) if return_lse else o
