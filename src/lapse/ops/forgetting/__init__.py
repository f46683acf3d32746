"""Forgetting attention (FoX) with Adaptive Computation Pruning (ACP).

SPEC sections 1 and 3. The folder reads top-down: ``common.py`` (checks, the cumulative
gate, the ACP bound and staircase), ``naive.py`` (the materialised oracle),
``chunked.py`` (the PyTorch path), ``pruning.py`` / ``triton_fwd.py`` / ``triton_bwd.py``
(the Triton path), ``decode.py`` / ``decode_triton.py`` (new tokens over a cache), and
here the public function.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..backend import autocast_off, resolve_backend
from .common import (
    ACP_BLOCK,
    LOG_GATE_FLOOR,
    AttentionStats,
    acp_block_start,
    acp_delta,
    cumulative_log_gates,
    pruned_fraction,
    set_value_checks,
    validate,
)
from .decode import forgetting_attention_cached, forgetting_attention_decode
from .decode_input import forgetting_decode_input
from .naive import naive_forgetting_attention
from .paged import forgetting_attention_paged_decode

__all__ = [
    "ACP_BLOCK",
    "LOG_GATE_FLOOR",
    "AttentionStats",
    "cumulative_log_gates",
    "forgetting_attention",
    "forgetting_attention_cached",
    "forgetting_attention_decode",
    "forgetting_attention_paged_decode",
    "forgetting_decode_input",
    "naive_forgetting_attention",
    "set_value_checks",
]


def forgetting_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_fgate: Tensor,
    *,
    scale: float | None = None,
    acp: None | str | float | Tensor = None,
    acp_eps: float = math.exp(-10),
    cu_seqlens: Tensor | None = None,
    return_lse: bool = False,
    return_stats: bool = False,
    backend: str = "auto",
):
    """Causal softmax attention with a forget gate, optionally with ACP block pruning.

    ``O = softmax(scale * Q K^T + D) V`` with ``D_ij = c_i - c_j`` for ``j <= i`` and
    ``c_i = sum_{l <= i} log_fgate_l`` (SPEC section 1). Queries are aligned to the end
    of the keys: with ``Tq < Tk`` query ``i`` sits at key position ``i + Tk - Tq``.
    For ``Tq = 3, Tk = 5`` the allowed pairs (rows: queries, columns: keys) are::

        1 1 1 0 0
        1 1 1 1 0
        1 1 1 1 1

    Args:
        q: ``[B, Tq, HQ, D]`` float16, bfloat16 or float32 (float64 on the torch and
            naive backends). ``D`` up to 256, any value.
        k, v: ``[B, Tk, H, D]``, same dtype; ``HQ`` a multiple of ``H`` (grouped-query).
        log_fgate: ``[B, Tk, HQ]`` float32 log forget gates in ``[-inf, 0]``, one per key
            position and query head (a query uses the gates up to its own position).
        scale: logit scale, ``1 / sqrt(D)`` by default.
        acp: ACP bound ``U >= max |scale q.k|``: ``None`` (dense), ``"auto"`` (from the
            largest query and key norms, one extra pass), a float, or a ``[HQ]`` or
            ``[B, HQ]`` tensor (e.g. from QK-norm gains). Tiles of ``ACP_BLOCK`` x
            ``ACP_BLOCK`` whose largest bias is below ``delta = -2U - log Tk + log eps``
            are skipped in the forward and the backward pass; the skipped attention
            mass of every row is below ``acp_eps`` (SPEC section 3).
        acp_eps: the bound on the pruned mass per row, ``e^-10`` by default.
        cu_seqlens: ``[num_seqs + 1]`` int32 offsets of sequences packed as
            ``[1, total, H, D]`` (queries and keys alike); the gate sum restarts at each.
        return_lse: also return the log-sum-exp ``[B, HQ, Tq]`` float32 (natural log).
        return_stats: also return an :class:`AttentionStats` with the pruned fraction of
            the causal tiles per (sequence, head), computed from the boundary indices.
        backend: ``"auto"`` (Triton on CUDA, else ``"torch"``), ``"triton"``,
            ``"torch"`` (chunked, memory O(T x chunk), any device) or ``"naive"``.

    Returns:
        ``o`` ``[B, Tq, HQ, D]`` in the dtype of ``q``; with ``return_lse`` and/or
        ``return_stats``, a tuple ``(o, lse)``, ``(o, stats)`` or ``(o, lse, stats)``.

    Under ``torch.autocast`` every backend computes as without it, in the dtypes of its
    inputs: float32 ``q, k, v`` give a float32 ``o``, 16-bit ones (an autocast
    projection's) a 16-bit ``o``. Autocast is off inside the forward and inside the torch
    and Triton backwards; the naive backend's backward is autograd's, which follows an
    autocast block it is called in.
    """
    p = validate(q, k, v, log_fgate, scale, cu_seqlens, backend)
    backend = resolve_backend(backend, q)

    with autocast_off(q):  # each backend in its own precision, under autocast too
        with torch.no_grad():
            if backend == "triton":
                from .pruning import triton_acp_block_start
                from .triton_ops import triton_gate_cumsum

                c_hi, c_lo = triton_gate_cumsum(log_fgate, p)  # [B, HQ, Tc] float32 each
                # acp="auto": the norms and the search, two launches and no host copy
                block_start = (None if acp is None
                               else triton_acp_block_start(acp, acp_eps, q, k, c_hi, c_lo, p))
            else:
                delta = None if acp is None else acp_delta(acp, acp_eps, q, k, p)  # [B, HQ]
                c = cumulative_log_gates(log_fgate, cu_seqlens)  # [B, Tk, HQ] float64
                block_start = None if delta is None else acp_block_start(c, delta, p)

        if backend == "naive":
            o, lse = naive_forgetting_attention(
                q, k, v, log_fgate, p.scale, cu_seqlens, block_start, ACP_BLOCK
            )
        elif backend == "torch":
            from .chunked import chunked_forgetting_attention

            o, lse = chunked_forgetting_attention(q, k, v, log_fgate, c, p, block_start)
        else:
            from .triton_ops import triton_forgetting_attention

            o, lse = triton_forgetting_attention(q, k, v, log_fgate, c_hi, c_lo, p, block_start)

    if not (return_lse or return_stats):
        return o
    out = [o]
    if return_lse:
        out.append(lse)
    if return_stats:
        if block_start is None:
            m_blocks = -(-p.tq // ACP_BLOCK)
            block_start = torch.zeros(p.batch, p.hq, m_blocks, dtype=torch.int32, device=q.device)
        out.append(AttentionStats(pruned_fraction(block_start, p), block_start))
    return tuple(out)
