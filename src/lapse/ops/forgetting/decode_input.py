"""The input side of one FoX decoding step, fused: forget gate, ``c_t``, KV-shift, QK-norm
and the cache writes of one new token per sequence.

SPEC section 1 (Decoding) and section 2 (the Pro block). A layer's one-token step does,
between its input projections and its attention, a handful of operations on a few
hundred numbers per head: the forget gate ``log f_t = logsigmoid(w_f . x_t + b_f)`` and
``c_t = c_{t-1} + log f_t`` (float64), the KV-shift gates ``sigmoid(w . x_t)`` and the
shift ``(1 - a) k_t + a k_{t-1}``, the QK-norm of ``q_t`` and of the shifted key, and the
writes of ``k``, ``v`` and ``c_t`` into the cache. Each of these is a kernel of its own in
a compiled step (four per layer for FoX Pro, about 8 us of a 125M model's ~80 us layer
at 8 x 4k on an H100, under torch.profiler); here they are one.

:func:`forgetting_decode_input` is the public function; :func:`_decode_input_torch` the
plain reference (the same operations as the unfused layer code, in the same precision).

Legend: B batch, C d_model, S cache capacity, H key/value heads, HQ query heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backend import resolve_backend
from ..norm import rms_norm
from .common import LOG_GATE_FLOOR
from .decode_input_triton import triton_decode_input


def _decode_input_torch(
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
    """The plain reference, step by step as the unfused layer runs it."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)  # [B, C]
    z = xf @ fgate_weight.to(acc).t()  # [B, HQ]
    if fgate_bias is not None:
        z = z + fgate_bias.to(acc)
    log_f = F.logsigmoid(z)  # [B, HQ]
    c = c_last + log_f.to(torch.float64).clamp_min(LOG_GATE_FLOOR)  # [B, HQ] float64
    if k_shift_weight is not None:
        a_k = torch.sigmoid(xf @ k_shift_weight.to(acc).t())[..., None]  # [B, H, 1]
        a_v = torch.sigmoid(xf @ v_shift_weight.to(acc).t())[..., None]
        k_new = (a_k * k_prev[:, 0] + (1 - a_k) * k).to(k.dtype)  # [B, H, D]
        v_new = (a_v * v_prev[:, 0] + (1 - a_v) * v).to(v.dtype)
        k_prev[:, 0].copy_(k)
        v_prev[:, 0].copy_(v)
    else:
        k_new, v_new = k, v
    q_new = q
    if q_norm_weight is not None:
        q_new, k_new = rms_norm(q, q_norm_weight, eps), rms_norm(k_new, k_norm_weight, eps)
    rows = torch.arange(x.shape[0], device=x.device)
    c_last.copy_(c)
    c_cache[rows, slot] = c.to(c_cache.dtype)
    k_cache[rows, slot] = k_new.to(k_cache.dtype)
    v_cache[rows, slot] = v_new.to(v_cache.dtype)
    return q_new.contiguous()


def _check(
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
    c_last,
    k_prev,
    v_prev,
    k_cache,
    v_cache,
    c_cache,
    slot,
) -> None:
    """One-line errors for inputs the kernel cannot take, before any launch."""
    if x.dim() != 2 or q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            "x must be [B, C], q [B, HQ, D], k and v [B, H, D]; got "
            f"{tuple(x.shape)}, {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    (b, c), (hq, d), h = x.shape, q.shape[1:], k.shape[1]
    if q.shape[0] != b or k.shape[0] != b or k.shape[2] != d or hq % h:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B={b} and D, and H must divide HQ"
        )
    want = {
        "fgate_weight": (fgate_weight, (hq, c)),
        "fgate_bias": (fgate_bias, (hq,)),
        "k_shift_weight": (k_shift_weight, (h, c)),
        "v_shift_weight": (v_shift_weight, (h, c)),
        "q_norm_weight": (q_norm_weight, (hq, d)),
        "k_norm_weight": (k_norm_weight, (h, d)),
        "c_last": (c_last, (b, hq)),
        "k_prev": (k_prev, (b, 1, h, d)),
        "v_prev": (v_prev, (b, 1, h, d)),
        "slot": (slot, (b,)),
    }
    for name, (t, shape) in want.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if (k_shift_weight is None) != (v_shift_weight is None) or (k_shift_weight is None) != (k_prev is None):
        raise ValueError(
            "k_shift_weight, v_shift_weight, k_prev and v_prev come together (KV-shift) or not at all"
        )
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight come together (QK-norm) or not at all")
    for name, cache, inner in (
        ("k_cache", k_cache, (h, d)),
        ("v_cache", v_cache, (h, d)),
        ("c_cache", c_cache, (hq,)),
    ):
        if cache.dim() != 2 + len(inner) or cache.shape[0] != b or tuple(cache.shape[2:]) != inner:
            raise ValueError(f"{name} must be [B={b}, S, *{inner}], got {tuple(cache.shape)}")
    if c_last.dtype != torch.float64 or c_cache.dtype != torch.float64:
        raise TypeError(f"c_last and c_cache must be float64, got {c_last.dtype} and {c_cache.dtype}")
    if slot.dtype != torch.int64:
        raise TypeError(f"slot must be int64, got {slot.dtype}")
    devices = {t.device for t in (x, q, k, v, fgate_weight, c_last, k_cache, v_cache, c_cache, slot)}
    if len(devices) != 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devices))}")


def forgetting_decode_input(
    x: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
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
    backend: str = "auto",
) -> Tensor:
    """One new token per sequence, from its input projections to the cache: returns the
    queries attention reads ``[B, HQ, D]`` and, in place, writes slot ``slot[b]`` of the
    caches and the new recurrent state.

    Args:
        x: ``[B, C]`` the layer input (the gates are computed from it).
        q, k, v: ``[B, HQ, D]``, ``[B, H, D]``, ``[B, H, D]`` the new token's projections
            (keys and values before the shift); any strides with a unit last one.
        fgate_weight, fgate_bias: the forget gate ``[HQ, C]``, ``[HQ]`` or ``None``.
        k_shift_weight, v_shift_weight: the KV-shift gates ``[H, C]``, or ``None`` (no shift).
        q_norm_weight, k_norm_weight: the QK-norm gains ``[HQ, D]``, ``[H, D]``, or ``None``
            (no QK-norm); ``eps`` its epsilon.
        c_last: ``[B, HQ]`` float64, ``c_{t-1}``; becomes ``c_t``.
        k_prev, v_prev: ``[B, 1, H, D]`` the previous token's pre-shift projections
            (with the shift); become this token's.
        k_cache, v_cache: ``[B, S, H, D]``; c_cache ``[B, S, HQ]`` float64.
        slot: ``[B]`` int64, the slot each sequence's new token goes into.
        backend: ``auto`` (Triton on CUDA), ``triton`` or ``torch`` (the reference).

    The gates and norms are computed in float32 (the input's dtype for float32 and
    float64), ``c`` in float64; what is stored is rounded to each buffer's dtype.
    """
    args = (
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
        c_last,
        k_prev,
        v_prev,
        k_cache,
        v_cache,
        c_cache,
        slot,
    )
    _check(*args)
    backend = resolve_backend(backend, x, ("auto", "triton", "torch"), products=False)
    fn = _decode_input_torch
    if backend == "triton":
        fn = triton_decode_input
        written = {"c_last": c_last, "k_prev": k_prev, "v_prev": v_prev}
        for name, t in written.items():
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous for backend='triton' (it is written in place)")
        for name, t in (("x", x), ("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have a unit stride in its last dim for backend='triton'")
        fgate_weight, fgate_bias, k_shift_weight, v_shift_weight, q_norm_weight, k_norm_weight = (
            None if t is None else t.contiguous()
            for t in (fgate_weight, fgate_bias, k_shift_weight, v_shift_weight, q_norm_weight, k_norm_weight)
        )
    return fn(
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
        float(eps),
        c_last,
        k_prev,
        v_prev,
        k_cache,
        v_cache,
        c_cache,
        slot,
    )
