"""ACP's guarantee (SPEC section 3) as properties, and the staircase against brute force.

The bound checked by :func:`check_acp_bound`, for one row ``i`` with dense attention
probabilities ``P_ij``, kept keys ``K`` and pruned keys ``R`` (``m = sum_{j in R} P_ij``
the pruned mass):

    o_dense = a + b,  a = sum_K P_ij v_j,  b = sum_R P_ij v_j,  o_acp = a / (1 - m)
    o_acp - o_dense = a m / (1 - m) - b = m (o_acp - b / m)

``o_acp`` and ``b / m`` are both convex combinations of value rows, so each coordinate
``d`` of the difference is at most ``m (max_j v_jd - min_j v_jd) <= 2 m max|v|``, and
SPEC section 3 gives ``m < eps`` (every pruned ``P_ij <= exp(2U + D_ij) < eps / L``).
So ``|o_acp - o_dense|_inf <= 2 eps max|v|`` per row, and sharper, ``<= m (max - min)``
with the measured ``m``. The log-sum-exp loses exactly the pruned mass:
``lse_acp = lse_dense + log(1 - m)``. Both backends run in float64 (naive op), with
eps large (1e-3 or e^-5) so that pruning happens at small T and the bound is not
vacuous.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, note, settings, target
from hypothesis import strategies as st

from lapse.ops.forgetting import ACP_BLOCK, LOG_GATE_FLOOR, forgetting_attention
from lapse.ops.forgetting.common import (
    acp_block_start,
    cumulative_log_gates,
    pruned_fraction,
    validate,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def dense_probabilities(q, k, log_fgate, lse, scale):
    """P_ij of one sequence from the definition (SPEC 1), with the naive op's lse.

    q [Tq, HQ, D], k [Tk, H, D], log_fgate [Tk, HQ], lse [HQ, Tq] -> P [HQ, Tq, Tk].
    """
    tq, hq, _ = q.shape
    tk = k.shape[0]
    k = k.repeat_interleave(hq // k.shape[1], dim=1)  # [Tk, HQ, D]
    c = torch.cumsum(log_fgate.clamp_min(LOG_GATE_FLOOR), dim=0)  # [Tk, HQ]
    pos_q = torch.arange(tq) + tk - tq
    bias = c[pos_q].T[:, :, None] - c.T[:, None, :]  # [HQ, Tq, Tk]
    s = torch.einsum("qhd,khd->hqk", q, k) * scale + bias
    s = s.masked_fill(torch.arange(tk)[None, None, :] > pos_q[None, :, None], float("-inf"))
    return torch.exp(s - lse[:, :, None])


def check_acp_bound(q, k, v, log_fgate, eps, cu_seqlens=None):
    """Runs dense and ACP (acp='auto') and checks the bounds above on every row.

    Returns the largest pruned fraction, for the caller to require pruning.
    """
    scale = 1 / math.sqrt(q.shape[-1])
    kw = dict(backend="naive", return_lse=True, cu_seqlens=cu_seqlens)
    o_dense, lse_dense = forgetting_attention(q, k, v, log_fgate, **kw)
    o_acp, lse_acp, stats = forgetting_attention(q, k, v, log_fgate, acp="auto", acp_eps=eps,
                                                 return_stats=True, **kw)
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    hq = q.shape[2]
    for b in range(q.shape[0]):
        for seq, (s0, s1) in enumerate(zip(bounds, bounds[1:], strict=False)):
            if s1 == s0:
                continue
            row = b if cu_seqlens is None else 0
            pick = slice(None) if cu_seqlens is None else slice(s0, s1)
            qs, ks, vs = q[row, pick], k[row, pick], v[row, pick]
            tq, tk = qs.shape[0], ks.shape[0]
            p = dense_probabilities(qs, ks, log_fgate[row, pick], lse_dense[row, :, pick], scale)
            assert torch.allclose(p.sum(-1), torch.ones(hq, tq, dtype=p.dtype), atol=1e-12)
            # pruned keys of every row, from the staircase the ACP run used
            start = stats.block_start[b if cu_seqlens is None else seq]  # [HQ, M]
            first_key = start.long()[:, torch.arange(tq) // ACP_BLOCK] * ACP_BLOCK  # [HQ, Tq]
            pruned = torch.arange(tk)[None, None, :] < first_key[:, :, None]  # [HQ, Tq, Tk]
            mass = (p * pruned).sum(-1)  # [HQ, Tq]
            assert (p[pruned] < eps / tk).all(), "a pruned weight is not below eps / L"
            assert (mass < eps).all(), f"pruned mass {mass.max().item():.3g} >= eps {eps}"
            # output: |o_acp - o_dense| <= m (max_j v_jd - min_j v_jd) <= 2 eps max|v|
            g = hq // vs.shape[1]
            v_range = (vs.amax(0) - vs.amin(0)).repeat_interleave(g, dim=0)  # [HQ, D]
            diff = (o_acp[row, pick] - o_dense[row, pick]).abs()  # [Tq, HQ, D]
            sharp = mass.T[:, :, None] * v_range[None]  # [Tq, HQ, D]
            assert (diff <= sharp + 1e-12).all()
            assert (diff.amax(-1) <= 2 * eps * vs.abs().max() + 1e-12).all()
            # the log-sum-exp loses exactly the pruned mass
            lse_gap = lse_acp[row, :, pick] - lse_dense[row, :, pick]  # [HQ, Tq]
            assert torch.allclose(lse_gap, torch.log1p(-mass), rtol=1e-6, atol=1e-12)
    return stats.pruned_fraction.max().item()


@st.composite
def acp_problems(draw):
    """Small random problems whose gates decay anywhere from slowly to fast."""
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    h = draw(st.sampled_from([1, 2]))
    hq = h * draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([4, 8, 12, 32]))
    packed = draw(st.booleans())
    if packed:
        lens = draw(st.lists(st.integers(0, 200), min_size=1, max_size=3))
        lens[0] = max(lens[0], 1)
        b, tq = 1, sum(lens)
        tk = tq
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    else:
        b, tk = draw(st.integers(1, 2)), draw(st.integers(1, 200))
        tq, cu = draw(st.integers(1, tk)), None
    qk = draw(st.floats(0.05, 1.5))  # q and k magnitude: sets the bound U
    q = torch.randn(b, tq, hq, d, generator=g, dtype=torch.float64) * qk
    k = torch.randn(b, tk, h, d, generator=g, dtype=torch.float64) * qk
    v = torch.randn(b, tk, h, d, generator=g, dtype=torch.float64)
    rates = torch.tensor(draw(st.lists(st.floats(-4, 6), min_size=hq, max_size=hq)))
    logits = torch.randn(b, tk, hq, generator=g, dtype=torch.float64) + rates
    eps = draw(st.sampled_from([1e-3, math.exp(-5)]))
    return q, k, v, F.logsigmoid(logits), eps, cu


@SETTINGS
@given(acp_problems())
def test_acp_error_bound(problem):
    q, k, v, log_fgate, eps, cu = problem
    note(f"q {tuple(q.shape)}, k {tuple(k.shape)}, eps {eps:.3g}, cu_seqlens {cu}")
    frac = check_acp_bound(q, k, v, log_fgate, eps, cu)
    event("pruned" if frac > 0 else "nothing pruned")
    target(frac, label="pruned fraction")


def test_acp_error_bound_with_pruning():
    """A fixed case that certainly prunes, so the bound above is never only vacuous."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 150, 2, 8, generator=g, dtype=torch.float64) * 0.3
    k = torch.randn(2, 200, 1, 8, generator=g, dtype=torch.float64) * 0.3
    v = torch.randn(2, 200, 1, 8, generator=g, dtype=torch.float64)
    log_fgate = F.logsigmoid(torch.randn(2, 200, 2, generator=g, dtype=torch.float64) + 1.0)
    assert check_acp_bound(q, k, v, log_fgate, 1e-3) > 0.2
    q = torch.randn(1, 200, 2, 8, generator=g, dtype=torch.float64) * 0.3
    cu = torch.tensor([0, 1, 190, 200], dtype=torch.int32)
    assert check_acp_bound(q, k[:1], v[:1], log_fgate[:1], 1e-3, cu) > 0.1


def brute_force_staircase(log_fgate, delta, lens, tq_of, hq):
    """block_start and pruned fraction by looping over tiles of the explicit D matrix.

    Uses no monotonicity: a tile is pruned iff it lies strictly before its first query
    and *every* bias in it is below delta; block_start is then checked to be the count
    of a prefix of pruned tiles.
    """
    n_seq, m_max = len(lens), -(-max(tq_of) // ACP_BLOCK) if tq_of else 0
    start = torch.zeros(n_seq, hq, m_max, dtype=torch.int32)
    frac = torch.zeros(n_seq, hq)
    for seq, (lf, tk, tq) in enumerate(zip(log_fgate, lens, tq_of, strict=True)):
        off = tk - tq
        c = torch.cumsum(lf.clamp_min(LOG_GATE_FLOOR), dim=0)  # [Tk, HQ]
        for h in range(hq):
            d_mat = c[:, h][:, None] - c[:, h][None, :]  # [Tk, Tk], D[a, j] = c_a - c_j
            pruned_area = causal_area = 0
            for m in range(-(-tq // ACP_BLOCK)):
                rows = list(range(m * ACP_BLOCK + off, min((m + 1) * ACP_BLOCK, tq) + off))
                kept_seen = False
                for n in range(-(-tk // ACP_BLOCK)):
                    cols = list(range(n * ACP_BLOCK, min((n + 1) * ACP_BLOCK, tk)))
                    if cols[0] > rows[-1]:
                        break  # not a causal tile of this query block
                    causal_area += len(rows) * len(cols)
                    tile = d_mat[rows][:, cols]
                    is_pruned = cols[-1] < rows[0] and bool((tile < delta[seq, h]).all())
                    if is_pruned:
                        assert not kept_seen, "pruned tiles do not form a prefix"
                        start[seq, h, m] += 1
                        pruned_area += len(rows) * len(cols)
                    else:
                        kept_seen = True
            frac[seq, h] = pruned_area / max(causal_area, 1)
    return start, frac


@st.composite
def staircase_problems(draw):
    """Gates on a 1/8 grid (and some -inf), so every cumulative sum is exact in float64
    and ties with delta resolve the same way in every implementation."""
    hq = draw(st.integers(1, 3))
    packed = draw(st.booleans())
    if packed:
        lens = draw(st.lists(st.integers(0, 300), min_size=1, max_size=3))
        b, tk = 1, sum(lens)
        tq = tk
    else:
        b, tk = draw(st.integers(1, 2)), draw(st.integers(1, 300))
        tq = draw(st.integers(1, tk))
    steps = draw(st.lists(st.integers(0, 16), min_size=1, max_size=8))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(len(steps), (b, tk, hq), generator=g)
    log_fgate = -torch.tensor(steps, dtype=torch.float32)[pick] / 8  # [B, Tk, HQ]
    if draw(st.booleans()):
        log_fgate[torch.rand(b, tk, hq, generator=g) < 0.02] = float("-inf")
    n_seq = len(lens) if packed else b
    delta = -torch.randint(0, 8 * 64, (n_seq, hq), generator=g).double() / 8
    cu = None
    if packed:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return log_fgate, delta, tq, cu


@settings(max_examples=60, deadline=None)
@given(staircase_problems())
def test_block_start_matches_brute_force(problem):
    log_fgate, delta, tq, cu = problem
    b, tk, hq = log_fgate.shape
    q = torch.zeros(b, tq, hq, 1)
    k = torch.zeros(b, tk, hq, 1)
    p = validate(q, k, k, log_fgate, None, cu, "naive")
    c = cumulative_log_gates(log_fgate, cu)
    start = acp_block_start(c, delta, p)
    frac = pruned_fraction(start, p)
    if cu is None:
        seqs, lens, tq_of = list(log_fgate.double()), [tk] * b, [tq] * b
    else:
        bounds = cu.tolist()
        seqs = [log_fgate[0, s:e].double() for s, e in zip(bounds, bounds[1:], strict=False)]
        lens = tq_of = [e - s for s, e in zip(bounds, bounds[1:], strict=False)]
    want_start, want_frac = brute_force_staircase(seqs, delta, lens, tq_of, hq)
    # compare only the query blocks each sequence has (shorter packed sequences have
    # fewer; the rest of their row is unused padding)
    for seq, tq_s in enumerate(tq_of):
        m = -(-tq_s // ACP_BLOCK)
        assert torch.equal(start[seq, :, :m], want_start[seq, :, :m]), seq
    assert torch.allclose(frac, want_frac, atol=1e-6)
