"""CASTLE's key-major schedule in PyTorch: the plain mirror of ``triton_parallel.py``.

``README.md`` ("A schedule without a wavefront") derives it. Every key block ``J`` is
independent: it walks the query blocks ``I = J, J + 1, ...`` carrying its own lookahead
vectors ``U_J`` (the SPEC's ``D[:, T_J]``), so the Triton version runs all key blocks of
all heads in one launch. The price is the softmax: a row's keys are spread over many
programs, so every row is normalised by a fixed bound ``M_i >= max_s Z_is`` computed
beforehand (:func:`logit_bound`) and the programs add ``exp(Z - M) V^C`` and
``exp(Z - M)`` into shared float32 rows (atomics in the kernel). The backward walks the
query blocks of each key block in reverse with ``U_J`` undone by subtraction; the
gradients of the query rows (``dQ^C``) and of the lookahead key/value rows (``dK^U``,
``dV^U``) are shared between programs, those of the key block (``dK^C``, ``dV^C``,
``dQ^U``) stay with it.

These loops exist to check the schedule's algebra against the oracles in float64; they
are slow (one Python iteration per block pair). Legend: B batch, H heads, T length,
D head dim; all tensors ``[B, H, T, D]`` (rows ``[B, H, T]``) in one float dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 16

# max over x of -SiLU(x) = -x sigmoid(x), reached at x = -1.2785: the lookahead branch
# raises a logit by at most this much (rounded up).
NEG_SILU_MAX = 0.2785
# The bound M_i sits at most this far (natural log) below the causal bound, and never
# below the row's own diagonal logit, whose lookahead score is 0 (u^t_t = 0): no term
# exceeds exp(HEADROOM) and a row underflows only if all its logits lie more than
# HEADROOM + 87 below the causal bound (README).
HEADROOM = 44.0


def logit_bound(qc, kc, scale, chunk=CHUNK):
    """``M [B, H, T]``: ``max(z_ii, max_{s <= i} q^C_i . k^C_s * scale + NEG_SILU_MAX -
    HEADROOM)``, where ``z_ii = q^C_i . k^C_i * scale`` is the diagonal logit. Every
    logit ``Z_is <= M_i + HEADROOM``."""
    t_len = qc.shape[2]
    rowmax = qc.new_empty(qc.shape[:3])
    for a in range(0, t_len, chunk):
        b = min(a + chunk, t_len)
        s = qc[:, :, a:b] @ kc[:, :, :b].transpose(-1, -2) * scale  # [B, H, n, b]
        causal = torch.arange(b, device=qc.device)[None, :] <= torch.arange(a, b, device=qc.device)[:, None]
        rowmax[:, :, a:b] = s.masked_fill(~causal, float("-inf")).amax(-1)
    diag = (qc * kc).sum(-1) * scale
    return torch.maximum(diag, rowmax + NEG_SILU_MAX - HEADROOM)


def _weights(qu, ku, i_rows, j_rows, window, scale):
    """``(g, sig)`` ``[B, H, n_J, n_I]``: the lookahead weights of key block ``J``'s rows
    on query block ``I``'s tokens, masked to ``s < j (<= s + W)``, and unmasked."""
    (a, b), (c, e) = i_rows, j_rows
    pos_i = torch.arange(a, b, device=qu.device)
    pos_s = torch.arange(c, e, device=qu.device)
    look = pos_s[:, None] < pos_i[None, :]
    if window is not None:
        look = look & (pos_i[None, :] <= pos_s[:, None] + window)
    sig = torch.sigmoid(qu[:, :, c:e] @ ku[:, :, a:b].transpose(-1, -2) * scale)
    return torch.where(look, sig, 0.0), sig


def _pair(qc, kc, qu, ku, vu, u_j, i_rows, j_rows, window, scale):
    """The pair (query block ``I``, key block ``J``): ``(z, s_u, g, sig, amat, tril)``
    with the logits ``z`` and lookahead scores ``s_u`` ``[B, H, n_I, n_J]``, the lookahead
    weights ``g`` (masked) and ``sig`` ``[B, H, n_J, n_I]`` and ``amat`` ``[B, H, n_I, n_I]``."""
    (a, b), (c, e) = i_rows, j_rows
    g, sig = _weights(qu, ku, i_rows, j_rows, window, scale)
    pos_i = torch.arange(a, b, device=qc.device)
    pos_s = torch.arange(c, e, device=qc.device)
    tril = pos_i[None, :] <= pos_i[:, None]  # [n_I, n_I]  1[j <= i]
    amat = torch.where(tril, qc[:, :, a:b] @ vu[:, :, a:b].transpose(-1, -2) * scale, 0.0)
    s_u = qc[:, :, a:b] @ u_j.transpose(-1, -2) * scale + amat @ g.transpose(-1, -2)
    z = qc[:, :, a:b] @ kc[:, :, c:e].transpose(-1, -2) * scale - F.silu(s_u)
    z = z.masked_fill(pos_s[None, :] > pos_i[:, None], float("-inf"))
    return z, s_u, g, sig, amat, tril


def _blocks(t_len, chunk):
    return [(a, min(a + chunk, t_len)) for a in range(0, t_len, chunk)]


class _ParallelCastle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qc, kc, vc, qu, ku, vu, scale, window, chunk):
        blocks = _blocks(qc.shape[2], chunk)
        bound = logit_bound(qc, kc, scale, chunk)
        acc = torch.zeros_like(qc)  # sum_s exp(Z - M) V^C, shared by all key blocks
        den = torch.zeros_like(bound)  # sum_s exp(Z - M)
        u_end = torch.zeros_like(qc)
        for nj, (c, e) in enumerate(blocks):  # independent: one program each
            u_j = torch.zeros_like(qc[:, :, c:e])  # U_J before query block I
            for a, b in blocks[nj:]:
                z, _, g, _, _, _ = _pair(qc, kc, qu, ku, vu, u_j, (a, b), (c, e), window, scale)
                p = torch.exp(z - bound[:, :, a:b, None])
                acc[:, :, a:b] += p @ vc[:, :, c:e]
                den[:, :, a:b] += p.sum(-1)
                u_j = u_j + g @ vu[:, :, a:b]
            u_end[:, :, c:e] = u_j
        o, lse = acc / den[..., None], bound + torch.log(den)
        ctx.save_for_backward(qc, kc, vc, qu, ku, vu, u_end, o, lse)
        ctx.args = (scale, window, chunk)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        qc, kc, vc, qu, ku, vu, u_end, o, lse = ctx.saved_tensors
        scale, window, chunk = ctx.args
        blocks = _blocks(qc.shape[2], chunk)
        do = torch.zeros_like(qc) if do is None else do
        delta = (do * o).sum(-1)  # [B, H, T]
        if dlse is not None:
            delta = delta - dlse  # dlse adds P dlse to dZ
        dqc, dku, dvu = (torch.zeros_like(qc) for _ in range(3))  # shared: atomics in the kernel
        dkc, dvc, dqu = (torch.zeros_like(qc) for _ in range(3))  # the key block's own
        for nj, (c, e) in enumerate(blocks):
            u_j = u_end[:, :, c:e].clone()
            r_j = torch.zeros_like(u_j)  # gradient reaching U_J from the pairs already done
            for ni in reversed(range(nj, len(blocks))):
                a, b = blocks[ni]
                g = _weights(qu, ku, (a, b), (c, e), window, scale)[0]
                # U_J before block I: undo this pair's update (exactly 0 on the diagonal pair)
                u_j = torch.zeros_like(u_j) if ni == nj else u_j - g @ vu[:, :, a:b]
                z, s_u, g, sig, amat, tril = _pair(qc, kc, qu, ku, vu, u_j, (a, b), (c, e),
                                                   window, scale)
                dg = r_j @ vu[:, :, a:b].transpose(-1, -2)  # [B, H, n_J, n_I]
                dvu[:, :, a:b] += g.transpose(-1, -2) @ r_j
                qc_i, do_i = qc[:, :, a:b], do[:, :, a:b]
                p = torch.exp(z - lse[:, :, a:b, None])
                dvc[:, :, c:e] += p.transpose(-1, -2) @ do_i
                dz = p * (do_i @ vc[:, :, c:e].transpose(-1, -2) - delta[:, :, a:b, None])
                sg = torch.sigmoid(s_u)
                ds = -sg * (1 + s_u * (1 - sg)) * dz
                da = torch.where(tril, ds @ g, 0.0)  # [B, H, n_I, n_I]
                dqc[:, :, a:b] += (dz @ kc[:, :, c:e] + ds @ u_j + da @ vu[:, :, a:b]) * scale
                dkc[:, :, c:e] += dz.transpose(-1, -2) @ qc_i * scale
                r_j = r_j + ds.transpose(-1, -2) @ qc_i * scale
                dg = dg + ds.transpose(-1, -2) @ amat
                dvu[:, :, a:b] += da.transpose(-1, -2) @ qc_i * scale
                dx = dg * g * (1 - sig)
                dqu[:, :, c:e] += dx @ ku[:, :, a:b] * scale
                dku[:, :, a:b] += dx.transpose(-1, -2) @ qu[:, :, c:e] * scale
        return dqc, dkc, dvc, dqu, dku, dvu, None, None, None


def parallel_castle_attention(q_c, k_c, v_c, q_u, k_u, v_u, scale, window, chunk=CHUNK):
    """(o ``[B, T, H, D]``, lse ``[B, H, T]``) by the key-major schedule, in float32
    (float64 for float64 inputs); differentiable. Inputs ``[B, T, H*, D]`` with grouped
    heads as in ``castle_attention``."""
    h, dtype = q_c.shape[2], q_c.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    xs = [x.repeat_interleave(h // x.shape[2], dim=2).transpose(1, 2).to(acc)
          for x in (q_c, k_c, v_c, q_u, k_u, v_u)]  # each [B, H, T, D]
    o, lse = _ParallelCastle.apply(*xs, scale, window, chunk)
    return o.transpose(1, 2).to(dtype), lse
