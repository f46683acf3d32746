"""Materialised O(T^2) forgetting attention: the test oracle (SPEC sections 1 and 3).

It shares no code with the fast paths: the bias is built from an explicit cumulative
sum, ``log f = -inf`` is handled exactly (a pair separated by such a gate gets -inf,
not the floor the kernels use), masks are explicit, and the arithmetic runs in the
dtype of the inputs, so float64 inputs give the reference and float16/bfloat16 inputs
give "the same PyTorch math in the kernel's dtype", the baseline for tolerances.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _one_sequence(q, k, v, r, scale, keep_start, block):
    # q [Tq, HQ, D], k/v [Tk, H, D], r [Tk, HQ] (log gates)
    tq, hq, _ = q.shape
    tk, h, _ = k.shape
    group = hq // h
    k = k.repeat_interleave(group, dim=1)  # [Tk, HQ, D]
    v = v.repeat_interleave(group, dim=1)
    dead = torch.isneginf(r)
    c = torch.cumsum(torch.where(dead, torch.zeros_like(r), r), dim=0)  # [Tk, HQ]
    n_dead = torch.cumsum(dead.long(), dim=0)  # [Tk, HQ]
    pos_q = torch.arange(tq, device=q.device) + (tk - tq)  # absolute position of query i
    pos_k = torch.arange(tk, device=q.device)
    c_q, dead_q = c[pos_q], n_dead[pos_q]  # [Tq, HQ]
    bias = c_q.T[:, :, None] - c.T[:, None, :]  # [HQ, Tq, Tk]
    separated = (dead_q.T[:, :, None] - n_dead.T[:, None, :]) > 0  # a -inf gate in (j, i]
    allowed = pos_k[None, None, :] <= pos_q[None, :, None]  # causal  [1, Tq, Tk]
    if keep_start is not None:  # [HQ, M]: first kept key block of each query block
        row_block = torch.arange(tq, device=q.device) // block
        first_key = keep_start.long()[:, row_block] * block  # [HQ, Tq]
        allowed = allowed & (pos_k[None, None, :] >= first_key[:, :, None])
    # Scores come out of the matmul in the input dtype; bias and softmax run in float32
    # (float64 for float64 inputs), and P goes back to the input dtype for the PV matmul,
    # as a low-precision kernel does.
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    bias = torch.where(separated, float("-inf"), bias.to(acc))
    s = torch.einsum("qhd,khd->hqk", q, k).to(acc) * scale + bias  # [HQ, Tq, Tk]
    s = torch.where(allowed, s, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [HQ, Tq]
    p = torch.softmax(s, dim=-1).to(q.dtype)
    o = torch.einsum("hqk,khd->qhd", p, v)  # [Tq, HQ, D]
    return o, lse


def naive_forgetting_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_fgate: Tensor,
    scale: float,
    cu_seqlens: Tensor | None = None,
    block_start: Tensor | None = None,
    block: int = 64,
) -> tuple[Tensor, Tensor]:
    """O = softmax(scale Q K^T + D) V, materialised; differentiable by autograd.

    Args:
        q: ``[B, Tq, HQ, D]``; k, v: ``[B, Tk, H, D]``; log_fgate: ``[B, Tk, HQ]``.
        block_start: optional ``[B, HQ, M]`` first kept key block per query block (ACP);
            keys before ``block_start * block`` are masked for the rows of that block.
    Returns:
        o ``[B, Tq, HQ, D]`` in the input dtype and lse ``[B, HQ, Tq]`` (natural log).
    """
    r = log_fgate.double() if q.dtype == torch.float64 else log_fgate.float()
    if q.shape[0] == 0 or q.shape[1] == 0:  # no sequence, or only empty ones: empty results
        return q * 0, (q.sum(-1).transpose(1, 2) * 0).to(r.dtype)
    if cu_seqlens is None:
        outs = [
            _one_sequence(q[b], k[b], v[b], r[b], scale,
                          None if block_start is None else block_start[b], block)
            for b in range(q.shape[0])
        ]
        return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])
    bounds = cu_seqlens.tolist()
    o_parts, lse_parts = [], []
    for i, (s, e) in enumerate(zip(bounds, bounds[1:], strict=False)):
        if e == s:
            continue
        o, lse = _one_sequence(q[0, s:e], k[0, s:e], v[0, s:e], r[0, s:e], scale,
                               None if block_start is None else block_start[i], block)
        o_parts.append(o)
        lse_parts.append(lse)
    return torch.cat(o_parts)[None], torch.cat(lse_parts, dim=1)[None]
