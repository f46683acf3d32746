"""Triton kernel of a FoX decoding step's input side, and its custom op.

The public function and the plain torch reference are in ``decode_input.py``. Program
``b * H + h`` owns key head ``h`` of sequence ``b`` and the ``GROUP = HQ // H`` query
heads that read it: it takes the dot products of the layer input with the forget-gate
rows of its query heads and the two KV-shift rows of its key head (a loop over ``C`` in
tiles of ``BC``), then does the rest in registers: ``c_t = c_{t-1} + log f_t`` in
float64, the KV-shift, the QK-norm, the writes of ``k``, ``v`` and ``c_t`` into the cache
slot and of the new recurrent state, and the normed queries.

Wrapped in the custom op ``lapse::forgetting_decode_input`` (mutating the cache and the
states) so that ``torch.compile(fullgraph=True)`` and CUDA graphs see one opaque call.

Legend: B batch, C d_model, S cache capacity, H key/value heads, HQ query heads, GROUP =
HQ // H, D head dim; in the kernel BG (padded group), BD (padded D), BC (a tile of C).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import tl, triton, triton_jit
from .common import LOG_GATE_FLOOR
from .decode_triton import _rms_norm_rows

_LOG_GATE_FLOOR_TL = tl.constexpr(LOG_GATE_FLOOR) if tl is not None else LOG_GATE_FLOOR


@triton_jit
def _log_sigmoid(z):
    """``log sigmoid(z) = min(z, 0) - log1p(exp(-|z|))`` in float32, with ``log1p`` of a
    small argument from its series (``log(1 + e)`` rounds to 0 below ``e ~ 6e-8``)."""
    e = tl.exp(-tl.abs(z))
    log1p = tl.where(e < 1e-4, e * (1.0 - 0.5 * e), tl.log(1.0 + e))
    return tl.minimum(z, 0.0) - log1p


@triton_jit
def _decode_input_kernel(
    x,
    q,
    k,
    v,
    wf,
    bf,
    wk,
    wv,
    gq,
    gk,
    c_last,
    k_prev,
    v_prev,
    k_cache,
    v_cache,
    c_cache,
    slot,
    q_out,
    eps,
    C,
    stride_xb,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_ccb,
    stride_ccs,
    stride_cch,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    hq_n: tl.constexpr = H * GROUP

    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    m_g = o_g < GROUP
    m_d = o_d < D
    m_gd = m_g[:, None] & m_d[None, :]
    o_hq = i_h * GROUP + o_g  # [BG] the query heads of key head i_h

    # Every load that does not depend on the gates first, so that they are all in flight
    # together (a chain of dependent loads is what a kernel this small waits on).
    n = tl.load(slot + i_b)  # the new token's slot
    p_cl = c_last + i_b * hq_n + o_hq
    b_cl = tl.load(p_cl, mask=m_g, other=0.0)  # [BG] float64
    b_k = tl.load(k + i_b * stride_kb + i_h * stride_kh + o_d, mask=m_d, other=0.0)  # [BD]
    b_v = tl.load(v + i_b * stride_vb + i_h * stride_vh + o_d, mask=m_d, other=0.0)  # [BD]
    p_q = q + i_b * stride_qb + o_hq[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_gd, other=0.0)  # [BG, BD]
    if HAS_SHIFT:
        p_kp = k_prev + (i_b * H + i_h) * D + o_d
        p_vp = v_prev + (i_b * H + i_h) * D + o_d
        b_kp = tl.load(p_kp, mask=m_d, other=0.0).to(tl.float32)
        b_vp = tl.load(p_vp, mask=m_d, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        b_gk = tl.load(gk + i_h * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_gq = tl.load(gq + o_hq[:, None] * D + o_d[None, :], mask=m_gd, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_bf = tl.load(bf + o_hq, mask=m_g, other=0.0).to(tl.float32)

    # the gates' dot products with the layer input, in float32
    b_zf = tl.zeros([BG], dtype=tl.float32)
    b_zk = tl.zeros([], dtype=tl.float32)
    b_zv = tl.zeros([], dtype=tl.float32)
    for c0 in range(0, C, BC):
        o_c = c0 + tl.arange(0, BC)
        m_c = o_c < C
        b_x = tl.load(x + i_b * stride_xb + o_c, mask=m_c, other=0.0).to(tl.float32)  # [BC]
        p_wf = wf + o_hq[:, None] * C + o_c[None, :]
        b_wf = tl.load(p_wf, mask=m_g[:, None] & m_c[None, :], other=0.0).to(tl.float32)  # [BG, BC]
        if HAS_SHIFT:
            b_wk = tl.load(wk + i_h * C + o_c, mask=m_c, other=0.0).to(tl.float32)
            b_wv = tl.load(wv + i_h * C + o_c, mask=m_c, other=0.0).to(tl.float32)
            b_zk += tl.sum(b_wk * b_x, axis=0)
            b_zv += tl.sum(b_wv * b_x, axis=0)
        b_zf += tl.sum(b_wf * b_x[None, :], axis=1)
    if HAS_BIAS:
        b_zf += b_bf

    # c_t = c_{t-1} + max(log f_t, floor), in float64
    b_log_f = tl.maximum(_log_sigmoid(b_zf).to(tl.float64), _LOG_GATE_FLOOR_TL)  # [BG]
    b_c = b_cl + b_log_f
    tl.store(p_cl, b_c, mask=m_g)
    tl.store(c_cache + i_b * stride_ccb + n * stride_ccs + o_hq * stride_cch, b_c, mask=m_g)

    # keys and values: shift with the previous token's projections, then QK-norm on k
    if HAS_SHIFT:
        a_k = tl.sigmoid(b_zk)
        a_v = tl.sigmoid(b_zv)
        tl.store(p_kp, b_k, mask=m_d)  # the pre-shift projections: the next token's x_{t-1}
        tl.store(p_vp, b_v, mask=m_d)
        b_k = (a_k * b_kp + (1.0 - a_k) * b_k.to(tl.float32)).to(b_k.dtype)
        b_v = (a_v * b_vp + (1.0 - a_v) * b_v.to(tl.float32)).to(b_v.dtype)
    if HAS_QK_NORM:
        b_k = _rms_norm_rows(b_k.to(tl.float32), b_gk, m_d, eps, D).to(b_k.dtype)
        b_q = _rms_norm_rows(b_q.to(tl.float32), b_gq, m_d[None, :], eps, D).to(b_q.dtype)
    p_kc = k_cache + i_b * stride_kcb + n * stride_kcs + i_h * stride_kch + o_d
    p_vc = v_cache + i_b * stride_vcb + n * stride_vcs + i_h * stride_vch + o_d
    tl.store(p_kc, b_k.to(k_cache.dtype.element_ty), mask=m_d)
    tl.store(p_vc, b_v.to(v_cache.dtype.element_ty), mask=m_d)
    tl.store(q_out + i_b * hq_n * D + o_hq[:, None] * D + o_d[None, :], b_q, mask=m_gd)


def launch_decode_input(
    x: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    fgate_weight: Tensor,
    fgate_bias: Tensor | None,
    k_shift_weight: Tensor | None,
    v_shift_weight: Tensor | None,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    eps: float,
    c_last: Tensor,
    k_prev: Tensor | None,
    v_prev: Tensor | None,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor,
    slot: Tensor,
    q_out: Tensor,
) -> None:
    """Writes ``q_out`` ``[B, HQ, D]`` (contiguous) and updates the cache and the states in
    place; shapes, dtypes and contiguity as :func:`~.decode_input.forgetting_decode_input`
    checks them (weights, states and ``q_out`` contiguous; ``x``, ``q``, ``k``, ``v`` and
    the caches with unit stride in their last dim)."""
    b, hq, d = q.shape
    h = k.shape[1]
    c = x.shape[-1]
    has_shift = k_shift_weight is not None
    has_norm = q_norm_weight is not None
    placeholder = fgate_weight  # passed for absent tensors; never read
    _decode_input_kernel[(b * h,)](
        x,
        q,
        k,
        v,
        fgate_weight,
        fgate_bias if fgate_bias is not None else placeholder,
        k_shift_weight if has_shift else placeholder,
        v_shift_weight if has_shift else placeholder,
        q_norm_weight if has_norm else placeholder,
        k_norm_weight if has_norm else placeholder,
        c_last,
        k_prev if has_shift else placeholder,
        v_prev if has_shift else placeholder,
        k_cache,
        v_cache,
        c_cache,
        slot,
        q_out,
        eps,
        c,
        x.stride(0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        c_cache.stride(0),
        c_cache.stride(1),
        c_cache.stride(2),
        H=h,
        GROUP=hq // h,
        D=d,
        BG=triton.next_power_of_2(hq // h),
        BD=triton.next_power_of_2(d),
        BC=min(4096, triton.next_power_of_2(c)),  # one tile up to C = 4096
        HAS_BIAS=fgate_bias is not None,
        HAS_SHIFT=has_shift,
        HAS_QK_NORM=has_norm,
        num_warps=4,
    )


@torch.library.custom_op(
    "lapse::forgetting_decode_input",
    mutates_args=("c_last", "k_prev", "v_prev", "k_cache", "v_cache", "c_cache"),
)
def triton_decode_input(
    x: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    fgate_weight: Tensor,
    fgate_bias: Tensor | None,
    k_shift_weight: Tensor | None,
    v_shift_weight: Tensor | None,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    eps: float,
    c_last: Tensor,
    k_prev: Tensor | None,
    v_prev: Tensor | None,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor,
    slot: Tensor,
) -> Tensor:
    """The normed queries ``[B, HQ, D]`` of :func:`launch_decode_input` in a fresh tensor,
    the cache and states updated in place, as one operator that ``torch.compile`` does not
    trace into (inputs already checked)."""
    q_out = q.new_empty(q.shape)
    launch_decode_input(
        x,
        q,
        k,
        v,
        fgate_weight,
        fgate_bias,
        k_shift_weight,
        v_shift_weight,
        q_norm_weight,
        k_norm_weight,
        eps,
        c_last,
        k_prev,
        v_prev,
        k_cache,
        v_cache,
        c_cache,
        slot,
        q_out,
    )
    return q_out


@triton_decode_input.register_fake
def _(
    x,
    q,
    k,
    v,
    fgate_weight,
    fgate_bias,
    k_shift_weight,
    v_shift_weight,
    q_norm_weight,
    k_norm_weight,
    eps,
    c_last,
    k_prev,
    v_prev,
    k_cache,
    v_cache,
    c_cache,
    slot,
):
    return q.new_empty(q.shape)
