"""CASTLE decoding over a UQ-KV cache: one new token per sequence (SPEC section 5).

The cache holds, per slot ``s`` and query head, the lookahead vector ``u_s`` and the
lookahead query ``q^U_s``, and per slot and causal kv head ``k^C_s, v^C_s``; all four
are dense ``[B, S, heads, D]`` buffers (``S`` the capacity, the layout of ``kv``'s
stores) with a per-sequence length. A step for the new token at slot ``t`` is

1. the caller writes ``q^U_t, k^C_t, v^C_t`` into slot ``t`` (the store's ``append``)
   and the length becomes ``t + 1``;
2. :func:`castle_decode_update` adds ``sigmoid(q^U_s . k^U_t * scale) v^U_t`` to every
   earlier ``u_s`` (SWL: only ``s >= t - W``, gathered, so O(W D) per head) and sets
   ``u_t = 0``; ``k^U_t, v^U_t`` are used here and not kept;
3. :func:`castle_attention_decode` evaluates ``softmax(q^C_t K^C^T * scale -
   SiLU(q^C_t U^T * scale)) V^C`` over the slots ``s <= t``.

:func:`castle_decode_step` is 2 and 3 in one call: on CUDA the fused Triton kernel of
``decode_triton.py`` (each held slot's ``u, q^U, k^C, v^C`` read once, ``u`` written
once, nothing past a sequence's length touched), elsewhere the two functions above, which
are the plain reference. All are free of host reads (with ``check_values=False``) and
have static shapes, so a decode step compiles and captures into a CUDA graph. The cache
after a prefill of ``T`` tokens is ``castle_lookahead_keys(q_u, k_u, v_u)`` beside
``q_u, k_c, v_c``.

The deferred ("folded") step, ``castle_decode_step(..., pending=(k, v, pos))``, keeps
the last up to ``M`` tokens' ``k^U, v^U`` in a small ring instead of adding them into
every ``u_s`` at once: the attention adds the pending terms to the stored ``u`` on the
fly, and ``u`` is written back once every ``M`` steps (the fold), so a step reads ``u``
and writes nearly nothing. It is the same sum (``README.md``, "The deferred update");
:func:`castle_decode_fold` folds on demand.

The file reads: the torch references, the checks, the public functions.

Legend: B batch, S capacity, H query heads, HC causal kv heads, HU lookahead kv heads,
D head dim, W window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backend import resolve_backend
from ..forgetting.common import _shape, check_devices, check_float_dtype, check_tensors, resolve_scale
from ..forgetting.decode import DECODE_BACKENDS
from ..forgetting.decode_triton import MAX_SPLITS
from .common import check_group, check_window
from .decode_triton import triton_castle_decode, triton_castle_decode_deferred


def _update_torch(u_cache: Tensor, qu_cache: Tensor, k_u: Tensor, v_u: Tensor,
                  cache_seqlens: Tensor, scale: float, window: int | None) -> None:
    """The plain reference of the lookahead update, in place (inputs already checked).

    Float32 arithmetic (float64 for a float64 cache), rounded to ``u_cache``'s dtype;
    slots outside the updated range are masked (or never gathered), so garbage there,
    NaN included, cannot leak in.
    """
    b, s, h, d = u_cache.shape
    hu = k_u.shape[1]
    acc = torch.float64 if u_cache.dtype == torch.float64 else torch.float32
    ku = k_u.repeat_interleave(h // hu, dim=1).to(acc)  # [B, H, D]
    vu = v_u.repeat_interleave(h // hu, dim=1).to(acc)  # [B, H, D]
    t = cache_seqlens.long() - 1  # [B]
    if window is None or window >= s:
        # every slot, masked: O(S D) per head, the cost of the attention step itself
        slots = torch.arange(s, device=u_cache.device)[None, :]  # [1, S]
        q = qu_cache.to(acc)  # [B, S, H, D]
        w = torch.sigmoid(torch.einsum("bshd,bhd->bsh", q, ku) * scale)  # [B, S, H]
        keep = slots < t[:, None]
        if window is not None:
            keep = keep & (slots >= t[:, None] - window)
        w = torch.where(keep[..., None], w, 0.0)  # NaN in unused slots cannot leak in
        new = torch.where((slots == t[:, None])[..., None, None], 0.0,
                          u_cache.to(acc) + w[..., None] * vu[:, None])  # [B, S, H, D]
        u_cache.copy_(new)
        return
    # SWL: only the W slots before t change; gather their queries, scatter-add the change
    rows = t[:, None] - window + torch.arange(window, device=u_cache.device)  # [B, W]
    keep = rows >= 0
    idx = rows.clamp_min(0)[:, :, None, None].expand(b, window, h, d)  # [B, W, H, D]
    q = torch.gather(qu_cache, 1, idx).to(acc)  # [B, W, H, D]
    w = torch.sigmoid(torch.einsum("bwhd,bhd->bwh", q, ku) * scale)  # [B, W, H]
    w = torch.where(keep[..., None], w, 0.0)  # rows clamped to slot 0 (t < W) add 0
    u_cache.scatter_add_(1, idx, (w[..., None] * vu[:, None]).to(u_cache.dtype))
    last = t[:, None, None, None].expand(b, 1, h, d)  # [B, 1, H, D]
    u_cache.scatter_(1, last, torch.zeros(b, 1, h, d, dtype=u_cache.dtype, device=u_cache.device))


def _push_pending_torch(k_u: Tensor, v_u: Tensor, pending: tuple[Tensor, Tensor, Tensor],
                        t: Tensor) -> None:
    """Writes the new token (slot ``t`` ``[B]`` int64) into entry ``t mod M`` of the
    pending ring, in place."""
    pend_k, pend_v, pend_pos = pending
    rows = torch.arange(k_u.shape[0], device=k_u.device)
    entry = t % pend_k.shape[1]  # [B]
    pend_k[rows, entry] = k_u.to(pend_k.dtype)
    pend_v[rows, entry] = v_u.to(pend_v.dtype)
    pend_pos[rows, entry] = t.to(pend_pos.dtype)


def _deferred_u_torch(u_cache: Tensor, qu_cache: Tensor, pending: tuple[Tensor, Tensor, Tensor],
                      t: Tensor, scale: float, window: int | None) -> Tensor:
    """The plain reference of the lookahead vectors at time ``t`` ``[B]`` from the stored
    ``u`` and the pending ring (the new token already in it)::

        u^t_s = u_s + sum_{i < M, valid} sig(q^U_s . k_i * scale) v_i 1[s < p_i (, p_i - W <= s)],
        p_i = t - (t mod M) + i,   valid: pos_i == p_i <= t,   u^t_t = 0

    ``[B, S, H, D]`` float32 (float64 for a float64 cache); every slot computed, the ones
    no term reaches (past ``t``, invalid entries) masked, so NaN there cannot leak in.
    The terms are added one entry at a time in position order, the order in which the
    immediate update would have added them.
    """
    pend_k, pend_v, pend_pos = pending
    b, s, h, d = u_cache.shape
    m, hu = pend_k.shape[1], pend_k.shape[2]
    acc = torch.float64 if u_cache.dtype == torch.float64 else torch.float32
    slots = torch.arange(s, device=u_cache.device)[None, :]  # [1, S]
    base = t - t % m  # [B] the slot of entry 0: the first token since the last fold
    q = qu_cache.to(acc)  # [B, S, H, D]
    u = u_cache.to(acc)  # [B, S, H, D]
    for i in range(m):
        p = base + i  # [B] the slot of the token entry i holds, if valid
        valid = (pend_pos[:, i].long() == p) & (p <= t)  # [B]
        ku = pend_k[:, i].repeat_interleave(h // hu, dim=1).to(acc)  # [B, H, D]
        vu = torch.where(valid[:, None, None], pend_v[:, i], 0.0)
        vu = vu.repeat_interleave(h // hu, dim=1).to(acc)  # [B, H, D]
        w = torch.sigmoid(torch.einsum("bshd,bhd->bsh", q, ku) * scale)  # [B, S, H]
        keep = valid[:, None] & (slots < p[:, None])  # [B, S]: token p_i updates the slots before it
        if window is not None:
            keep = keep & (slots >= p[:, None] - window)
        w = torch.where(keep[..., None], w, 0.0)
        u = u + w[..., None] * vu[:, None]  # [B, S, H, D]
    return torch.where((slots == t[:, None])[..., None, None], 0.0, u)  # u_t = 0


def _attend_torch(q_c: Tensor, k_c_cache: Tensor, v_c_cache: Tensor, u_cache: Tensor,
                  cache_seqlens: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The plain reference of the attention over the updated cache: ``(o, lse)``, every
    slot scored and the ones past ``t`` masked (zeroed before use). Float32 arithmetic
    (float64 for float64 ``q_c``)."""
    b, h, _ = q_c.shape
    s, hc = k_c_cache.shape[1], k_c_cache.shape[2]
    acc = torch.float64 if q_c.dtype == torch.float64 else torch.float32
    keep = torch.arange(s, device=q_c.device)[None, :] < cache_seqlens[:, None].long()  # [B, S]
    keep4 = keep[:, :, None, None]
    kc = torch.where(keep4, k_c_cache, 0.0).repeat_interleave(h // hc, dim=2).to(acc)  # [B, S, H, D]
    vc = torch.where(keep4, v_c_cache, 0.0).repeat_interleave(h // hc, dim=2).to(acc)  # [B, S, H, D]
    u = torch.where(keep4, u_cache, 0.0).to(acc)  # [B, S, H, D]
    q = q_c.to(acc)
    s_c = torch.einsum("bhd,bshd->bhs", q, kc) * scale  # [B, H, S]
    s_u = torch.einsum("bhd,bshd->bhs", q, u) * scale  # [B, H, S]
    logits = (s_c - F.silu(s_u)).masked_fill(~keep[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, H]
    o = torch.einsum("bhs,bshd->bhd", torch.softmax(logits, dim=-1), vc).to(q_c.dtype)
    return o, lse.float()


def _deferred_step_torch(q_c: Tensor, k_u: Tensor, v_u: Tensor, u_cache: Tensor, qu_cache: Tensor,
                         k_c_cache: Tensor, v_c_cache: Tensor, cache_seqlens: Tensor,
                         pending: tuple[Tensor, Tensor, Tensor], scale: float,
                         window: int | None) -> tuple[Tensor, Tensor]:
    """The plain reference of the deferred step: push the token, form ``u^t`` from the
    stored ``u`` and the ring, attend with it, and write ``u`` back only on a sequence's
    fold step (``t mod M = M - 1``; ``u_t = 0`` at every step)."""
    t = cache_seqlens.long() - 1  # [B]
    _push_pending_torch(k_u, v_u, pending, t)
    u = _deferred_u_torch(u_cache, qu_cache, pending, t, scale, window).to(u_cache.dtype)
    m = pending[0].shape[1]
    slots = torch.arange(u_cache.shape[1], device=u_cache.device)[None, :]  # [1, S]
    fold = t % m == m - 1  # [B]
    write = (fold[:, None] & (slots < t[:, None])) | (slots == t[:, None])  # [B, S]
    u_cache.copy_(torch.where(write[..., None, None], u, u_cache))
    return _attend_torch(q_c, k_c_cache, v_c_cache, u, cache_seqlens, scale)


def _check_cache(name: str, x: Tensor, b: int, d: int) -> None:
    if x.dim() != 4 or x.shape[0] != b or x.shape[-1] != d:
        raise ValueError(f"{name} must be [batch={b}, capacity, heads, head_dim={d}], got {_shape(x)}")
    check_float_dtype(name, x)


def _check_seqlens(cache_seqlens: Tensor, b: int, s: int, check_values: bool) -> None:
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (b,):
        raise ValueError(f"cache_seqlens must be int32 [batch] = [{b}], got {_shape(cache_seqlens)}")
    if check_values and bool(((cache_seqlens < 1) | (cache_seqlens > s)).any()):
        raise ValueError(f"cache_seqlens must be in [1, capacity = {s}], got "
                         f"{cache_seqlens.tolist()[:16]}")


def _check_pending(pending, k_u: Tensor, u_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Checks the deferred step's ring ``(k, v, pos)`` against ``k_u`` ``[B, HU, D]``
    (its shape is what counts); returns it."""
    if not (isinstance(pending, tuple | list) and len(pending) == 3):
        raise TypeError("pending must be a tuple (k [B, M, HU, D], v [B, M, HU, D], pos [B, M] int32)")
    pend_k, pend_v, pend_pos = pending
    check_tensors(pending_k=pend_k, pending_v=pend_v, pending_pos=pend_pos)
    check_devices(u_cache, pending_k=pend_k, pending_v=pend_v, pending_pos=pend_pos)
    b, hu, d = k_u.shape
    shape = (b, pend_k.shape[1], hu, d) if pend_k.dim() == 4 else None
    if pend_k.shape != shape or pend_v.shape != shape:
        raise ValueError(f"pending k and v must be [batch={b}, M, heads={hu}, head_dim={d}] of one shape, "
                         f"got {_shape(pend_k)} and {_shape(pend_v)}")
    m = pend_k.shape[1]
    if m < 1:
        raise ValueError("pending must hold M >= 1 entries")
    for name, x in (("pending k", pend_k), ("pending v", pend_v)):
        check_float_dtype(name, x)
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {x.stride()}")
    if pend_pos.dtype != torch.int32 or tuple(pend_pos.shape) != (b, m) or pend_pos.stride(-1) != 1:
        raise ValueError(f"pending pos must be int32 [batch, M] = [{b}, {m}], got {_shape(pend_pos)}")
    return pend_k, pend_v, pend_pos


def _check_update(u_cache, qu_cache, k_u, v_u, cache_seqlens, window, check_values) -> int | None:
    """Checks the arguments of :func:`castle_decode_update`; returns the window."""
    check_tensors(u_cache=u_cache, qu_cache=qu_cache, k_u=k_u, v_u=v_u, cache_seqlens=cache_seqlens)
    check_devices(u_cache, qu_cache=qu_cache, k_u=k_u, v_u=v_u, cache_seqlens=cache_seqlens)
    if k_u.dim() != 3 or k_u.shape != v_u.shape:
        raise ValueError(f"k_u and v_u must be [batch, heads, head_dim] of one shape, got "
                         f"{_shape(k_u)} and {_shape(v_u)}")
    b, _, d = k_u.shape
    for name, x in (("k_u", k_u), ("v_u", v_u)):
        check_float_dtype(name, x)
    _check_cache("u_cache", u_cache, b, d)
    _check_cache("qu_cache", qu_cache, b, d)
    if u_cache.shape != qu_cache.shape:
        raise ValueError(f"u_cache and qu_cache must have the same shape, got {_shape(u_cache)} "
                         f"and {_shape(qu_cache)}")
    _, s, h, _ = u_cache.shape
    check_group("k_u", k_u[:, None], h)
    _check_seqlens(cache_seqlens, b, s, check_values)
    return check_window(window)


def _check_attend(q_c, k_c_cache, v_c_cache, u_cache, cache_seqlens, scale, check_values) -> float:
    """Checks the arguments of :func:`castle_attention_decode`; returns the scale."""
    check_tensors(q_c=q_c, k_c_cache=k_c_cache, v_c_cache=v_c_cache, u_cache=u_cache,
                  cache_seqlens=cache_seqlens)
    check_devices(q_c, k_c_cache=k_c_cache, v_c_cache=v_c_cache, u_cache=u_cache,
                  cache_seqlens=cache_seqlens)
    if q_c.dim() != 3:
        raise ValueError(f"q_c must be [batch, heads, head_dim], got {_shape(q_c)}")
    check_float_dtype("q_c", q_c)
    b, h, d = q_c.shape
    for name, x in (("k_c_cache", k_c_cache), ("v_c_cache", v_c_cache), ("u_cache", u_cache)):
        _check_cache(name, x, b, d)
    if k_c_cache.shape != v_c_cache.shape:
        raise ValueError(f"k_c_cache and v_c_cache must have the same shape, got "
                         f"{_shape(k_c_cache)} and {_shape(v_c_cache)}")
    s = k_c_cache.shape[1]
    if u_cache.shape[1:3] != (s, h):
        raise ValueError(f"u_cache must be [batch, capacity={s}, heads={h}, head_dim], got "
                         f"{_shape(u_cache)}")
    check_group("k_c_cache", k_c_cache, h)
    _check_seqlens(cache_seqlens, b, s, check_values)
    return resolve_scale(scale, d)


def castle_decode_update(
    u_cache: Tensor,
    qu_cache: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    cache_seqlens: Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    check_values: bool = True,
) -> Tensor:
    """Adds the new token's lookahead contribution to the cached ``U``, in place.

    With ``t = cache_seqlens[b] - 1`` (the new token's slot)::

        u_s += sigmoid(q^U_s . k^U_t * scale) v^U_t    for s < t  (SWL: t - W <= s < t)
        u_t  = 0

    After the call ``u_cache[b, :t + 1]`` is ``U^t`` of SPEC section 5. Slots past ``t``
    are left as they are (garbage there, NaN included, is never read). The arithmetic
    runs in float32 (float64 for a float64 cache) and is rounded to ``u_cache``'s dtype;
    keep ``U`` in float32: it is a running sum over the whole sequence. Plain PyTorch on
    every device (the reference of :func:`castle_decode_step`).

    Args:
        u_cache: ``[B, S, H, D]`` the lookahead vectors, updated in place.
        qu_cache: ``[B, S, H, D]`` the lookahead queries, ``q^U_t`` already at slot ``t``.
        k_u, v_u: ``[B, HU, D]`` the new token's lookahead key and value, ``HU`` dividing
            ``H`` (query head ``h`` reads ``h // (H / HU)``).
        cache_seqlens: ``[B]`` int32 valid slots, the new token included, in ``[1, S]``.
        scale: ``1 / sqrt(D)`` by default. window: ``None`` (CASTLE) or ``W >= 1``.
        check_values: check ``cache_seqlens`` lies in ``[1, S]`` (one host read); pass
            False in a compiled or captured step.

    Returns:
        ``u_cache``.
    """
    window = _check_update(u_cache, qu_cache, k_u, v_u, cache_seqlens, window, check_values)
    _update_torch(u_cache, qu_cache, k_u, v_u, cache_seqlens, resolve_scale(scale, k_u.shape[-1]),
                  window)
    return u_cache


def castle_attention_decode(
    q_c: Tensor,
    k_c_cache: Tensor,
    v_c_cache: Tensor,
    u_cache: Tensor,
    cache_seqlens: Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    check_values: bool = True,
):
    """The new token's CASTLE output over its UQ-KV cache, after :func:`castle_decode_update`.

    With ``t = cache_seqlens[b] - 1``::

        o = softmax_s(q^C . k^C_s * scale - SiLU(q^C . u_s * scale)) v^C_s,   s <= t

    (``u_t = 0``, so the new token scores itself by ``q^C . k^C_t`` alone). Float32
    arithmetic (float64 for float64 ``q_c``); slots past ``t`` are masked before use.
    Plain PyTorch on every device (the reference of :func:`castle_decode_step`).

    Args:
        q_c: ``[B, H, D]`` the new token's causal queries.
        k_c_cache, v_c_cache: ``[B, S, HC, D]``, ``k^C_t, v^C_t`` already at slot ``t``;
            ``HC`` dividing ``H``.
        u_cache: ``[B, S, H, D]`` the lookahead vectors at time ``t``.
        cache_seqlens: ``[B]`` int32 valid slots, the new token included.
        scale: ``1 / sqrt(D)`` by default.
        return_lse: also return the log-sum-exp ``[B, H]`` float32.
        check_values: as in :func:`castle_decode_update`.

    Returns:
        ``o`` ``[B, H, D]`` in ``q_c``'s dtype, or ``(o, lse)``.
    """
    scale = _check_attend(q_c, k_c_cache, v_c_cache, u_cache, cache_seqlens, scale, check_values)
    o, lse = _attend_torch(q_c, k_c_cache, v_c_cache, u_cache, cache_seqlens, scale)
    return (o, lse) if return_lse else o


def castle_decode_step(
    q_c: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    u_cache: Tensor,
    qu_cache: Tensor,
    k_c_cache: Tensor,
    v_c_cache: Tensor,
    cache_seqlens: Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    check_values: bool = True,
    backend: str = "auto",
    pending: tuple[Tensor, Tensor, Tensor] | None = None,
):
    """One CASTLE decode step over a UQ-KV cache: the lookahead update, in place, then the
    new token's output. With ``t = cache_seqlens[b] - 1`` (the new token's slot)::

        u_s += sigmoid(q^U_s . k^U_t * scale) v^U_t    for s < t  (SWL: t - W <= s < t)
        u_t  = 0
        o    = softmax_s(q^C . k^C_s * scale - SiLU(q^C . u_s * scale)) v^C_s,   s <= t

    exactly :func:`castle_decode_update` followed by :func:`castle_attention_decode`. For
    ``cache_seqlens = [3, 5]``, capacity 6 and ``W = 2``, the slots read (``r``), read and
    written (``w``) and untouched (``.``) are::

        w w w . . .        r w w w . .

    On the Triton backend one kernel, split over the slots, does both in a single pass
    (``u`` float32 arithmetic rounded to ``u_cache``'s dtype, scores in float32): each
    held slot's ``u``, ``k^C``, ``v^C`` (and, where ``u`` changes, ``q^U``) are read once
    and ``u`` written once; slots at or past ``cache_seqlens`` are never touched.

    Args:
        q_c: ``[B, H, D]`` the new token's causal queries, float16, bfloat16 or float32
            (float64 on the torch backend). ``D`` up to 256.
        k_u, v_u: ``[B, HU, D]`` the new token's lookahead key and value, ``HU`` dividing
            ``H``; not kept.
        u_cache: ``[B, S, H, D]`` the lookahead vectors (float32: a running sum over the
            whole sequence), updated in place; contiguous in its last dim.
        qu_cache: ``[B, S, H, D]`` the lookahead queries, ``q^U_t`` at slot ``t``.
        k_c_cache, v_c_cache: ``[B, S, HC, D]``, ``k^C_t, v^C_t`` at slot ``t``; ``HC``
            dividing ``H``.
        cache_seqlens: ``[B]`` int32 valid slots, the new token included, in ``[1, S]``.
        scale: ``1 / sqrt(D)`` by default. window: ``None`` (CASTLE) or ``W >= 1``.
        return_lse: also return the log-sum-exp ``[B, H]`` float32 (natural log).
        num_splits: Triton only, how many splits share each sequence's slots; by default
            chosen from ``S`` and ``B * HC`` to fill the GPU.
        check_values: check ``cache_seqlens`` (one host read); pass False in a compiled or
            captured step.
        backend: ``"auto"`` (Triton on CUDA, else torch), ``"triton"`` or ``"torch"``
            (the two reference functions; with ``pending``, the deferred step's reference).
        pending: ``None`` (the update above, every held ``u_s`` rewritten each step), or
            the ring ``(k [B, M, HU, D], v [B, M, HU, D], pos [B, M] int32)`` of the
            deferred ("folded") update, updated in place (see below).

    With ``pending``, the step does not add the token into ``u``: it writes
    ``k^U_t, v^U_t, t`` into entry ``t mod M`` of the ring and attends with::

        u^t_s = u_s + sum_{i < M, valid} sigmoid(q^U_s . k_i * scale) v_i   over s < p_i
                                                   (SWL: and p_i - W <= s)
        p_i   = t - (t mod M) + i,   entry i valid iff pos_i == p_i <= t,   u^t_t = 0

    (float32, added in position order, the immediate update's order): exactly the terms
    the update above would have added since the sequence's last fold. ``u`` is written
    only at ``t mod M = M - 1`` (the fold: ``u_s <- u^t_s``, after which every entry is
    stale), and ``u_t = 0`` at every step. So ``u_cache`` holds ``U^t`` only after a fold
    (:func:`castle_decode_fold` folds on demand); a step reads ``u, q^U, k^C, v^C`` and
    writes ``u`` once every ``M`` steps. ``M = 1`` is the immediate update. A fresh ring
    has ``pos = -1`` (nothing pending): the cache is then ``U^{t-1}``, as after a prefill.
    The decision to fold reads only ``cache_seqlens`` on the device, so the step keeps
    its fixed shapes; sequences of different lengths fold at different steps.

    Returns:
        ``o`` ``[B, H, D]`` in ``q_c``'s dtype, or ``(o, lse)``. An inference op: no
        gradient.
    """
    scale = _check_attend(q_c, k_c_cache, v_c_cache, u_cache, cache_seqlens, scale, check_values)
    window = _check_update(u_cache, qu_cache, k_u, v_u, cache_seqlens, window, check_values=False)
    if pending is not None:
        pending = _check_pending(pending, k_u, u_cache)
    backend = resolve_backend(backend, q_c, DECODE_BACKENDS, products=False)
    if backend == "triton":
        if num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= MAX_SPLITS):
            raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
        if u_cache.dtype == torch.float64:
            raise TypeError("backend='triton' takes a float32, bfloat16 or float16 u_cache, got float64")
        if u_cache.stride(-1) != 1:
            raise ValueError(f"u_cache must be contiguous in its last dim, got strides {u_cache.stride()}")
        with torch.no_grad():
            if pending is None:
                o, lse = triton_castle_decode(q_c, k_u, v_u, u_cache, qu_cache, k_c_cache, v_c_cache,
                                              cache_seqlens, scale, window, num_splits)
            else:
                o, lse = triton_castle_decode_deferred(q_c, k_u, v_u, u_cache, qu_cache, k_c_cache,
                                                       v_c_cache, cache_seqlens, *pending, scale,
                                                       window, num_splits)
    elif pending is None:
        _update_torch(u_cache, qu_cache, k_u, v_u, cache_seqlens, scale, window)
        o, lse = _attend_torch(q_c, k_c_cache, v_c_cache, u_cache, cache_seqlens, scale)
    else:
        o, lse = _deferred_step_torch(q_c, k_u, v_u, u_cache, qu_cache, k_c_cache, v_c_cache,
                                      cache_seqlens, pending, scale, window)
    return (o, lse) if return_lse else o


def castle_decode_fold(
    u_cache: Tensor,
    qu_cache: Tensor,
    pending: tuple[Tensor, Tensor, Tensor],
    cache_seqlens: Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """Folds the pending lookahead terms of the deferred step into ``u_cache`` now, in
    place, and empties the ring (``pos = -1``): afterwards ``u_cache[b, :t + 1]`` is
    ``U^t`` (``t = cache_seqlens[b] - 1``, the last token stepped), as after the
    immediate update. The step folds by itself every ``M`` tokens; call this where the
    cache must hold ``U`` in between (eagerly: plain PyTorch, float32 arithmetic). Slot
    ``t`` and the slots past it are left as they are.

    Args: those of :func:`castle_decode_step` of the same names; ``pending`` is its ring.

    Returns:
        ``u_cache``.
    """
    check_tensors(u_cache=u_cache, qu_cache=qu_cache, cache_seqlens=cache_seqlens)
    pend_k = pending[0] if isinstance(pending, tuple | list) and pending else None
    if not isinstance(pend_k, Tensor) or pend_k.dim() != 4 or pend_k.shape[1] < 1:
        raise TypeError("pending must be a tuple (k [B, M, HU, D], v [B, M, HU, D], pos [B, M] int32)")
    k_u = pend_k[:, 0]  # [B, HU, D] the shape a step's k_u has
    pending = _check_pending(pending, k_u, u_cache)
    window = _check_update(u_cache, qu_cache, k_u, k_u, cache_seqlens, window, check_values=False)
    t = cache_seqlens.long() - 1  # [B]
    m = pend_k.shape[1]
    # a sequence whose last step was its fold step has nothing pending
    pending[2].masked_fill_((t % m == m - 1)[:, None], -1)
    u = _deferred_u_torch(u_cache, qu_cache, pending, t, resolve_scale(scale, u_cache.shape[-1]), window)
    slots = torch.arange(u_cache.shape[1], device=u_cache.device)[None, :]  # [1, S]
    write = (slots < t[:, None])[..., None, None]  # [B, S, 1, 1]
    u_cache.copy_(torch.where(write, u.to(u_cache.dtype), u_cache))
    pending[2].fill_(-1)
    return u_cache
