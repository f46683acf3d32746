"""Accumulated attention per key for H2O and A2SF, without an L x L matrix (SPEC section 7).

After a prompt of ``T`` tokens, H2O and A2SF rank each key ``j`` by the (decayed) sum of
the attention probabilities it received from every prompt query::

    A(j) = sum_{i >= j} alpha^(T-1-i) a_ij,    a_ij = softmax_j(scale q_i.k_j + D_ij)

with ``D_ij = c_i - c_j`` for forgetting attention (``c`` the cumulative log gate, SPEC
section 1) and 0 for softmax attention. ``alpha = 1`` is H2O, ``alpha < 1`` is A2SF's
prefill score; for grouped heads ``A`` is summed over the query heads of a key head.

``a_ij = exp(s_ij - lse_i)`` once the row's log-sum-exp ``lse_i`` is known, so the
weighted column sum is a second tiled pass over the same logits: per tile, subtract the
row shift ``lse_i - log w_i`` (``log w_i = (T-1-i) log alpha``, float64), exponentiate,
and sum over the rows. ``lse`` comes from the forward (``forgetting_attention(...,
return_lse=True)``) or from a first tiled pass here.

The file reads top-down: the checks, the weights, the materialised reference
(``naive``), the chunked PyTorch path (``torch``), the public function. The Triton
kernels are in :mod:`lapse.ops.scores_triton`.

Shapes (legend): B batch, T prompt length, HQ query heads, H key/value heads, G = HQ / H
query heads per key head, D head dim, Cq/Ck the current query/key chunk lengths,
R = Cq * G rows of a query chunk (ordered (position, group member)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import check_backend, resolve_backend
from .forgetting import common as fox
from .forgetting.common import (
    check_devices,
    check_float_dtype,
    check_tensors,
    cumulative_log_gates,
    resolve_scale,
)

# Tile lengths of the torch backend (queries x keys) when ``chunk_size`` is None; the
# values chunked forgetting attention measured fastest on a 2-core CPU.
CHUNK_Q = 128
CHUNK_K = 256

# exp's vectorised CPU kernel is 10-25x slower where its result is subnormal or its
# argument far below that range, which is where most far keys of a fast-decaying FoX head
# land (measured at T = 4096, HQ = 8, D = 64, 2 cores: 200 of the 275 ms of a scores pass
# went to exp; 98 ms in all with this flush). Arguments are clamped and results below
# exp(floor + 0.5) flushed to 0: an absolute change below 3e-38 per pair in float32.
_EXP_FLOOR = {torch.float32: -87.0, torch.float64: -708.0}


@dataclass(frozen=True)
class _Problem:
    """Validated shapes of one call."""

    batch: int
    t: int
    hq: int
    h: int
    d: int
    scale: float
    alpha: float


def _shape(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_float32_log(name: str, t: Tensor, q: Tensor, expected: tuple[int, ...], layout: str):
    """A log-space side input: float32 (float64 only with float64 q), shape ``expected``."""
    if t.dtype != torch.float32 and not (t.dtype == torch.float64 and q.dtype == torch.float64):
        raise TypeError(f"{name} must be float32 (log space), got {t.dtype}")
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must be {layout} = {expected}, got {_shape(t)}")


def _validate(q, k, log_fgate, lse, scale, alpha, chunk_size, backend) -> _Problem:
    """Checks every argument and returns the problem's shapes; raises on bad input."""
    check_tensors(q=q, k=k)
    if log_fgate is not None:
        check_tensors(log_fgate=log_fgate)
    if lse is not None:
        check_tensors(lse=lse)
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, time, heads, head_dim], got {_shape(t)}")
        check_float_dtype(name, t)
    extra = {n: t for n, t in (("log_fgate", log_fgate), ("lse", lse)) if t is not None}
    check_devices(q, k=k, **extra)
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    b, t, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != t:
        raise ValueError(
            f"k must be [batch, time, kv_heads, head_dim] with the batch and time of q "
            f"({b}, {t}): the queries are the prompt's own positions; got {_shape(k)}"
        )
    h = k.shape[2]
    if k.shape[3] != d:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has head_dim {d}")
    if d < 1 or d > 256:
        raise ValueError(f"head_dim must be in [1, 256], got {d}")
    if h < 1 or hq % h != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({h}) (grouped-query)"
        )
    if log_fgate is not None:
        _check_float32_log("log_fgate", log_fgate, q, (b, t, hq), "[batch, time, query_heads]")
    if lse is not None:
        # the layout forgetting_attention(..., return_lse=True) returns
        _check_float32_log("lse", lse, q, (b, hq, t), "[batch, query_heads, time]")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"alpha must be a number in [0, 1], got {type(alpha).__name__}")
    if not 0.0 <= alpha <= 1.0:  # NaN fails too
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    check_backend(backend)
    scale = resolve_scale(scale, d)
    # the same value check as forgetting_attention, under the same switch
    if log_fgate is not None and (fox._value_checks or not log_fgate.is_cuda):
        fox._check_gate_values(log_fgate)
    return _Problem(b, t, hq, h, d, scale, float(alpha))


def log_weights(t: int, alpha: float, device=None) -> Tensor:
    """``log alpha^(T-1-i)`` for i in [0, T): ``[T]`` float64, ``-inf`` for weight 0.

    Taken in logs so long prompts underflow to a weight of 0 instead of computing a
    power; ``alpha = 0`` keeps only the last query (``0^0 = 1``).
    """
    n = torch.arange(t - 1, -1, -1, dtype=torch.float64, device=device)  # T-1-i
    if alpha == 0:
        return torch.where(n == 0, 0.0, float("-inf"))
    return n * math.log(alpha)


def first_live_query(t: int, alpha: float, dtype: torch.dtype) -> int:
    """The first query whose weighted probabilities can be nonzero in ``dtype``.

    A term is ``exp(s_ij - lse_i + log w_i) <= w_i``; below half the smallest subnormal
    of ``dtype`` (less a margin of e for the rounding of ``s - lse``) it rounds to 0, so
    the queries before the returned one are skipped exactly. At alpha = 0.9 in float32
    that leaves the last ~1000 queries of any prompt.
    """
    if alpha == 1 or t == 0:
        return 0
    if alpha == 0:
        return t - 1
    bits = 150 if dtype != torch.float64 else 1075
    cutoff = -bits * math.log(2.0) - 1.0  # log of the largest weight that vanishes
    n_live = math.floor(cutoff / math.log(alpha)) + 1  # conservative by one query
    return max(0, t - 1 - n_live)


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def naive_attention_key_scores(
    q: Tensor,
    k: Tensor,
    log_fgate: Tensor | None,
    lse: Tensor | None,
    scale: float,
    alpha: float,
) -> Tensor:
    """A(j), materialised ``[B, HQ, T, T]``: the test oracle, sharing no code with the
    fast paths.

    ``log f = -inf`` is exact here (a pair separated by it gets -inf, not the floor the
    fast paths use), the weights are powers (``alpha ** n``), not logs. The logits come
    out of the matmul in the input dtype and the rest runs in float32 (float64 for
    float64 inputs), so float16 inputs give "the same PyTorch math in the kernel's dtype".

    Args: as :func:`attention_key_scores` (validated). Returns ``[B, T, H]`` float32
    (float64 for float64 inputs).
    """
    acc = _accum_dtype(q.dtype)
    b, t, hq, _ = q.shape
    h = k.shape[2]
    g = hq // h
    k_rep = k.repeat_interleave(g, dim=2)  # [B, T, HQ, D]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k_rep).to(acc) * scale  # [B, HQ, T, T]
    if log_fgate is not None:
        r = log_fgate.to(acc).transpose(1, 2)  # [B, HQ, T]
        dead = torch.isneginf(r)
        c = torch.cumsum(torch.where(dead, 0.0, r), dim=-1)  # [B, HQ, T]
        n_dead = torch.cumsum(dead.long(), dim=-1)  # [B, HQ, T]
        bias = c[..., :, None] - c[..., None, :]  # [B, HQ, T, T]
        separated = (n_dead[..., :, None] - n_dead[..., None, :]) > 0  # a -inf gate in (j, i]
        s = s + torch.where(separated, float("-inf"), bias)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()  # [T, T] key <= query
    s = s.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(s, dim=-1) if lse is None else lse.to(acc)  # [B, HQ, T]
    prob = torch.exp(s - lse[..., None])  # [B, HQ, T, T]
    exponent = torch.arange(t - 1, -1, -1, device=q.device, dtype=torch.float64)
    w = torch.pow(torch.tensor(alpha, dtype=torch.float64), exponent).to(acc)  # [T]
    a = torch.einsum("bhqk,q->bkh", prob, w)  # [B, T, HQ]
    return a.reshape(b, t, h, g).sum(dim=-1)  # [B, T, H]


class _Scratch:
    """One reusable flat buffer for the tiles (fresh large CPU allocations cost more than
    the arithmetic done on them; see chunked forgetting attention)."""

    def __init__(self, numel: int, like: Tensor):
        self.buf = like.new_empty(numel)

    def take(self, *shape: int) -> Tensor:
        return self.buf[: math.prod(shape)].view(shape)


def _exp_flushed_(x: Tensor) -> Tensor:
    """exp(x) in place, with results that would be subnormal flushed to exactly 0."""
    floor = _EXP_FLOOR[x.dtype]
    return F.threshold_(x.clamp_min_(floor).exp_(), math.exp(floor + 0.5), 0.0)


def _logits(scratch, q_c, k_h, c_h, i0, i1, j0, j1) -> Tensor:
    """Masked logits ``scale q k^T + D`` of one tile, ``[H, R, Ck]``, in ``scratch``.

    ``q_c`` ``[H, R, D]`` is already scaled; ``c_h`` ``[H, G, T]`` float64 or None.
    ``D_ij`` is rounded relative to ``|D_ij|`` as in chunked forgetting attention: in
    float64 on tiles that cross the diagonal, relative to the chunk's first query below it
    (there ``c_j >= c_ref >= c_i``, so both parts are at most ``|D_ij|``).
    """
    h, rows, _ = q_c.shape
    cq, ck = i1 - i0, j1 - j0
    g = rows // cq
    s = scratch.take(h, cq, g, ck)  # [H, Cq, G, Ck]
    crosses_diagonal = j1 - 1 > i0
    k_t = k_h[:, j0:j1].transpose(1, 2)  # [H, D, Ck]
    if c_h is None:
        torch.bmm(q_c, k_t, out=s.view(h, rows, ck))
    else:
        c_q = c_h[:, :, i0:i1].transpose(1, 2)[..., None]  # [H, Cq, G, 1]
        c_k = c_h[:, None, :, j0:j1]  # [H, 1, G, Ck]
        if crosses_diagonal or s.dtype == torch.float64:
            torch.sub(c_q, c_k, out=s)  # in float64, rounded once when written
        else:
            c_ref = c_h[:, None, :, i0, None]  # [H, 1, G, 1]
            torch.sub((c_q - c_ref).to(s.dtype), (c_k - c_ref).to(s.dtype), out=s)
        s.view(h, rows, ck).baddbmm_(q_c, k_t)
    if crosses_diagonal:
        key = torch.arange(j0, j1, device=s.device)  # [Ck]
        query = torch.arange(i0, i1, device=s.device)  # [Cq]
        s.masked_fill_((key[None, :] > query[:, None])[:, None, :], float("-inf"))
    return s.view(h, rows, ck)


def _row_lse(scratch, q_c, k_h, c_h, i0, i1, chunk_k) -> Tensor:
    """The first pass: log-sum-exp of each row of a query chunk, ``[H, R]``, online over
    key tiles (running max and sum, as a flash forward without V)."""
    h, rows, _ = q_c.shape
    m = q_c.new_full((h, rows), float("-inf"))
    l = q_c.new_zeros(h, rows)
    for j0 in range(0, i1, chunk_k):
        j1 = min(j0 + chunk_k, i1)
        s = _logits(scratch, q_c, k_h, c_h, i0, i1, j0, j1)  # [H, R, Ck]
        m_new = torch.maximum(m, s.amax(dim=-1))
        # rows whose keys so far are all masked keep m = -inf: shift by 0, not NaN
        m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
        l = torch.addcmul(_exp_flushed_(s.sub_(m_safe[..., None])).sum(dim=-1), l,
                          torch.exp(m - m_safe))
        m = m_new
    # every row sees its own key (D_ii = 0): l > 0
    return m + torch.log(l)


def chunked_attention_key_scores(
    q: Tensor,
    k: Tensor,
    c: Tensor | None,
    lse: Tensor | None,
    p: _Problem,
    chunk_q: int = CHUNK_Q,
    chunk_k: int = CHUNK_K,
) -> Tensor:
    """A(j) over query chunks and key tiles: memory O(HQ x Cq x Ck), no ``[T, T]``.

    Args:
        q: ``[B, T, HQ, D]``; k: ``[B, T, H, D]``; c: ``[B, T, HQ]`` float64 cumulative
            log gates (floored) or None (softmax); lse: ``[B, HQ, T]`` or None (computed
            per query chunk by a first pass over its key tiles).
    Returns:
        ``[B, T, H]`` float32 (float64 for float64 inputs).
    """
    acc = _accum_dtype(q.dtype)
    h, g = p.h, p.hq // p.h
    a = q.new_zeros(p.batch, p.t, h, dtype=acc)
    if p.t == 0:
        return a
    logw = log_weights(p.t, p.alpha, q.device)  # [T] float64
    live = first_live_query(p.t, p.alpha, acc)
    scratch = _Scratch(p.hq * min(chunk_q, p.t) * min(chunk_k, p.t), q.new_empty(0, dtype=acc))
    for b in range(p.batch):
        # one sequence copied once into the accumulation dtype, queries scaled once
        q_h = (q[b].to(acc) * p.scale).reshape(p.t, h, g, p.d).permute(1, 0, 2, 3).contiguous()
        k_h = k[b].to(acc).transpose(0, 1).contiguous()  # [H, T, D]
        c_h = None if c is None else c[b].T.reshape(h, g, p.t).contiguous()  # [H, G, T] f64
        lse_h = None if lse is None else lse[b].reshape(h, g, p.t).transpose(1, 2)  # [H, T, G]
        a_h = a.new_zeros(h, p.t)  # [H, T]
        for i0 in range(live - live % chunk_q, p.t, chunk_q):
            i1 = min(i0 + chunk_q, p.t)
            q_c = q_h[:, i0:i1].reshape(h, (i1 - i0) * g, p.d)  # [H, R, D]
            if lse_h is None:
                lse_c = _row_lse(scratch, q_c, k_h, c_h, i0, i1, chunk_k)  # [H, R]
            else:
                lse_c = lse_h[:, i0:i1].reshape(h, -1)  # [H, R]
            # a_ij w_i = exp(s_ij - (lse_i - log w_i)); w_i = 0 gives +inf and then 0
            shift = (lse_c.double() - logw[i0:i1].repeat_interleave(g)).to(acc)  # [H, R]
            for j0 in range(0, i1, chunk_k):
                j1 = min(j0 + chunk_k, i1)
                s = _logits(scratch, q_c, k_h, c_h, i0, i1, j0, j1)  # [H, R, Ck]
                a_h[:, j0:j1] += _exp_flushed_(s.sub_(shift[..., None])).sum(dim=1)
        a[b] = a_h.T
    return a


def attention_key_scores(
    q: Tensor,
    k: Tensor,
    *,
    log_fgate: Tensor | None = None,
    lse: Tensor | None = None,
    scale: float | None = None,
    alpha: float = 1.0,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> Tensor:
    """The accumulated attention of every prompt key (H2O, A2SF), without a ``T x T``
    matrix.

    ``A(j) = sum_{i >= j} alpha^(T-1-i) a_ij`` per key/value head, summed over its query
    heads, with ``a_ij = softmax_j(scale q_i.k_j + D_ij)`` causal (SPEC section 7).
    ``D_ij = c_i - c_j`` for forgetting attention (``c_i = sum_{l <= i} log_fgate_l``,
    floored at ``LOG_GATE_FLOOR`` as ``forgetting_attention`` does) and 0 for softmax
    attention (apply RoPE to ``q`` and ``k`` first). The weights of query ``i`` for
    ``T = 4``, alpha = 1 (H2O) and alpha < 1 (A2SF; alpha = 0 keeps the last row)::

        1 . . .      a^3 .   .   .
        1 1 . .      a^2 a^2 .   .
        1 1 1 .      a   a   a   .
        1 1 1 1      1   1   1   1      A(j): the column sums of a_ij times these

    Args:
        q: ``[B, T, HQ, D]`` float16, bfloat16 or float32 (float64 on the torch and naive
            backends): the prompt's queries.
        k: ``[B, T, H, D]``, same dtype; ``HQ`` a multiple of ``H`` (grouped-query).
        log_fgate: ``[B, T, HQ]`` float32 log forget gates in ``[-inf, 0]`` (FoX), or
            None (softmax attention).
        lse: the rows' natural-log log-sum-exp in the layout ``forgetting_attention(...,
            return_lse=True)`` returns, ``[B, HQ, T]`` float32 (float64 with float64
            inputs), or None: then a first tiled pass computes it. (With ACP the forward's
            lse lacks the pruned mass, below ``acp_eps`` per row; the scores follow it.)
        scale: logit scale, ``1 / sqrt(D)`` by default.
        alpha: A2SF's forgetting factor in ``[0, 1]``; 1 is H2O. The weights are taken
            in float64 logs, so long prompts underflow harmlessly, and queries whose
            weight vanishes in the accumulation dtype are skipped.
        chunk_size: tile length (queries and keys) of the ``torch`` backend, default
            128 x 256; of the ``triton`` backend a power of two in [16, 256] (default by
            head dim); the ``naive`` backend ignores it.
        backend: ``"auto"`` (Triton on CUDA, else ``"torch"``), ``"triton"``,
            ``"torch"`` (chunked, memory O(HQ x chunk^2), any device) or ``"naive"``
            (materialised ``[B, HQ, T, T]``: the test oracle).

    Returns:
        ``[B, T, H]`` float32 (float64 for float64 inputs): the score of each key per
        key/value head. ``sum_j A(j) = G sum_i alpha^(T-1-i)`` (every row sums to 1).
        Computed without autograd: the scores decide eviction, nothing is trained on them.
    """
    p = _validate(q, k, log_fgate, lse, scale, alpha, chunk_size, backend)
    backend = resolve_backend(backend, q)
    with torch.no_grad():
        if backend == "naive":
            return naive_attention_key_scores(q, k, log_fgate, lse, p.scale, p.alpha)
        if backend == "triton":
            from .scores_triton import triton_attention_key_scores

            live = first_live_query(p.t, p.alpha, torch.float32)
            return triton_attention_key_scores(
                q, k, log_fgate, lse, p, chunk_size, log_weights(p.t, p.alpha, q.device), live
            )
        c = None if log_fgate is None else cumulative_log_gates(log_fgate)  # [B, T, HQ] f64
        cq, ck = (CHUNK_Q, CHUNK_K) if chunk_size is None else (chunk_size, chunk_size)
        return chunked_attention_key_scores(q, k, c, lse, p, cq, ck)
