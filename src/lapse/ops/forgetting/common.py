"""Shared pieces of forgetting attention: input checks, the cumulative log gate, ACP.

SPEC sections 1 and 3. Every backend goes through :func:`prepare`, so all of them see
the same validated shapes, the same cumulative gate ``c`` and the same pruning decision.

Shapes (legend used in this file): B batch (or number of packed sequences), Tq/Tk query
and key length, HQ query heads, H key/value heads, D head dim, M = ceil(Tq / G) query
blocks and N = ceil(Tk / G) key blocks of the ACP granularity G = ``ACP_BLOCK``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from ..backend import check_backend

# ACP prunes whole tiles of ACP_BLOCK x ACP_BLOCK (query x key) positions. It is one
# fixed granularity for every backend and for the forward and backward passes, so all
# of them compute exactly the same pruned function whatever tile sizes their kernels use.
ACP_BLOCK = 64

# An RMS-normalised vector with gains g has norm at most max|g| sqrt(D) in exact arithmetic;
# stored in a 16-bit float each element is rounded (by at most 2^-8 of itself in bfloat16,
# 2^-11 in float16), which can lift the norm above that by the same factor. The layers' RMSNorm
# works in float32 and rounds once; the fused decode input rounds twice (to the projection's
# dtype, then to the cache's). Allowing two roundings of each of q and k keeps the bound from
# QK-norm gains a bound for the tensors the kernels read (SPEC section 3 gives the exact one).
QK_NORM_ROUNDING = (1 + 2.0**-8) ** 4


def qk_norm_bound(g_q: Tensor | float, g_k: Tensor | float, d: int, scale: float):
    """``U >= max |scale q.k|`` for RMS-normalised ``q``, ``k`` of head dim ``d`` with largest
    absolute gains ``g_q``, ``g_k`` (per head, or numbers): ``g_q g_k d scale`` times
    :data:`QK_NORM_ROUNDING`, so it holds after rounding to bfloat16 or float16."""
    return g_q * g_k * d * scale * QK_NORM_ROUNDING


# log f = -inf (a gate that forgets everything) is allowed. A cumulative sum through
# -inf would give c_i - c_j = -inf - (-inf) = NaN, so log gates are floored here: a pair
# separated by a floored gate has bias <= LOG_GATE_FLOOR and a weight that is exactly 0
# in float32 for any |scale * q.k| below ~900, the same as the -inf the user meant.
LOG_GATE_FLOOR = -1000.0

_value_checks = False


def set_value_checks(enabled: bool) -> bool:
    """Turns the check of log-gate values (no NaN, none positive) on CUDA on or off;
    returns the previous setting. Off by default.

    On CUDA the check reads a flag back to the host: a synchronisation that stops the CPU
    from queueing the next kernels while the GPU works, so a call whose kernels are short
    (ACP's, or a small batch's) waits for its own launches. Off, a bad gate gives a NaN or
    a wrong output instead of an error, as any attention op's NaN input does; turn it on
    to find where a model's gates go wrong. On a CPU the check always runs (it costs no
    wait there). Shapes, dtypes and devices are always checked.
    """
    global _value_checks
    previous, _value_checks = _value_checks, bool(enabled)
    return previous


@dataclass(frozen=True)
class AttentionStats:
    """What ACP did in one call.

    Attributes:
        pruned_fraction: ``[B, HQ]`` float32, pruned tile area / causal tile area of each
            (sequence, head): the share of attention FLOPs that were skipped.
        block_start: ``[B, HQ, M]`` int32, the first kept key block (in units of
            ``ACP_BLOCK``) of every query block; keys before it were pruned.
    """

    pruned_fraction: Tensor
    block_start: Tensor


@dataclass(frozen=True)
class Problem:
    """Validated shapes of one call."""

    batch: int  # B, or the number of packed sequences with cu_seqlens
    tq: int  # query length (max sequence length with cu_seqlens)
    tk: int  # key length (max sequence length with cu_seqlens)
    hq: int
    h: int
    d: int
    scale: float
    cu_seqlens: Tensor | None  # int32 [B + 1] (device of q)
    seqlens: list[int] | None  # host copy of the packed sequence lengths


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensors(**tensors: object) -> None:
    """Raises ``TypeError`` naming the first argument that is not a tensor."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_devices(q: Tensor, **tensors: Tensor) -> None:
    """Raises ``ValueError`` naming the first tensor that is not on ``q``'s device."""
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def check_float_dtype(name: str, t: Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_heads(q: Tensor, k: Tensor, v: Tensor, k_name: str = "k", v_name: str = "v") -> None:
    """Queries ``[B, ..., HQ, D]`` against keys and values ``[B, T, H, D]`` (ranks already
    checked): one dtype, ``k`` and ``v`` of one shape, the same batch and head dim, ``D``
    in [1, 256] and ``HQ`` a multiple of ``H`` (grouped-query)."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, {k_name}, {v_name} must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"{k_name} and {v_name} must have the same shape, got {_shape(k)} and {_shape(v)}"
        )
    b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    bk, h, dk = k.shape[0], k.shape[2], k.shape[3]
    if bk != b:
        raise ValueError(f"{k_name} has batch {bk} but q has batch {b}")
    if dk != d:
        raise ValueError(f"{k_name} has head_dim {dk} but q has head_dim {d}")
    if d < 1 or d > 256:
        raise ValueError(f"head_dim must be in [1, 256], got {d}")
    if h < 1 or hq % h != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({h}) (grouped-query)"
        )


def real_number(name: str, x) -> float:
    """``x`` as a float: a real number (Python's or NumPy's; not a bool or a tensor), else
    ``TypeError`` naming the argument and the type it got."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(x).__name__} {x!r}")
    return float(x)


def resolve_scale(scale: float | None, d: int) -> float:
    """The logit scale: ``1 / sqrt(d)`` for ``None``, else a checked positive number."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    value = real_number("scale", scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return value


def _check_gate_values(log_fgate: Tensor) -> None:
    # Positive log gates would make c increase and break causal decay; NaN is never valid.
    bad = torch.isnan(log_fgate) | (log_fgate > 0)
    if bool(bad.any()):
        raise ValueError(
            "log_fgate must hold log forget gates in [-inf, 0] (logsigmoid of the gate "
            f"logits); found {int(bad.sum())} entries that are positive or NaN"
        )


def validate(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_fgate: Tensor,
    scale: float | None,
    cu_seqlens: Tensor | None,
    backend: str,
) -> Problem:
    """Checks every argument and returns the problem's shapes; raises on bad input."""
    check_tensors(q=q, k=k, v=v, log_fgate=log_fgate)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, time, heads, head_dim], got {_shape(t)}")
        check_float_dtype(name, t)
    check_devices(q, k=k, v=v, log_fgate=log_fgate)
    check_heads(q, k, v)
    if log_fgate.dtype != torch.float32 and not (
        log_fgate.dtype == torch.float64 and q.dtype == torch.float64
    ):
        raise TypeError(
            f"log_fgate must be float32 (log space, SPEC section 1), got {log_fgate.dtype}"
        )
    if log_fgate.dim() != 3:
        raise ValueError(f"log_fgate must be [batch, time, heads], got {_shape(log_fgate)}")
    b, tq, hq, d = q.shape
    tk, h = k.shape[1], k.shape[2]
    if tq > tk:
        raise ValueError(
            f"q has {tq} positions but k has {tk}: queries must not outnumber keys "
            "(they are aligned to the end of the keys)"
        )
    if tuple(log_fgate.shape) != (b, tk, hq):
        raise ValueError(
            f"log_fgate must be [batch, key_time, query_heads] = {(b, tk, hq)}, "
            f"got {_shape(log_fgate)}"
        )
    check_backend(backend)
    scale = resolve_scale(scale, d)
    # Positive log gates would make c increase and break causal decay; NaN is never valid.
    if _value_checks or not log_fgate.is_cuda:
        _check_gate_values(log_fgate)
    seqlens = None
    if cu_seqlens is not None:
        if tq != tk:
            raise ValueError("with cu_seqlens, q and k must have the same (packed) length")
        seqlens = check_cu_seqlens(cu_seqlens, q, "q", b, tk)
        b = len(seqlens)
        tq = tk = max(seqlens)
    return Problem(b, tq, tk, hq, h, d, scale, cu_seqlens, seqlens)


def check_cu_seqlens(cu_seqlens, q: Tensor, name: str, batch: int, t: int) -> list[int]:
    """The packed sequences' lengths from ``cu_seqlens`` (read on the host), after the
    checks every varlen op makes: a 1-D int32 tensor on ``q``'s device, ``q`` (called
    ``name``) packed as ``[1, t, H, D]``, offsets from 0 to ``t`` that never decrease."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor [num_seqs + 1], got {_shape(cu_seqlens)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but {name} is on {q.device}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens, {name} must be packed as [1, total, H, D], got {_shape(q)}")
    host = cu_seqlens.tolist()
    if host[0] != 0 or host[-1] != t or any(e < s for s, e in zip(host, host[1:], strict=False)):
        raise ValueError(
            "cu_seqlens must start at 0, be non-decreasing and end at the packed length "
            f"{t}, got {host if len(host) <= 12 else host[:6] + ['...'] + host[-3:]}"
        )
    return [e - s for s, e in zip(host, host[1:], strict=False)]


def _sequence_ids(cu_seqlens: Tensor, t: int) -> Tensor:
    """Index of the packed sequence that holds each of the ``t`` tokens, ``[t]`` int64."""
    tokens = torch.arange(t, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:-1].long(), tokens, right=True)


def cumulative_log_gates(
    log_fgate: Tensor,
    cu_seqlens: Tensor | None = None,
    *,
    initial: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """c_i = initial + sum_{l <= i} max(log f_l, LOG_GATE_FLOOR), restarting at every
    sequence start.

    Summed in float64, which keeps ``c_i - c_j`` exact to ~1e-12 even when ``c`` reaches
    -1e5 at long context (SPEC section 1, the cancellation note); kernels then split it
    into a float32 pair (:func:`split_hi_lo`).

    Args:
        log_fgate: ``[B, T, HQ]`` log forget gates.
        cu_seqlens: optional packed-sequence offsets, as in ``forgetting_attention``.
        initial: optional ``[B, HQ]``, the ``c`` of the position before the first one
            (a decoding cache continues its sequences from it), added to every row;
            ``None``: from 0. Not with ``cu_seqlens``.
        dtype: of the result (float64 by default, what a decoding cache should keep).

    Returns:
        ``[B, T, HQ]`` in ``dtype``.
    """
    r = log_fgate.to(torch.float64).clamp_min(LOG_GATE_FLOOR)
    c = torch.cumsum(r, dim=1)
    if cu_seqlens is not None:
        if initial is not None:
            raise ValueError("cumulative_log_gates takes initial or cu_seqlens, not both")
        starts = cu_seqlens[:-1].long()
        seq_id = _sequence_ids(cu_seqlens, c.shape[1])
        # c at the token before each sequence's first token (0 for the first sequence)
        prefix = torch.cat([c.new_zeros(1, 1, c.shape[2]), c[:, :-1]], dim=1)
        c = c - prefix[:, starts[seq_id]]  # starts[seq_id] <= t: empty sequences never indexed
    if initial is not None:
        check_tensors(initial=initial)
        expected = (log_fgate.shape[0], log_fgate.shape[2])
        if tuple(initial.shape) != expected:
            raise ValueError(f"initial must be [batch, heads] = {expected}, got {_shape(initial)}")
        c = c + initial[:, None]
    return c.to(dtype)


def split_hi_lo(c: Tensor) -> tuple[Tensor, Tensor]:
    """Splits float64 ``[B, T, HQ]`` into float32 ``hi + lo``, each ``[B, HQ, T]`` contiguous.

    In a kernel ``(hi_i - ref) + lo_i`` with ``ref`` a nearby ``hi`` is exact up to the
    rounding of ``lo`` (Sterbenz: close float32 values subtract exactly), so the bias
    ``c_i - c_j`` keeps float64-like accuracy with float32 arithmetic.
    """
    hi = c.to(torch.float32)
    lo = (c - hi.to(torch.float64)).to(torch.float32)
    return hi.transpose(1, 2).contiguous(), lo.transpose(1, 2).contiguous()


def reverse_segment_cumsum(dc: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """dr_t = sum_{i >= t, same sequence} dc_i along dim 1 (float64 in, float64 out)."""
    rc = dc.flip(1).cumsum(1).flip(1)
    if cu_seqlens is not None:
        t = dc.shape[1]
        ends = cu_seqlens[1:].long()
        seq_id = _sequence_ids(cu_seqlens, t)
        tail = torch.cat([rc, rc.new_zeros(rc.shape[0], 1, rc.shape[2])], dim=1)
        rc = rc - tail[:, ends][:, seq_id]
    return rc


def gate_grad_from_dc(dc: Tensor, log_fgate: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """d loss / d log_fgate from d loss / d c (SPEC section 1): a reverse cumulative sum.

    Floored gates (log f below LOG_GATE_FLOOR, -inf included) get gradient 0, as a clamp
    would give them.
    """
    dr = reverse_segment_cumsum(dc.to(torch.float64), cu_seqlens)
    dr = torch.where(log_fgate < LOG_GATE_FLOOR, 0.0, dr)
    return dr.to(log_fgate.dtype)


def _per_sequence_max(x: Tensor, p: Problem) -> Tensor:
    """x: [B, T, HQ] -> per (sequence, head) max over time, [B_seq, HQ]."""
    if p.cu_seqlens is None:
        return x.amax(dim=1)
    t = x.shape[1]
    seq_id = _sequence_ids(p.cu_seqlens, t)
    out = x.new_zeros(p.batch, x.shape[2])
    return out.scatter_reduce_(0, seq_id[:, None].expand_as(x[0]), x[0], "amax", include_self=True)


def acp_bound_from_data(q: Tensor, k: Tensor, p: Problem) -> Tensor:
    """U_bh = max_i ||q_i|| * max_j ||k_j|| * scale (SPEC section 3), ``[B, HQ]`` float32."""
    # the dtype argument upcasts inside the reduction (no float32 copy of q and k)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qn = torch.linalg.vector_norm(q, dim=-1, dtype=acc).float()  # [B, Tq, HQ]
    kn = torch.linalg.vector_norm(k, dim=-1, dtype=acc).float()  # [B, Tk, H]
    group = p.hq // p.h
    kn = kn.repeat_interleave(group, dim=2)  # [B, Tk, HQ]
    return _per_sequence_max(qn, p) * _per_sequence_max(kn, p) * p.scale


def check_acp_eps(acp_eps) -> None:
    """Raises ``TypeError`` unless ``acp_eps`` is a number (:func:`real_number`), ``ValueError``
    unless it is in (0, 1)."""
    if not 0 < real_number("acp_eps", acp_eps) < 1:
        raise ValueError(f"acp_eps must be in (0, 1), got {acp_eps!r}")


def acp_delta(
    acp, acp_eps: float, q: Tensor, k: Tensor, p: Problem, bound_from_data=None, delta_from_data=None
) -> Tensor:
    """delta = -2U - log L + log eps for every (sequence, head), ``[B, HQ]`` float64.

    ``L`` is the key length of each sequence, so every pruned weight is below eps / L and
    the pruned mass of any row is below eps. ``bound_from_data(q, k, p)`` computes U for
    ``acp="auto"`` (default: :func:`acp_bound_from_data`); ``delta_from_data(q, k, p,
    acp_eps)``, when given, the whole delta for ``acp="auto"`` (the Triton path passes
    kernels for either).
    """
    check_acp_eps(acp_eps)
    if isinstance(acp, str):
        if acp != "auto":
            raise ValueError(f"acp must be None, 'auto', a float or a tensor, got {acp!r}")
        if delta_from_data is not None:
            return delta_from_data(q, k, p, acp_eps)
        u = (bound_from_data or acp_bound_from_data)(q, k, p)
    elif isinstance(acp, (int, float)) and not isinstance(acp, bool):
        if not math.isfinite(acp) or acp < 0:
            raise ValueError(f"acp (the bound U) must be a finite non-negative number, got {acp}")
        u = torch.full((p.batch, p.hq), float(acp), device=q.device)
    elif isinstance(acp, Tensor):
        if acp.dim() == 1 and acp.shape[0] == p.hq:
            u = acp.to(q.device, torch.float32)[None].expand(p.batch, p.hq)
        elif acp.dim() == 2 and tuple(acp.shape) == (p.batch, p.hq):
            u = acp.to(q.device, torch.float32)
        else:
            raise ValueError(
                f"acp as a tensor must be [query_heads] = [{p.hq}] or [batch, query_heads] = "
                f"[{p.batch}, {p.hq}], got shape {tuple(acp.shape)}"
            )
        # a host read (a sync on CUDA), so it follows the value-check setting
        if (_value_checks or not u.is_cuda) and bool((~torch.isfinite(u) | (u < 0)).any()):
            raise ValueError("acp (the bound U) must be finite and non-negative")
    else:
        raise TypeError(f"acp must be None, 'auto', a float or a tensor, got {type(acp).__name__}")
    if p.seqlens is None:
        length = torch.full((p.batch, 1), float(p.tk), device=q.device, dtype=torch.float64)
    else:
        length = torch.tensor(p.seqlens, device=q.device, dtype=torch.float64).clamp_min(1)[:, None]
    return -2.0 * u.double() - torch.log(length) + math.log(acp_eps)


def _sequence_view(x: Tensor, p: Problem) -> Tensor:
    """[B or 1, T_packed, HQ] -> [B_seq, T_max, HQ], padding with the last valid value."""
    if p.cu_seqlens is None:
        return x
    out = x.new_empty(p.batch, p.tk, x.shape[2])
    for i, (s, n) in enumerate(zip(p.cu_seqlens.tolist()[:-1], p.seqlens, strict=False)):
        if n == 0:
            out[i] = 0
            continue
        out[i, :n] = x[0, s : s + n]
        out[i, n:] = x[0, s + n - 1]
    return out


def acp_block_start(c: Tensor, delta: Tensor, p: Problem, block: int = ACP_BLOCK) -> Tensor:
    """First kept key block of every query block (SPEC section 3, the staircase).

    Tile (m, n) is pruned iff it lies strictly below the diagonal (its last key precedes
    its first query) and its largest bias ``c[first query of m] - c[last key of n]`` is
    below ``delta``. Because ``c`` is non-increasing the pruned tiles of a query block
    are a prefix of its key blocks, so the count of pruned tiles is the first kept one.
    This is the reference (vectorised compare, O(M N) per head); the Triton path uses
    :mod:`lapse.ops.forgetting.pruning`. Returns ``[B, HQ, M]`` int32.

    c: ``[B, Tk, HQ]`` float64 from :func:`cumulative_log_gates`; delta: ``[B, HQ]``.
    """
    cs = _sequence_view(c, p)  # [B, Tk, HQ]
    m_blocks = -(-p.tq // block)
    n_blocks = -(-p.tk // block)
    if p.seqlens is None:
        lengths = [p.tk] * p.batch
    else:
        lengths = p.seqlens
    tk_b = torch.tensor(lengths, device=c.device)[:, None]  # [B, 1]
    off = tk_b - (p.tq if p.seqlens is None else tk_b)  # query i sits at key position i + off
    first_q = torch.arange(m_blocks, device=c.device)[None] * block + off  # [B, M]
    last_k = torch.arange(n_blocks, device=c.device)[None] * block + block - 1  # [1, N]
    last_k = torch.minimum(last_k, tk_b - 1)  # [B, N]
    fq = first_q.clamp(0, cs.shape[1] - 1)
    c_first = torch.gather(cs, 1, fq[:, :, None].expand(-1, -1, p.hq))  # [B, M, HQ]
    c_last = torch.gather(cs, 1, last_k.clamp_min(0)[:, :, None].expand(-1, -1, p.hq))  # [B, N, HQ]
    bias = c_first[:, :, None, :] - c_last[:, None, :, :]  # [B, M, N, HQ]
    below = last_k[:, None, :] < first_q[:, :, None]  # [B, M, N] strictly causal tile
    # query blocks past a (packed) sequence's end hold no rows: nothing pruned there
    in_seq = (torch.arange(m_blocks, device=c.device)[None] * block < tk_b - off)  # [B, M]
    pruned = (below & in_seq[:, :, None])[..., None] & (bias < delta[:, None, None, :])
    return pruned.sum(dim=2).to(torch.int32).permute(0, 2, 1).contiguous()  # [B, HQ, M]


def pruned_fraction(block_start: Tensor, p: Problem, block: int = ACP_BLOCK) -> Tensor:
    """Pruned tile area / causal tile area per (sequence, head), from the boundary indices.

    A tile counts with its full area (it is what a dense kernel would compute), clipped at
    the sequence end; the causal tiles of a query block are the key blocks up to the one
    holding its last query. Returns ``[B, HQ]`` float32.
    """
    dev = block_start.device
    lengths = torch.tensor(p.seqlens if p.seqlens is not None else [p.tk] * p.batch, device=dev)
    tq = lengths if p.seqlens is not None else torch.full_like(lengths, p.tq)
    pruned, causal = tile_areas(block_start, tq, lengths, block)
    return (pruned / causal.clamp_min(1)[:, None]).float()


def tile_areas(block_start: Tensor, tq: Tensor, tk: Tensor, block: int = ACP_BLOCK) -> tuple[Tensor, Tensor]:
    """The pruned tile area ``[B, HQ]`` and the causal tile area ``[B]`` (float64) of a call
    whose ``tq`` ``[B]`` queries sit at the end of its ``tk`` ``[B]`` keys, from its
    boundary indices ``[B, HQ, M]``: what :func:`pruned_fraction` divides, and what calls
    on parts of one sequence (context parallelism) add up."""
    m = torch.arange(block_start.shape[-1], device=block_start.device)[None]  # [1, M]
    rows = (tq[:, None] - m * block).clamp(0, block)  # [B, M]
    last_q = (m * block + rows - 1 + (tk - tq)[:, None]).clamp_min(0)  # [B, M]
    causal_cols = torch.minimum((last_q // block + 1) * block, tk[:, None])  # [B, M]
    causal = (rows * causal_cols).sum(1).double()  # [B]
    pruned = (rows[:, None, :] * block_start.long() * block).sum(-1).double()  # [B, HQ]
    return pruned, causal
