"""The two materialised definitions of CASTLE, the test oracles (SPEC section 5).

- :func:`naive_castle_recurrent`: the definition, one output row at a time. For every
  position ``t`` it builds the lookahead keys ``U^t`` of the prefix and evaluates
  ``o_t = softmax(q^C_t K^C^T * scale - SiLU(q^C_t U^t^T * scale)) V^C``. O(T^3 d).
- :func:`naive_castle_parallel`: Theorem 1, every row at once through the ``T x T``
  matrix ``S^U = [(Q^C V^U^T * scale) * 1[i >= j]] (sigmoid(Q^U K^U^T * scale) * M)^T``.

They share no code with each other or with the fast paths (masks are built here, from
the SPEC's index conditions). The arithmetic runs in the inputs' dtype: float64 inputs
give the reference, float16/bfloat16 inputs give "the same PyTorch math in the kernel's
dtype", the baseline of the tolerances (matmuls in the input dtype, sigmoid, SiLU and
softmax in float32 and rounded back before the next matmul, as a kernel does).

``use_silu=False`` drops the SiLU on the lookahead score: the variant the paper says
diverges, kept only so that a test can show the SiLU is there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _heads_first(x: Tensor, h: int) -> Tensor:
    """``[B, T, HX, D]`` -> ``[B, H, T, D]``, repeating each of the HX heads H / HX times."""
    return x.repeat_interleave(h // x.shape[2], dim=2).transpose(1, 2)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def naive_castle_recurrent(
    q_c: Tensor,
    k_c: Tensor,
    v_c: Tensor,
    q_u: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    scale: float,
    window: int | None = None,
    use_silu: bool = True,
) -> tuple[Tensor, Tensor]:
    """CASTLE by its recurrent definition; differentiable by autograd.

    Args:
        q_c, q_u: ``[B, T, H, D]``; k_c, v_c: ``[B, T, HC, D]``; k_u, v_u: ``[B, T, HU, D]``.
        window: ``None`` (CASTLE) or ``W >= 1`` (CASTLE-SWL: ``u^t_s`` sums ``j`` in
            ``(s, min(t, s + W)]``).
    Returns:
        o ``[B, T, H, D]`` in the input dtype and lse ``[B, H, T]`` (natural log).
    """
    h = q_c.shape[2]
    qc, kc, vc, qu, ku, vu = (_heads_first(x, h) for x in (q_c, k_c, v_c, q_u, k_u, v_u))
    t_len, acc = q_c.shape[1], _acc(q_c.dtype)
    pos = torch.arange(t_len, device=q_c.device)
    rows, lses = [], []
    for t in range(t_len):
        s_idx, j_idx = pos[: t + 1, None], pos[None, : t + 1]
        look = (s_idx < j_idx) & (j_idx <= t)  # [t+1, t+1]: u^t_s sums the keys j in (s, t]
        if window is not None:
            look = look & (j_idx <= s_idx + window)
        w = torch.sigmoid((qu[:, :, : t + 1] @ ku[:, :, : t + 1].transpose(-1, -2)).to(acc) * scale)
        w = torch.where(look, w, 0.0).to(q_c.dtype)  # [B, H, t+1, t+1]
        u = w @ vu[:, :, : t + 1]  # [B, H, t+1, D]  U^t
        q = qc[:, :, t : t + 1]  # [B, H, 1, D]
        s_c = (q @ kc[:, :, : t + 1].transpose(-1, -2)).to(acc) * scale  # [B, H, 1, t+1]
        s_u = (q @ u.transpose(-1, -2)).to(acc) * scale  # [B, H, 1, t+1]
        logits = s_c - (F.silu(s_u) if use_silu else s_u)
        lses.append(torch.logsumexp(logits, dim=-1))  # [B, H, 1]
        p = torch.softmax(logits, dim=-1).to(q_c.dtype)
        rows.append(p @ vc[:, :, : t + 1])  # [B, H, 1, D]
    o = torch.cat(rows, dim=2).transpose(1, 2)  # [B, T, H, D]
    return o, torch.cat(lses, dim=-1)


def naive_castle_parallel(
    q_c: Tensor,
    k_c: Tensor,
    v_c: Tensor,
    q_u: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    scale: float,
    window: int | None = None,
    use_silu: bool = True,
) -> tuple[Tensor, Tensor]:
    """CASTLE by Theorem 1, materialising ``T x T`` matrices; differentiable by autograd.

    Same arguments and results as :func:`naive_castle_recurrent`.
    """
    h = q_c.shape[2]
    qc, kc, vc, qu, ku, vu = (_heads_first(x, h) for x in (q_c, k_c, v_c, q_u, k_u, v_u))
    t_len, acc = q_c.shape[1], _acc(q_c.dtype)
    pos = torch.arange(t_len, device=q_c.device)
    i_idx, j_idx = pos[:, None], pos[None, :]
    causal = j_idx <= i_idx  # [T, T]  1[i >= j]
    look = i_idx < j_idx  # [T, T]  the lookahead mask, rows s, columns j
    if window is not None:
        look = look & (j_idx <= i_idx + window)
    a = torch.where(causal, qc @ vu.transpose(-1, -2), 0.0)  # [B, H, T, T]
    a = (a.to(acc) * scale).to(q_c.dtype)
    w = torch.sigmoid((qu @ ku.transpose(-1, -2)).to(acc) * scale)
    w = torch.where(look, w, 0.0).to(q_c.dtype)  # [B, H, T, T]
    s_u = (a @ w.transpose(-1, -2)).to(acc)  # [B, H, T, T], zero on and above the diagonal
    s_c = (qc @ kc.transpose(-1, -2)).to(acc) * scale
    logits = s_c - (F.silu(s_u) if use_silu else s_u)
    logits = logits.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, H, T]
    p = torch.softmax(logits, dim=-1).to(q_c.dtype)
    o = (p @ vc).transpose(1, 2)  # [B, T, H, D]
    return o, lse


def naive_lookahead_keys(
    q_u: Tensor, k_u: Tensor, v_u: Tensor, scale: float, window: int | None = None
) -> Tensor:
    """``U^T`` of the whole sequence, ``[B, T, H, D]`` (H the heads of ``q_u``): row ``s``
    is ``sum_{s < j <= T-1 (, j <= s + W)} sigmoid(q^U_s . k^U_j * scale) v^U_j``."""
    h = q_u.shape[2]
    qu, ku, vu = (_heads_first(x, h) for x in (q_u, k_u, v_u))
    pos = torch.arange(q_u.shape[1], device=q_u.device)
    look = pos[:, None] < pos[None, :]
    if window is not None:
        look = look & (pos[None, :] <= pos[:, None] + window)
    w = torch.sigmoid((qu @ ku.transpose(-1, -2)).to(_acc(q_u.dtype)) * scale)
    w = torch.where(look, w, 0.0).to(q_u.dtype)
    return (w @ vu).transpose(1, 2)
