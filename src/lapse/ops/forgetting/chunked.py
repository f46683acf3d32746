"""Chunked forgetting attention in plain PyTorch: the memory-lean CPU path (SPEC 1, 3).

FlashAttention's schedule written with tensor ops: the forward walks query chunks and,
inside each, key chunks with an online softmax (running max ``m`` and sum ``l`` in the
accumulation dtype); it saves only ``q, k, v, o, lse`` (and the cumulative gate ``c``),
and the backward recomputes the probabilities chunk by chunk. Memory is O(T x chunk);
no ``[T, T]`` tensor ever exists.

ACP is applied at the ``ACP_BLOCK`` granularity that every backend shares: the rows of
query block ``m`` see only keys from ``block_start[m] * ACP_BLOCK`` on. A key chunk that
no row of the query chunk needs is skipped for a key/value head (and the whole tile when
no head needs it), which is where ACP saves CPU time; the partly pruned ones are masked.

Layout per sequence (legend): H key/value heads, G = HQ / H query heads per group, D
head dim, Cq/Ck the current query/key chunk lengths. Queries are stored ``[H, Tq, G, D]``
so that a query chunk is the view ``[H, Cq * G, D]`` (rows ordered (position, group
member)) and one batched matmul per tile serves a whole query-head group against its
key/value head: grouped-query attention without repeating K or V.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..backend import autocast_off_backward
from .common import ACP_BLOCK, Problem, gate_grad_from_dc

# Chunk lengths, multiples of ACP_BLOCK. Measured on a 2-core CPU (torch 2.13, float32,
# HQ = 8, D = 64, T = 2048-4096): 128 x 256 was the fastest forward+backward; smaller
# tiles pay Python overhead per tile, larger ones lose cache locality and skip ACP
# pruning more coarsely.
CHUNK_Q = 128
CHUNK_K = 256
assert CHUNK_Q % ACP_BLOCK == 0 and CHUNK_K % ACP_BLOCK == 0


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _segments(p: Problem, batch: int):
    """(batch index, first token, query length, key length) of every sequence.

    Without ``cu_seqlens`` each batch row is one sequence whose queries are the last
    ``Tq`` of its ``Tk`` positions; packed sequences have ``Tq = Tk`` = their length.
    The enumeration index is the row of ``block_start`` that belongs to the sequence.
    """
    if p.cu_seqlens is None:
        return [(b, 0, p.tq, p.tk) for b in range(batch)]
    starts = p.cu_seqlens.tolist()[:-1]
    return [(0, s, n, n) for s, n in zip(starts, p.seqlens, strict=True)]


class _Chunk(NamedTuple):
    """One query chunk ``[i0, i1)`` of a sequence and what ACP keeps of it.

    ``first[h]`` / ``last[h]`` (host ints, one per key/value head): the smallest and the
    largest first-kept key over the chunk's rows of that head's group; keys before
    ``first`` are skipped, keys in ``[first, last)`` need a mask. ``row_start``:
    ``[H, Cq * G]`` first kept key of every row, or None without ACP.
    """

    i0: int
    i1: int
    first: list[int]
    last: list[int]
    row_start: Tensor | None


def _query_chunks(tq: int, h: int, g: int, bs: Tensor | None):
    """The query chunks of one sequence; ``bs`` is its ``[HQ, M]`` block_start or None."""
    for i0 in range(0, tq, CHUNK_Q):
        i1 = min(i0 + CHUNK_Q, tq)
        if bs is None:
            yield _Chunk(i0, i1, [0] * h, [0] * h, None)
            continue
        blocks = torch.arange(i0, i1, device=bs.device) // ACP_BLOCK  # [Cq]
        start = bs.reshape(h, g, -1)[:, :, blocks].long() * ACP_BLOCK  # [H, G, Cq]
        start = start.transpose(1, 2).reshape(h, -1)  # [H, Cq * G], rows (position, member)
        first = start.amin(dim=1).tolist()
        last = start.amax(dim=1).tolist()
        yield _Chunk(i0, i1, first, last, start)


def _heads(chunk: _Chunk, j1: int, h: int, device):
    """Key/value heads that need a key before ``j1``: a slice (all) or an index tensor,
    and the same as a host list.

    A head whose rows all start at or after ``j1`` has pruned the whole tile: it is left
    out of the tile's matmuls, so ACP saves work even when other heads keep the tile.
    """
    active = [hh for hh in range(h) if chunk.first[hh] < j1]
    if len(active) == h:
        return slice(None), active
    return torch.tensor(active, device=device), active


class _Scratch:
    """One reusable flat buffer handing out contiguous views of any shape up to its size.

    Every tile would otherwise allocate fresh ``[H, Cq * G, Ck]`` tensors; on CPU a fresh
    large allocation is fresh pages from the kernel, whose first touch cost more than the
    arithmetic done on them in our measurements.
    """

    def __init__(self, numel: int, like: Tensor):
        self.buf = like.new_empty(numel)

    def take(self, *shape: int) -> Tensor:
        n = 1
        for s in shape:
            n *= s
        return self.buf[:n].view(shape)


def _tile_numel(p: Problem) -> int:
    """The largest tile, ``HQ x Cq x Ck`` elements, capped by the sequence lengths."""
    return p.hq * min(CHUNK_Q, p.tq) * min(CHUNK_K, p.tk)


def _scores(scratch, q_i, k_c, c_h, chunk: _Chunk, j0, j1, off, idx, heads, scale) -> Tensor:
    """Masked logits ``scale q k^T + D`` of one tile, ``[H', Cq * G, Ck]``, in ``scratch``.

    ``D_ij = c_i - c_j`` comes from the float64 ``c`` (it reaches -1e5 at long context,
    where differences of float32 sums would cancel most digits) and its rounding to the
    accumulation dtype is kept relative to ``|D_ij|``: small exactly where the weight is
    large. Disallowed pairs (after the query: causal; before the row's ACP start:
    pruned) become -inf.
    """
    i0, i1 = chunk.i0, chunk.i1
    n_heads, g = q_i.shape[0], c_h.shape[1]
    c_q = c_h[idx, :, i0 + off : i1 + off].transpose(1, 2)[..., None]  # [H', Cq, G, 1]
    c_k = c_h[idx, None, :, j0:j1]  # [H', 1, G, Ck]
    s = scratch.take(n_heads, i1 - i0, g, j1 - j0)  # [H', Cq, G, Ck]
    crosses_diagonal = j1 - 1 > i0 + off
    if crosses_diagonal or s.dtype == torch.float64:
        torch.sub(c_q, c_k, out=s)  # in float64, rounded once when written
    else:
        # Below the diagonal every key precedes every query, so with c_ref the gate sum at
        # the chunk's first query, c_j >= c_ref >= c_i: both |c_i - c_ref| and
        # |c_j - c_ref| are at most |D_ij|, and rounding them to float32 first keeps the
        # error relative to |D_ij| (3 roundings instead of 1), while the tile-sized
        # subtraction runs in float32, several times faster than a float64 one.
        c_ref = c_h[idx, :, i0 + off][:, None, :, None]  # [H', 1, G, 1]
        torch.sub((c_q - c_ref).to(s.dtype), (c_k - c_ref).to(s.dtype), out=s)
    s = s.view(n_heads, -1, j1 - j0).baddbmm_(q_i, k_c.transpose(1, 2), alpha=scale)
    partial_acp = chunk.row_start is not None and any(chunk.last[hh] > j0 for hh in heads)
    if not (crosses_diagonal or partial_acp):
        return s  # the common tile pays for no mask
    key = torch.arange(j0, j1, device=s.device)  # [Ck]
    query = torch.arange(i0 + off, i1 + off, device=s.device)  # [Cq] key position of row
    masked = (key[None, :] > query[:, None]).repeat_interleave(g, dim=0)  # [Cq * G, Ck]
    if partial_acp:
        masked = masked | (key < chunk.row_start[idx][..., None])  # [H', Cq * G, Ck]
    return s.masked_fill_(masked, float("-inf"))


def _to_heads_major(x: Tensor, h: int, dtype: torch.dtype) -> Tensor:
    """[T, HQ, D] -> [H, T, G, D] contiguous in ``dtype`` (a copy of one sequence)."""
    t, hq, d = x.shape
    return x.to(dtype).reshape(t, h, hq // h, d).permute(1, 0, 2, 3).contiguous()


def _from_heads_major(x: Tensor) -> Tensor:
    """[H, T, G, D] -> [T, H * G, D]."""
    h, t, g, d = x.shape
    return x.permute(1, 0, 2, 3).reshape(t, h * g, d)


def _kv_heads_major(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[T, H, D] -> [H, T, D] contiguous in ``dtype``."""
    return x.to(dtype).transpose(0, 1).contiguous()


def _forward(q, k, v, c, p: Problem, block_start):
    acc = _accum_dtype(q.dtype)
    h, g = p.h, p.hq // p.h
    o = torch.empty_like(q)
    lse = q.new_empty(q.shape[0], p.hq, q.shape[1], dtype=acc)  # [B, HQ, T]
    scratch = _Scratch(_tile_numel(p), q.new_empty(0, dtype=acc))
    for seq, (b, t0, tq, tk) in enumerate(_segments(p, q.shape[0])):
        if tq == 0:
            continue
        off = tk - tq  # query i sits at key position i + off
        # One sequence at a time, copied once into the accumulation dtype: every tile
        # op below then runs in float32 (float64), as a kernel's accumulators do.
        q_h = _to_heads_major(q[b, t0 : t0 + tq], h, acc)  # [H, Tq, G, D]
        k_h = _kv_heads_major(k[b, t0 : t0 + tk], acc)  # [H, Tk, D]
        v_h = _kv_heads_major(v[b, t0 : t0 + tk], acc)  # [H, Tk, D]
        c_h = c[b, t0 : t0 + tk].T.reshape(h, g, tk).contiguous()  # [H, G, Tk] float64
        o_h = torch.empty_like(q_h)  # [H, Tq, G, D]
        lse_h = q_h.new_empty(h, tq, g)  # [H, Tq, G]
        bs = None if block_start is None else block_start[seq]  # [HQ, M]
        for chunk in _query_chunks(tq, h, g, bs):
            i0, i1 = chunk.i0, chunk.i1
            n_rows = (i1 - i0) * g
            q_c = q_h[:, i0:i1].reshape(h, n_rows, -1)  # [H, R = Cq * G, D]
            m = q_h.new_full((h, n_rows), float("-inf"))  # running max
            l = q_h.new_zeros(h, n_rows)  # running sum of exp(s - m)
            o_acc = q_h.new_zeros(h, n_rows, q_h.shape[-1])  # running sum of exp(s - m) v
            j_end = i1 + off  # one past the last key any row of the chunk sees
            for j0 in range(min(chunk.first), j_end, CHUNK_K):
                j1 = min(j0 + CHUNK_K, j_end)
                idx, heads = _heads(chunk, j1, h, q.device)
                v_c = v_h[idx, j0:j1]  # [H', Ck, D]
                s = _scores(scratch, q_c[idx], k_h[idx, j0:j1], c_h, chunk, j0, j1, off,
                            idx, heads, p.scale)  # [H', R, Ck]
                m_old = m[idx]
                m_new = torch.maximum(m_old, s.amax(dim=-1))  # [H', R]
                # A row whose keys so far were all masked has m_new = -inf; shifting by 0
                # instead keeps exp(-inf - (-inf)) = NaN out (its p and alpha become 0).
                m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
                pr = s.sub_(m_safe[..., None]).exp_()  # [H', R, Ck], in place of s
                alpha = torch.exp(m_old - m_safe)  # rescales what was summed so far
                if isinstance(idx, slice):
                    l = torch.addcmul(pr.sum(dim=-1), l, alpha)
                    o_acc.mul_(alpha[..., None]).baddbmm_(pr, v_c)
                    m = m_new
                else:
                    l.index_copy_(0, idx, torch.addcmul(pr.sum(dim=-1), l[idx], alpha))
                    o_acc.index_copy_(0, idx, torch.baddbmm(o_acc[idx] * alpha[..., None],
                                                            pr, v_c))
                    m.index_copy_(0, idx, m_new)
            # every row sees at least its own key (the diagonal is never pruned): l > 0
            o_h[:, i0:i1] = (o_acc / l[..., None]).view(h, i1 - i0, g, -1)
            lse_h[:, i0:i1] = (m + torch.log(l)).view(h, i1 - i0, g)
        o[b, t0 : t0 + tq] = _from_heads_major(o_h)  # cast to the input dtype
        lse[b, :, t0 : t0 + tq] = lse_h.permute(0, 2, 1).reshape(p.hq, tq)  # [HQ, Tq]
    return o, lse


def _backward(do, q, k, v, o, lse, c, p: Problem, block_start):
    acc = _accum_dtype(q.dtype)
    h, g = p.h, p.hq // p.h
    # zeros: with Tq = 0 no tile writes dk, dv, dc
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dc = torch.zeros_like(c)  # [B, Tk, HQ] float64
    scratch_s = _Scratch(_tile_numel(p), q.new_empty(0, dtype=acc))
    scratch_ds = _Scratch(_tile_numel(p), q.new_empty(0, dtype=acc))
    for seq, (b, t0, tq, tk) in enumerate(_segments(p, q.shape[0])):
        if tq == 0:
            continue
        off = tk - tq
        q_h = _to_heads_major(q[b, t0 : t0 + tq], h, acc)  # [H, Tq, G, D]
        do_h = _to_heads_major(do[b, t0 : t0 + tq], h, acc)  # [H, Tq, G, D]
        # delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij, the softmax backward's shift
        delta_h = (do_h * _to_heads_major(o[b, t0 : t0 + tq], h, acc)).sum(-1)  # [H, Tq, G]
        lse_h = lse[b, :, t0 : t0 + tq].reshape(h, g, tq).transpose(1, 2)  # [H, Tq, G]
        k_h = _kv_heads_major(k[b, t0 : t0 + tk], acc)  # [H, Tk, D]
        v_h = _kv_heads_major(v[b, t0 : t0 + tk], acc)  # [H, Tk, D]
        c_h = c[b, t0 : t0 + tk].T.reshape(h, g, tk).contiguous()  # [H, G, Tk] float64
        dq_h = torch.zeros_like(q_h)  # [H, Tq, G, D]
        dk_h = torch.zeros_like(k_h)  # [H, Tk, D]
        dv_h = torch.zeros_like(v_h)  # [H, Tk, D]
        dc_h = q_h.new_zeros(h, g, tk)  # [H, G, Tk]
        bs = None if block_start is None else block_start[seq]  # [HQ, M]
        for chunk in _query_chunks(tq, h, g, bs):
            i0, i1 = chunk.i0, chunk.i1
            n_rows = (i1 - i0) * g
            q_c = q_h[:, i0:i1].reshape(h, n_rows, -1)  # [H, R = Cq * G, D]
            do_c = do_h[:, i0:i1].reshape(h, n_rows, -1)  # [H, R, D]
            lse_c = lse_h[:, i0:i1].reshape(h, n_rows)  # [H, R]
            delta_c = delta_h[:, i0:i1].reshape(h, n_rows)  # [H, R]
            dq_c = dq_h[:, i0:i1].view(h, n_rows, -1)  # [H, R, D], a view: writes go to dq_h
            dc_row = q_h.new_zeros(h, n_rows)  # row sums of dS, [H, R]
            j_end = i1 + off
            # the same tiles as the forward: pruned ones skipped, partial ones masked
            for j0 in range(min(chunk.first), j_end, CHUNK_K):
                j1 = min(j0 + CHUNK_K, j_end)
                idx, heads = _heads(chunk, j1, h, q.device)
                k_c, v_c, q_i, do_i = k_h[idx, j0:j1], v_h[idx, j0:j1], q_c[idx], do_c[idx]
                s = _scores(scratch_s, q_i, k_c, c_h, chunk, j0, j1, off, idx, heads, p.scale)
                # lse is finite on every row, so masked logits give exactly 0, never NaN
                pr = s.sub_(lse_c[idx][..., None]).exp_()  # [H', R, Ck], in place of s
                dp = torch.bmm(do_i, v_c.transpose(1, 2), out=scratch_ds.take(*pr.shape))
                ds = dp.sub_(delta_c[idx][..., None]).mul_(pr)  # dL/dS, S = scale q k^T + D
                # dc_i = sum_j dS_ij - sum_k dS_ki (SPEC 1). The exact row sum is 0
                # (sum_j P_ij dP_ij = delta_i), but the computed one is not: it carries the
                # rounding of delta_i, and so does the column sum; keeping both cancels
                # that error where attention is local (a one-hot row's -eps_i and its
                # column's -eps_i), instead of letting d log f add it up over the sequence.
                row = ds.sum(dim=-1)  # [H', R]
                col = ds.view(-1, i1 - i0, g, j1 - j0).sum(dim=1)  # [H', G, Ck]
                if isinstance(idx, slice):
                    dv_h[:, j0:j1].baddbmm_(pr.transpose(1, 2), do_i)  # [H, Ck, D]
                    # the R = Cq * G rows hold every query head of the group, so this also
                    # sums the group's contributions to its shared key head
                    dk_h[:, j0:j1].baddbmm_(ds.transpose(1, 2), q_i)  # [H, Ck, D] / scale
                    dq_c.baddbmm_(ds, k_c)  # [H, R, D] / scale
                    dc_row += row
                    dc_h[:, :, j0:j1] -= col
                else:
                    dv_h[:, j0:j1].index_add_(0, idx, torch.bmm(pr.transpose(1, 2), do_i))
                    dk_h[:, j0:j1].index_add_(0, idx, torch.bmm(ds.transpose(1, 2), q_i))
                    dq_c.index_add_(0, idx, torch.bmm(ds, k_c))
                    dc_row.index_add_(0, idx, row)
                    dc_h[:, :, j0:j1].index_add_(0, idx, col, alpha=-1)
            dc_h[:, :, i0 + off : i1 + off] += dc_row.view(h, i1 - i0, g).transpose(1, 2)
        dq[b, t0 : t0 + tq] = _from_heads_major(dq_h.mul_(p.scale))  # [Tq, HQ, D]
        dk[b, t0 : t0 + tk] = dk_h.mul_(p.scale).transpose(0, 1)  # [Tk, H, D]
        dv[b, t0 : t0 + tk] = dv_h.transpose(0, 1)  # [Tk, H, D]
        dc[b, t0 : t0 + tk] = dc_h.reshape(p.hq, tk).T  # [Tk, HQ]
    return dq, dk, dv, dc


class _ChunkedForgettingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_fgate, c, p, block_start):
        o, lse = _forward(q, k, v, c, p, block_start)
        # log_fgate is kept ([B, Tk, HQ], small) only to zero the gradient of floored gates
        ctx.save_for_backward(q, k, v, o, lse, c, log_fgate, block_start)
        ctx.problem = p
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable
    @autocast_off_backward
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, c, log_fgate, block_start = ctx.saved_tensors
        p = ctx.problem
        dq, dk, dv, dc = _backward(do.contiguous(), q, k, v, o, lse, c, p, block_start)
        dlog_fgate = gate_grad_from_dc(dc, log_fgate, p.cu_seqlens)
        return dq, dk, dv, dlog_fgate, None, None, None


def chunked_forgetting_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_fgate: Tensor,
    c: Tensor,
    p: Problem,
    block_start: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Forgetting attention, chunked; differentiable in ``q, k, v, log_fgate``.

    Called by :func:`lapse.ops.forgetting.forgetting_attention` after validation.

    Args:
        q: ``[B, Tq, HQ, D]``; k, v: ``[B, Tk, H, D]`` (packed ``[1, total, ., D]`` with
            ``p.cu_seqlens``); log_fgate: ``[B, Tk, HQ]``, used only for its gradient.
        c: ``[B, Tk, HQ]`` float64 cumulative log gates (floored, restarting per
            sequence) from :func:`~lapse.ops.forgetting.common.cumulative_log_gates`.
        p: the validated :class:`~lapse.ops.forgetting.common.Problem`.
        block_start: ``[B, HQ, M]`` first kept key block (units of ``ACP_BLOCK``) per
            query block, or None for dense attention.
    Returns:
        ``o`` ``[B, Tq, HQ, D]`` in the dtype of ``q`` and ``lse`` ``[B, HQ, Tq]``
        (natural log; float32, float64 for float64 inputs).
    """
    return _ChunkedForgettingAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), log_fgate, c, p, block_start
    )
