"""The PyTorch path of CASTLE: the blocked O(T^2 d) algorithm with its own backward.

SPEC section 5, Theorem 2, traversed one query block at a time. Before query block
``I`` (rows ``[a, b)``) the buffer ``U`` holds ``U^{a-1}``, the lookahead keys of every
earlier row at time ``a - 1``: the SPEC's ``D[:, T_J]`` for all ``J < I`` at once (rows
``>= a`` are still 0). Block ``I``'s lookahead scores are then

    S^U[I, :b] = Q^C_I U[:b]^T * scale + A_I G_I^T
    A_I = (Q^C_I V^U_I^T * scale) * 1[i >= j]              [n, n]   (j in block I)
    G_I = sigmoid(Q^U[:b] K^U_I^T * scale) * 1[s < j (<= s + W)]   [b, n]

and after the block ``U[:b] += G_I V^U_I``. Memory is O(T d) per head beside one block
row of logits (``[n, b]``); nothing ``T x T`` and nothing ``T x T x d`` is kept.

The backward runs the blocks in reverse. It undoes ``U`` by subtraction (the update is
recomputed from the same inputs) and carries ``R``, the gradient reaching ``U`` from the
later blocks: ``R = sum_{I' > I} scale dS^U_{I'}^T Q^C_{I'}``, which is exactly what the
update of block ``I`` receives. Under SWL only the rows ``s >= a - W`` meet block ``I``.

Legend: B batch, H heads, T length, D head dim, n rows of the block, b its end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import autocast_off_backward

CHUNK = 64


def _block(qc, qu, ku, vu, a, b, lo, window, scale):
    """``(G, sigmoid, A)`` of the query block ``[a, b)``: ``G`` and its sigmoid are
    ``[B, H, b - lo, n]`` (rows ``s`` in ``[lo, b)``), ``A`` is ``[B, H, n, n]``."""
    s_pos = torch.arange(lo, b, device=qc.device)[:, None]
    j_pos = torch.arange(a, b, device=qc.device)[None, :]
    look = s_pos < j_pos  # [b - lo, n]
    if window is not None:
        look = look & (j_pos <= s_pos + window)
    sig = torch.sigmoid(qu[:, :, lo:b] @ ku[:, :, a:b].transpose(-1, -2) * scale)
    g = torch.where(look, sig, 0.0)
    tril = j_pos <= j_pos.T  # [n, n]  1[i >= j] within the block
    amat = torch.where(tril, qc[:, :, a:b] @ vu[:, :, a:b].transpose(-1, -2) * scale, 0.0)
    return g, sig, amat, tril


def _logits(qc_i, kc, u, g, amat, a, b, lo, scale):
    """``(z, s_u)`` ``[B, H, n, b]`` of the block: causal logits ``Q^C K^C^T * scale -
    SiLU(S^U)`` (``-inf`` above the diagonal) and the lookahead scores ``S^U``."""
    s_u = qc_i @ u[:, :, :b].transpose(-1, -2) * scale  # [B, H, n, b]
    s_u[..., lo:b] += amat @ g.transpose(-1, -2)
    z = qc_i @ kc[:, :, :b].transpose(-1, -2) * scale - F.silu(s_u)
    i_pos = torch.arange(a, b, device=z.device)[:, None]
    z = z.masked_fill(torch.arange(b, device=z.device)[None, :] > i_pos, float("-inf"))
    return z, s_u


class _ChunkedCastle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qc, kc, vc, qu, ku, vu, scale, window, chunk):
        # every tensor [B, H, T, D] in one float dtype (float32 or float64)
        t_len = qc.shape[2]
        u = torch.zeros_like(qc)  # U^{a-1}, rows >= a still 0
        o = torch.empty_like(qc)
        lse = qc.new_empty(qc.shape[:3])  # [B, H, T]
        for a in range(0, t_len, chunk):
            b = min(a + chunk, t_len)
            lo = 0 if window is None else max(0, a - window)
            g, _, amat, _ = _block(qc, qu, ku, vu, a, b, lo, window, scale)
            z, _ = _logits(qc[:, :, a:b], kc, u, g, amat, a, b, lo, scale)
            lse[:, :, a:b] = torch.logsumexp(z, dim=-1)
            o[:, :, a:b] = torch.exp(z - lse[:, :, a:b, None]) @ vc[:, :, :b]
            u[:, :, lo:b] += g @ vu[:, :, a:b]
        ctx.save_for_backward(qc, kc, vc, qu, ku, vu, u, lse)
        ctx.args = (scale, window, chunk)
        return o, lse

    @staticmethod
    @autocast_off_backward
    def backward(ctx, do, dlse):
        qc, kc, vc, qu, ku, vu, u_end, lse = ctx.saved_tensors
        scale, window, chunk = ctx.args
        t_len = qc.shape[2]
        u = u_end.clone()  # undone block by block; the saved one stays for a second backward
        r = torch.zeros_like(u)  # gradient reaching U from the blocks already done
        dqc, dkc, dvc, dqu, dku, dvu = (torch.zeros_like(x) for x in (qc, kc, vc, qu, ku, vu))
        do = torch.zeros_like(qc) if do is None else do
        for a in reversed(range(0, t_len, chunk)):
            b = min(a + chunk, t_len)
            lo = 0 if window is None else max(0, a - window)
            qc_i, vu_i = qc[:, :, a:b], vu[:, :, a:b]
            g, sig, amat, tril = _block(qc, qu, ku, vu, a, b, lo, window, scale)
            u[:, :, lo:b] -= g @ vu_i  # back to U^{a-1}
            # the update U[lo:b] += G V^U_I receives R
            dg = r[:, :, lo:b] @ vu_i.transpose(-1, -2)  # [B, H, b - lo, n]
            dvu[:, :, a:b] += g.transpose(-1, -2) @ r[:, :, lo:b]
            z, s_u = _logits(qc_i, kc, u, g, amat, a, b, lo, scale)
            p = torch.exp(z - lse[:, :, a:b, None])  # [B, H, n, b]
            do_i = do[:, :, a:b]
            dp = do_i @ vc[:, :, :b].transpose(-1, -2)
            dz = p * (dp - (p * dp).sum(-1, keepdim=True))
            if dlse is not None:
                dz = dz + p * dlse[:, :, a:b, None]
            dvc[:, :, :b] += p.transpose(-1, -2) @ do_i
            dqc[:, :, a:b] += dz @ kc[:, :, :b] * scale
            dkc[:, :, :b] += dz.transpose(-1, -2) @ qc_i * scale
            sg = torch.sigmoid(s_u)
            ds = -sg * (1 + s_u * (1 - sg)) * dz  # -SiLU'(S^U) dZ
            dqc[:, :, a:b] += ds @ u[:, :, :b] * scale
            r[:, :, :b] += ds.transpose(-1, -2) @ qc_i * scale
            ds_w = ds[..., lo:b]  # [B, H, n, b - lo]
            da = torch.where(tril, ds_w @ g, 0.0)  # [B, H, n, n]
            dg += ds_w.transpose(-1, -2) @ amat
            dqc[:, :, a:b] += da @ vu_i * scale
            dvu[:, :, a:b] += da.transpose(-1, -2) @ qc_i * scale
            dx = dg * g * (1 - sig)  # g is 0 outside the lookahead mask
            dqu[:, :, lo:b] += dx @ ku[:, :, a:b] * scale
            dku[:, :, a:b] += dx.transpose(-1, -2) @ qu[:, :, lo:b] * scale
        return dqc, dkc, dvc, dqu, dku, dvu, None, None, None


def chunked_castle_attention(q_c, k_c, v_c, q_u, k_u, v_u, scale, window, chunk=CHUNK):
    """(o ``[B, T, H, D]``, lse ``[B, H, T]``) by the blocked algorithm, in float32
    (float64 for float64 inputs); differentiable in all six inputs, which are
    ``[B, T, H*, D]`` with grouped heads as in ``castle_attention``."""
    h, dtype = q_c.shape[2], q_c.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    xs = [x.repeat_interleave(h // x.shape[2], dim=2).transpose(1, 2).to(acc)
          for x in (q_c, k_c, v_c, q_u, k_u, v_u)]  # each [B, H, T, D]
    o, lse = _ChunkedCastle.apply(*xs, scale, window, chunk)
    return o.transpose(1, 2).to(dtype), lse


@torch.no_grad()
def chunked_lookahead_keys(q_u, k_u, v_u, scale, window, chunk=CHUNK):
    """``U^T`` of the whole sequence ``[B, T, H, D]`` float32 (float64 for float64 inputs),
    block by block in O(T d) memory: what a decoding cache holds after a prefill."""
    h = q_u.shape[2]
    acc = torch.float64 if q_u.dtype == torch.float64 else torch.float32
    qu, ku, vu = (x.repeat_interleave(h // x.shape[2], dim=2).transpose(1, 2).to(acc)
                  for x in (q_u, k_u, v_u))  # each [B, H, T, D]
    t_len = qu.shape[2]
    u = torch.zeros_like(qu)
    s_all = torch.arange(t_len, device=qu.device)
    for a in range(0, t_len, chunk):
        b = min(a + chunk, t_len)
        lo = 0 if window is None else max(0, a - window)
        s_pos, j_pos = s_all[lo:b, None], s_all[None, a:b]
        look = s_pos < j_pos
        if window is not None:
            look = look & (j_pos <= s_pos + window)
        g = torch.where(look, torch.sigmoid(qu[:, :, lo:b] @ ku[:, :, a:b].transpose(-1, -2)
                                            * scale), 0.0)
        u[:, :, lo:b] += g @ vu[:, :, a:b]
    return u.transpose(1, 2)


@torch.no_grad()
def chunked_key_scores(q_c, k_c, q_u, k_u, v_u, scale, window, alpha, chunk=CHUNK):
    """The accumulated attention of every key of a prompt (H2O, A2SF; SPEC section 7)
    ``[B, T, HC]`` float32 (float64 for float64 inputs), ``HC`` the heads of ``k_c``:
    ``A(j) = sum_{i >= j} alpha^(T-1-i) a_ij`` summed over each kv head's query heads,
    ``a_ij`` the forward's probabilities (lookahead terms as of query ``i``), one block
    row of logits at a time: O(T^2 D) time, O(T D + chunk T) memory."""
    h, hc = q_c.shape[2], k_c.shape[2]
    acc = torch.float64 if q_c.dtype == torch.float64 else torch.float32
    qc, kc, qu, ku, vu = (x.repeat_interleave(h // x.shape[2], dim=2).transpose(1, 2).to(acc)
                          for x in (q_c, k_c, q_u, k_u, v_u))  # each [B, H, T, D]
    t_len = qc.shape[2]
    # A2SF's weight of each query, in float64 logs (alpha = 0: only the last row counts)
    weight = torch.tensor(alpha, dtype=torch.float64) ** torch.arange(t_len - 1, -1, -1, dtype=torch.float64)
    weight = weight.to(device=qc.device, dtype=acc)  # [T]
    u = torch.zeros_like(qu)
    scores = qc.new_zeros(qc.shape[:3])  # [B, H, T]
    for a in range(0, t_len, chunk):
        b = min(a + chunk, t_len)
        lo = 0 if window is None else max(0, a - window)
        g, _, amat, _ = _block(qc, qu, ku, vu, a, b, lo, window, scale)
        z, _ = _logits(qc[:, :, a:b], kc, u, g, amat, a, b, lo, scale)
        p = torch.softmax(z, dim=-1)  # [B, H, n, b]
        scores[:, :, :b] += (weight[a:b, None] * p).sum(-2)
        u[:, :, lo:b] += g @ vu[:, :, a:b]
    scores = scores.view(scores.shape[0], hc, h // hc, t_len).sum(2)  # [B, HC, T]
    return scores.transpose(1, 2).to(torch.float64 if acc == torch.float64 else torch.float32)
