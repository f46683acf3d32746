"""Forgetting attention of new tokens over a KV cache that stores ``c_j``.

SPEC section 1 (Decoding) and section 3 (ACP decoding). A new query attends to every
cached key ``j`` up to its own slot ``t`` (from ``s_h``, ``window_start``, where ACP
eviction has cut a head's cache) with logit ``scale * q . k_j + (c_t - c_j)``; the cache
keeps the cumulative log gate ``c_j`` of every key, so nothing is recomputed per step.

Two public functions: :func:`forgetting_attention_decode`, one token per sequence (the
Triton split-K kernels of ``decode_triton.py`` on CUDA), and
:func:`forgetting_attention_cached`, ``T >= 1`` tokens already appended to the cache (a
model layer's call). The file reads: the plain torch references, the checks, the
public functions.

Legend: B batch, T new tokens, S cache capacity, H key/value heads, HQ query heads,
D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import BACKENDS, check_backend, resolve_backend
from ..norm import rms_norm
from .common import (
    _shape,
    check_devices,
    check_float_dtype,
    check_heads,
    check_tensors,
    resolve_scale,
)
from .decode_triton import MAX_SPLITS, triton_decode

# the torch path is the plain reference, so there is no separate naive one
DECODE_BACKENDS = tuple(b for b in BACKENDS if b != "naive")


def _decode_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor | None,
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
    if c_cache is None:  # plain softmax attention
        bias = torch.zeros(b, s, hq, dtype=acc, device=q.device)
    else:
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


def _gated_output_torch(o: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """``RMSNorm_head(o) * sigmoid(gate)`` as the unfused Pro layer computes it: the norm in
    float32 (``lapse.layers.RMSNorm``), rounded to ``o``'s dtype, times the gate's sigmoid
    in ``gate``'s dtype."""
    return rms_norm(o, weight, eps) * torch.sigmoid(gate)


def _cached_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor | None,
    cache_seqlens: Tensor,
    scale: float,
) -> Tensor:
    """``T`` new queries over the cache, materialised: query ``i`` sits at slot
    ``n - T + i`` (``n = cache_seqlens[b]``) and reads the slots up to its own.

    The bias ``c_i - c_j`` is taken in the cache's dtype and only then rounded to float32
    (float64 for float64 ``q``), the rest in float32; slots past ``n`` are zeroed before
    use, so garbage (NaN included) there cannot leak in. Returns ``[B, T, HQ, D]``.
    """
    b, t, hq, _ = q.shape
    s, h = k_cache.shape[1], k_cache.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n = cache_seqlens.long()  # [B]
    pos = torch.arange(s, device=q.device)  # [S]
    pos_q = n[:, None] - t + torch.arange(t, device=q.device)  # [B, T] the queries' slots
    allowed = (pos[None, None, :] <= pos_q[:, :, None])[:, None]  # [B, 1, T, S]
    valid = (pos[None, :] < n[:, None])[:, :, None, None]  # [B, S, 1, 1]
    k = torch.where(valid, k_cache, 0.0).repeat_interleave(hq // h, dim=2).to(acc)  # [B, S, HQ, D]
    v = torch.where(valid, v_cache, 0.0).repeat_interleave(hq // h, dim=2).to(acc)  # [B, S, HQ, D]
    logits = torch.einsum("bthd,bshd->bhts", q.to(acc), k) * scale  # [B, HQ, T, S]
    if c_cache is not None:
        slot_q = pos_q.clamp(0, s - 1)[:, :, None].expand(b, t, hq)  # [B, T, HQ]
        c_q = torch.gather(c_cache, 1, slot_q).transpose(1, 2)  # [B, HQ, T], the cache's dtype
        c_k = c_cache.transpose(1, 2)  # [B, HQ, S]
        logits = logits + torch.where(allowed, c_q[..., None] - c_k[:, :, None, :], 0.0).to(acc)
    p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)  # [B, HQ, T, S]
    return torch.einsum("bhts,bshd->bthd", p, v).to(q.dtype)  # [B, T, HQ, D]


def _validate(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor | None,
    cache_seqlens: Tensor,
    *,
    window_start: Tensor | None,
    out: Tensor | None,
    scale: float | None,
    backend: str,
    check_values: bool,
    new_tokens: bool,
) -> float:
    """Checks the arguments of either public function and returns the scale.

    ``new_tokens``: ``q`` is ``[B, T, HQ, D]`` (``forgetting_attention_cached``), else
    ``[B, HQ, D]``. Values (``cache_seqlens`` in ``[T, S]``, ``window_start``) are read
    back to the host only with ``check_values``.
    """
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens)
    if c_cache is not None:
        tensors["c_cache"] = c_cache
    if window_start is not None:
        tensors["window_start"] = window_start
    if out is not None:
        tensors["out"] = out
    check_tensors(**tensors)
    check_devices(**tensors)
    check_backend(backend, DECODE_BACKENDS)
    if new_tokens and q.dim() != 4:
        raise ValueError(
            f"q must be [batch, new_tokens, query_heads, head_dim], got {_shape(q)}"
        )
    if not new_tokens and q.dim() != 3:
        raise ValueError(f"q must be [batch, query_heads, head_dim], got {_shape(q)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be [batch, capacity, heads, head_dim], got {_shape(t)}"
            )
    check_float_dtype("q", q)
    check_heads(q, k_cache, v_cache, "k_cache", "v_cache")
    b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    t = q.shape[1] if new_tokens else 1
    s = k_cache.shape[1]
    if s < 1:
        raise ValueError(f"k_cache must have a capacity of at least 1, got {_shape(k_cache)}")
    if t < 1 or t > s:
        raise ValueError(f"q has {t} new tokens, expected 1 to the capacity {s}")
    if c_cache is not None and c_cache.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"c_cache must be float32 or float64, got {c_cache.dtype}")
    if c_cache is not None and tuple(c_cache.shape) != (b, s, hq):
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
    scale = resolve_scale(scale, d)
    if check_values:
        if bool(((cache_seqlens < t) | (cache_seqlens > s)).any()):
            raise ValueError(
                f"cache_seqlens must be in [{t}, capacity = {s}], got {cache_seqlens.tolist()[:16]}"
            )
        if window_start is not None and bool(
            ((window_start < 0) | (window_start > cache_seqlens[:, None] - 1)).any()
        ):
            raise ValueError(
                "window_start must be in [0, cache_seqlens - 1] (the new token is always kept)"
            )
    return scale


def _check_out_gate(
    q: Tensor, weight: Tensor | None, gate: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, float] | None:
    """``(weight, gate, eps)`` of the output side once checked, ``None`` without one."""
    if weight is None and gate is None:
        return None
    if weight is None or gate is None:
        raise ValueError("out_norm_weight and out_gate come together (the output norm and gate) "
                         "or not at all")
    b, hq, d = q.shape
    if tuple(weight.shape) != (hq, d) or tuple(gate.shape) != (b, hq, d):
        raise ValueError(
            f"out_norm_weight must be [query_heads, head_dim] = {(hq, d)} and out_gate "
            f"[batch, query_heads, head_dim] = {(b, hq, d)}, got {_shape(weight)} and {_shape(gate)}"
        )
    if gate.dtype != q.dtype or gate.stride(-1) != 1:
        raise ValueError(f"out_gate must be {q.dtype} with a unit stride in its last dim, got {gate.dtype}, "
                         f"strides {gate.stride()}")
    if weight.device != q.device or gate.device != q.device:
        raise ValueError(f"out_norm_weight and out_gate must be on {q.device}")
    return weight, gate, float(eps)


def _decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor | None,
    cache_seqlens: Tensor,
    window_start: Tensor | None,
    scale: float,
    num_splits: int | None,
    backend: str,
    out_gate: tuple[Tensor, Tensor, float] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(o [B, HQ, D], lse [B, HQ])`` on a resolved backend, inputs already checked;
    ``out_gate`` ``(weight, gate, eps)``: ``o`` normed and gated."""
    if backend == "triton":
        with torch.no_grad():  # an inference op: no gradient through the kernels
            return triton_decode(q, k_cache, v_cache, c_cache, cache_seqlens, window_start,
                                 scale, num_splits, *(out_gate or (None, None, 0.0)))
    o, lse = _decode_torch(q, k_cache, v_cache, c_cache, cache_seqlens, window_start, scale)
    return (o, lse) if out_gate is None else (_gated_output_torch(o, *out_gate), lse)


def forgetting_attention_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor | None,
    cache_seqlens: Tensor,
    *,
    scale: float | None = None,
    window_start: Tensor | None = None,
    return_lse: bool = False,
    out: Tensor | None = None,
    num_splits: int | None = None,
    check_values: bool = True,
    backend: str = "auto",
    out_norm_weight: Tensor | None = None,
    out_gate: Tensor | None = None,
    out_norm_eps: float = 1e-6,
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
            difference cancels digits (SPEC section 1, Numerics). ``None``: no forget
            gate, plain softmax attention (the Transformer's step over a dense store).
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
        out_norm_weight, out_gate, out_norm_eps: the Pro block's output side, applied to
            the attention output before it is written (the kernel's epilogue, no pass of
            its own): ``RMSNorm_head(o) * sigmoid(out_gate)`` with gains ``out_norm_weight``
            ``[HQ, D]`` and gate logits ``out_gate`` ``[B, HQ, D]`` in ``q``'s dtype (SPEC
            section 2); both or neither.

    Returns:
        ``o`` ``[B, HQ, D]`` in ``q``'s dtype (``out`` if given), or ``(o, lse)`` with
        ``return_lse`` (``lse`` of the attention, before any output gate). An inference
        op: the Triton path records no gradient.
    """
    scale = _validate(q, k_cache, v_cache, c_cache, cache_seqlens, window_start=window_start,
                      out=out, scale=scale, backend=backend, check_values=check_values,
                      new_tokens=False)
    gated = _check_out_gate(q, out_norm_weight, out_gate, out_norm_eps)
    backend = resolve_backend(backend, q, DECODE_BACKENDS)
    if backend == "triton" and num_splits is not None and not (
        isinstance(num_splits, int) and 1 <= num_splits <= MAX_SPLITS
    ):
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    o, lse = _decode(q, k_cache, v_cache, c_cache, cache_seqlens, window_start, scale,
                     num_splits if backend == "triton" else None, backend, gated)
    if out is not None:
        o = out.copy_(o)
    return (o, lse) if return_lse else o


def forgetting_attention_cached(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    c_cache: Tensor | None,
    cache_seqlens: Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
    check_values: bool = True,
) -> Tensor:
    """Attention of ``T >= 1`` new tokens per sequence that a model layer has just
    appended to its cache, with the forget-gate bias from the cached ``c``.

    The new tokens sit in slots ``[n - T, n)``, ``n = cache_seqlens[b]``; query ``i``
    sits at slot ``n - T + i`` and attends to the slots ``j <= n - T + i`` with logit
    ``scale * q_i . k_j + (c_i - c_j)``, ``c_i`` being ``c_cache`` at the query's own
    slot (SPEC section 1). For ``T = 2``, ``cache_seqlens = [3, 5]`` and capacity 6 the
    slots read are (rows: queries)::

        1 1 0 0 0 0      1 1 1 1 0 0
        1 1 1 0 0 0      1 1 1 1 1 0

    ``T = 1`` is exactly ``forgetting_attention_decode(q[:, 0], ...)[:, None]`` (the
    Triton split-K kernel on CUDA). ``T > 1`` runs a materialised torch path on every
    backend: the bias ``c_i - c_j`` taken in ``c_cache``'s dtype and only then rounded to
    float32, the rest in float32 (float64 for float64 inputs), a masked softmax. Dense:
    ACP prunes only in the full-sequence op.

    Args:
        q: ``[B, T, HQ, D]`` float16, bfloat16 or float32 (float64 on the torch backend),
            the new tokens' queries; ``T`` at most ``S``. ``D`` up to 256, any value.
        k_cache, v_cache: ``[B, S, H, D]``, same dtype as ``q``, capacity ``S``; ``HQ`` a
            multiple of ``H`` (grouped-query). Slots from ``cache_seqlens`` on are never
            read and may hold anything.
        c_cache: ``[B, S, HQ]`` float64 or float32, the cumulative log gate of every
            cached key for every query head (finite: build it with
            ``cumulative_log_gates``, whose ``initial`` continues a cached sequence);
            ``None``: plain softmax attention.
        cache_seqlens: ``[B]`` int32, the number of valid slots *including* the ``T``
            new tokens, in ``[T, S]``.
        scale: logit scale, ``1 / sqrt(D)`` by default.
        backend: ``"auto"`` (Triton on CUDA, else torch), ``"triton"`` or ``"torch"``;
            it chooses the path of ``T = 1``.
        check_values: check that ``cache_seqlens`` lies in ``[T, S]`` (one host-device
            sync); pass False inside a captured or compiled decode step.

    Returns:
        ``o`` ``[B, T, HQ, D]`` in ``q``'s dtype. An inference op: the Triton path records
        no gradient.
    """
    scale = _validate(q, k_cache, v_cache, c_cache, cache_seqlens, window_start=None,
                      out=None, scale=scale, backend=backend, check_values=check_values,
                      new_tokens=True)
    # several new tokens take the torch path, which multiplies no Triton tiles
    backend = resolve_backend(backend, q, DECODE_BACKENDS, products=q.shape[1] == 1)
    if q.shape[1] == 1:
        o, _ = _decode(q[:, 0], k_cache, v_cache, c_cache, cache_seqlens, None, scale, None,
                       backend)  # [B, HQ, D]
        return o[:, None]  # [B, 1, HQ, D]
    return _cached_torch(q, k_cache, v_cache, c_cache, cache_seqlens, scale)
