"""CASTLE and CASTLE-SWL: causal attention with lookahead keys (SPEC section 5).

The folder reads top-down: ``common.py`` (checks), ``naive.py`` (the recurrent
definition and the parallel form, the oracles), ``chunked.py`` (the blocked algorithm in
PyTorch), ``triton_fwd.py`` / ``triton_bwd.py`` / ``triton_ops.py`` (the blocked
algorithm as a wavefront of Triton launches), ``parallel.py`` / ``triton_parallel.py``
(the key-major schedule, every key block at once: its PyTorch mirror and its kernels),
``decode.py`` / ``decode_triton.py``
(one token over a UQ-KV cache: the torch references and the fused Triton step),
``paged.py`` / ``paged_triton.py`` (one token over a paged per-kv-head UQ-KV store: the
torch references and the split-K kernel through the page table), and here
the public function. ``README.md`` derives the block formulas.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import autocast_off, resolve_backend
from .common import Problem, validate
from .decode import castle_attention_decode, castle_decode_fold, castle_decode_step, castle_decode_update
from .naive import naive_castle_parallel, naive_castle_recurrent
from .paged import castle_paged_decode_step

__all__ = [
    "castle_attention",
    "castle_attention_decode",
    "castle_decode_fold",
    "castle_decode_step",
    "castle_decode_update",
    "castle_key_scores",
    "castle_lookahead_keys",
    "castle_paged_decode_step",
    "naive_castle_parallel",
    "naive_castle_recurrent",
]


def _one(q_c, k_c, v_c, q_u, k_u, v_u, p: Problem, backend: str) -> tuple[Tensor, Tensor]:
    if backend == "naive":
        return naive_castle_parallel(q_c, k_c, v_c, q_u, k_u, v_u, p.scale, p.window)
    if backend == "torch":
        from .chunked import chunked_castle_attention

        return chunked_castle_attention(q_c, k_c, v_c, q_u, k_u, v_u, p.scale, p.window)
    if backend == "triton-parallel":
        from .triton_ops import triton_parallel_castle_attention

        return triton_parallel_castle_attention(q_c, k_c, v_c, q_u, k_u, v_u, p.scale, p.window)
    from .triton_ops import triton_castle_attention

    return triton_castle_attention(q_c, k_c, v_c, q_u, k_u, v_u, p.scale, p.window)


def castle_attention(
    q_c: Tensor,
    k_c: Tensor,
    v_c: Tensor,
    q_u: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    cu_seqlens: Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Causal attention with lookahead keys: CASTLE (``window=None``) or CASTLE-SWL.

    For every position ``t`` (SPEC section 5)::

        u^t_s = sum_{s < j <= t (, j <= s + W)} sigmoid(q^U_s . k^U_j * scale) v^U_j
        o_t   = softmax_s(q^C_t . k^C_s * scale - SiLU(q^C_t . u^t_s * scale)) v^C_s,  s <= t

    Each key's lookahead vector ``u^t_s`` sees the tokens after ``s`` up to the query's
    own position ``t`` (with SWL at most ``W`` of them), so the mask of the lookahead
    weights (rows ``s``, columns ``j``) for ``t = 3`` and for ``t = 3, W = 1`` is::

        0 1 1 1        0 1 0 0
        0 0 1 1        0 0 1 0
        0 0 0 1        0 0 0 1
        0 0 0 0        0 0 0 0

    (the last row is zero: ``u^t_t = 0``), while the attention itself is causal over
    ``s <= t``. ``window >= T`` gives CASTLE exactly.

    Args:
        q_c, q_u: ``[B, T, H, D]`` causal and lookahead queries, float16, bfloat16 or
            float32 (float64 on the torch and naive backends). ``D`` up to 256.
        k_c, v_c: ``[B, T, HC, D]`` causal keys and values, ``HC`` dividing ``H``
            (grouped-query: query head ``h`` reads head ``h // (H / HC)``).
        k_u, v_u: ``[B, T, HU, D]`` lookahead keys and values, ``HU`` dividing ``H``,
            grouped the same way. The lookahead vectors ``U`` are per query head (they
            depend on ``q_u``), so ``q_u`` always has ``H`` heads.
        scale: the one scale of every score (``q^C . k^C``, ``q^C . u``, ``q^U . k^U``),
            ``1 / sqrt(D)`` by default.
        window: ``None`` (CASTLE) or an int ``W >= 1`` (CASTLE-SWL).
        cu_seqlens: ``[num_seqs + 1]`` int32 offsets of sequences packed as
            ``[1, total, H, D]``; every backend runs the sequences one after another
            (a host read of the offsets, then one call per sequence).
        return_lse: also return the log-sum-exp of the logits, ``[B, H, T]`` float32
            (natural log), differentiable.
        backend: ``"auto"`` (``"triton-parallel"`` on CUDA, else ``"torch"``), ``"triton"`` (the
            blocked algorithm as a wavefront of kernel launches, memory O(T D)),
            ``"triton-parallel"`` (the key-major schedule: every key block at once, rows
            summed with atomics, so results vary in the last bits between runs; memory
            O(T D)),
            ``"torch"`` (the blocked algorithm in PyTorch, float32 math, any device) or
            ``"naive"`` (Theorem 1 materialised, O(T^3)).

    Returns:
        ``o`` ``[B, T, H, D]`` in the dtype of ``q_c``, or ``(o, lse)`` with ``return_lse``.

    Under ``torch.autocast`` every backend computes as without it, in the dtypes of its
    inputs (autocast is off inside the forward and inside the torch and Triton backwards;
    the naive backend's backward is autograd's, which follows an autocast block it is
    called in).
    """
    p = validate(q_c, k_c, v_c, q_u, k_u, v_u, scale, window, cu_seqlens, backend)
    if backend == "triton-parallel":
        resolve_backend("triton", q_c)  # the wavefront's checks: Triton usable, no float64
    elif backend == "auto":
        # the key-major schedule: 1.4-3.0x the wavefront's speed forward+backward at every
        # shape measured on an H100 (BENCHMARKS.md, CASTLE), and less memory
        backend = resolve_backend(backend, q_c)
        # float16 keeps the wavefront: the key-major pass scales rows by a fixed bound, so
        # its probabilities reach e^44, past float16's range before the P.V product
        if backend == "triton" and q_c.dtype != torch.float16:
            backend = "triton-parallel"
    else:
        backend = resolve_backend(backend, q_c)
    six = (q_c, k_c, v_c, q_u, k_u, v_u)
    with autocast_off(q_c):  # each backend in its own precision, under autocast too
        if p.seqlens is None:
            o, lse = _one(*six, p, backend)
        else:
            bounds = [0]
            for n in p.seqlens:
                bounds.append(bounds[-1] + n)
            parts = [_one(*(x[:, s:e] for x in six), p, backend)
                     for s, e in zip(bounds, bounds[1:], strict=False) if e > s]
            o = torch.cat([o for o, _ in parts], dim=1)
            lse = torch.cat([lse for _, lse in parts], dim=2)
    return (o, lse.float()) if return_lse else o


def castle_lookahead_keys(
    q_u: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """The lookahead keys ``U`` at the end of a sequence, ``[B, T, H, D]`` float32 (float64
    for float64 inputs): row ``s`` is ``sum_{s < j < T (, j <= s + W)} sigmoid(q^U_s .
    k^U_j * scale) v^U_j``. What a UQ-KV cache holds after a prefill of ``T`` tokens
    (beside ``q_u``, ``k_c``, ``v_c``); O(T^2 D) time, O(T D) memory, no gradient.

    Args:
        q_u: ``[B, T, H, D]``; k_u, v_u: ``[B, T, HU, D]``, ``HU`` dividing ``H``.
        scale, window: as in :func:`castle_attention`.
    """
    from ..forgetting.common import check_tensors, resolve_scale
    from .chunked import chunked_lookahead_keys
    from .common import check_group, check_window

    check_tensors(q_u=q_u, k_u=k_u, v_u=v_u)
    if q_u.dim() != 4 or k_u.shape != v_u.shape or k_u.dim() != 4 or (
        q_u.shape[:2] + q_u.shape[3:] != k_u.shape[:2] + k_u.shape[3:]
    ):
        raise ValueError(
            "q_u must be [B, T, H, D] and k_u, v_u [B, T, HU, D] of one shape, got "
            f"{tuple(q_u.shape)}, {tuple(k_u.shape)}, {tuple(v_u.shape)}"
        )
    if not (q_u.is_floating_point() and q_u.dtype == k_u.dtype == v_u.dtype):
        raise TypeError(f"q_u, k_u, v_u must share a float dtype, got {q_u.dtype}, "
                        f"{k_u.dtype}, {v_u.dtype}")
    check_group("k_u", k_u, q_u.shape[2])
    return chunked_lookahead_keys(q_u, k_u, v_u, resolve_scale(scale, q_u.shape[-1]),
                                  check_window(window))


def castle_key_scores(
    q_c: Tensor,
    k_c: Tensor,
    q_u: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    alpha: float = 1.0,
) -> Tensor:
    """The accumulated attention of every key of a prompt, for H2O and A2SF (SPEC section
    7): ``A(j) = sum_{i >= j} alpha^(T-1-i) a_ij`` per causal kv head, summed over its query
    heads, with ``a_ij`` CASTLE's probabilities (:func:`castle_attention`: query ``i``'s
    lookahead vectors ``u^i_j`` as of ``i``). What ``lapse.ops.attention_key_scores``
    gives softmax and FoX models, here by the blocked PyTorch pass (one block row of
    logits at a time: O(T^2 D) time, O(T D) memory beside it; no gradient).

    Args:
        q_c, q_u: ``[B, T, H, D]``; k_c: ``[B, T, HC, D]``; k_u, v_u: ``[B, T, HU, D]``;
            ``HC`` and ``HU`` dividing ``H``; one float dtype.
        scale, window: as in :func:`castle_attention`.
        alpha: A2SF's forgetting factor in ``[0, 1]``; 1 is H2O.

    Returns:
        ``[B, T, HC]`` float32 (float64 for float64 inputs). ``sum_j A(j) = (H / HC)
        sum_i alpha^(T-1-i)``.
    """
    from .chunked import chunked_key_scores

    p = validate(q_c, k_c, k_c, q_u, k_u, v_u, scale, window, None, "torch")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    return chunked_key_scores(q_c, k_c, q_u, k_u, v_u, p.scale, p.window, float(alpha))
