"""The DCP interaction mask (SPEC section 6): the cumulative-sum form against the product
definition, irreversibility, the diagonal, the step variant, finite gradients, the
sparsity term and statistic.

Measured errors of ``exp(interaction_log_mask)`` against ``naive_interaction_mask`` in
float64 (B2-T63-r16, B1-T130-r64, beta in {0.5, 2}): <= 4.4e-16 for every alpha except
1.001, where the *reference* loses ~eps / (a-1) (the SPEC's equation is a difference of
two numbers near 1): 2.5e-14. In float32 the op's error was at most 1.02x the error of
the naive product in float32 (and 100x below it at a = 1.001): 5.4e-6 at a = 8, where
dp/dz = 32 at p = 1/2 makes the conditioning, not the op, the limit.
"""

from __future__ import annotations

import math

import pytest
import torch

from lapse.ops.dcp import (
    LOG_FLOOR,
    dcp_attention,
    dcp_sparsity,
    dcp_sparsity_loss,
    interaction_log_mask,
    interaction_log_mask_step,
    interaction_logits,
    naive_interaction_mask,
)
from lapse.ops.dcp.mask import causal_log_cumsum

F32_ULP = torch.finfo(torch.float32).eps
SHAPES = [(2, 63, 16), (1, 130, 64), (3, 1, 4)]
ALPHAS = [1.0, 1.001, 1.5, 2.0, 3.0, 8.0]


def shape_id(s):
    return f"B{s[0]}-T{s[1]}-r{s[2]}"


def interaction(b, t, r, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q_int = torch.randn(b, t, r, generator=g, dtype=torch.float64).to(dtype)
    k_int = torch.randn(b, t, r, generator=g, dtype=torch.float64).to(dtype)
    return q_int, k_int


@pytest.mark.parametrize("beta", [2.0, 0.5])
@pytest.mark.parametrize("alpha", ALPHAS + [None], ids=lambda a: "step" if a is None else f"a{a!r}")
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_cumsum_form_equals_product_definition(shape, alpha, beta):
    q_int, k_int = interaction(*shape)
    ref = naive_interaction_mask(q_int, k_int, beta, alpha)  # [B, T, T] float64

    def op(q, k):
        if alpha is None:
            return interaction_log_mask_step(q, k, beta)
        return interaction_log_mask(q, k, beta, alpha)

    log_i = op(q_int, k_int)
    assert log_i.dtype == torch.float64
    tol64 = 1e-15 if alpha in (None, 1.0) else 1e-15 + 1e-16 / (alpha - 1)  # see module doc
    assert (log_i.exp() - ref).abs().max() <= tol64

    log_i32 = op(q_int.float(), k_int.float())
    assert log_i32.dtype == torch.float32
    err = (log_i32.exp().double() - ref).abs().max()
    base = (naive_interaction_mask(q_int.float(), k_int.float(), beta, alpha).double() - ref)
    assert err <= 2 * base.abs().max() + 8 * F32_ULP

    t = shape[1]
    assert (log_i.diagonal(dim1=1, dim2=2) == 0).all(), "the diagonal is always kept"
    above = torch.ones(t, t, dtype=torch.bool).triu(1)
    assert torch.isneginf(log_i[:, above]).all()
    assert torch.isfinite(log_i[:, ~above]).all(), "below the diagonal log I is floored, finite"
    if alpha is None:  # the step mask keeps or drops, nothing in between
        below = log_i[:, ~above]
        assert ((below == 0) | (below <= LOG_FLOOR)).all()


@pytest.mark.parametrize("alpha", [1.5, 3.0, 8.0, None], ids=lambda a: "step" if a is None else f"a{a!r}")
def test_irreversible(alpha):
    q_int, k_int = interaction(2, 97, 8, seed=3, dtype=torch.float32)
    beta = 0.7
    if alpha is None:
        log_i = interaction_log_mask_step(q_int, k_int, beta)
    else:
        log_i = interaction_log_mask(q_int, k_int, beta, alpha)
    i = log_i.exp()
    t = i.shape[-1]
    dropped = (i == 0) & torch.ones(t, t, dtype=torch.bool).tril(-1)  # [B, T(k), T(j)]
    assert dropped.any() and not dropped.all(), "the case should drop some pairs, not all"
    # once zero for query k, zero for every later query k' > k: a column's dropped set
    # is a suffix, so the running "ever dropped" equals "dropped"
    ever = dropped.int().cummax(dim=1).values.bool()
    assert torch.equal(ever, dropped)
    assert (log_i[dropped] <= LOG_FLOOR).all()
    # and the column only decays: I[k+1, j] <= I[k, j] below the diagonal
    col = torch.where(torch.ones(t, t, dtype=torch.bool).tril(), i, 1.0)
    assert (col.diff(dim=1) <= 0).all()


@pytest.mark.parametrize("alpha", [1.0, 1.001, 1.5, 3.0, 8.0], ids=lambda a: f"a{a!r}")
def test_gradcheck_mask(alpha):
    q_int, k_int = interaction(2, 7, 3, seed=1)
    beta = torch.tensor(0.3, dtype=torch.float64)
    t = 7
    causal = torch.ones(t, t, dtype=torch.bool).tril()

    def fn(q, k, b):  # log I below the diagonal (the -inf above has no derivative)
        return torch.where(causal, interaction_log_mask(q, k, b, alpha), 0.0)

    args = tuple(a.clone().requires_grad_() for a in (q_int, k_int, beta))
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 3.0, 8.0], ids=lambda a: f"a{a!r}")
def test_gradients_finite_with_heavy_dropping(alpha):
    """Most pairs dropped (beta very negative, large logits): the floor keeps -inf out
    of the cumulative sum, and nothing in the forward or backward is NaN or inf."""
    q_int, k_int = interaction(2, 64, 8, seed=5, dtype=torch.float32)
    q_int, k_int = (3 * q_int).requires_grad_(), (3 * k_int).requires_grad_()
    beta = torch.tensor(-1.0, requires_grad=True)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 64, 2, 16, generator=g, requires_grad=True) for _ in range(3))
    log_i = interaction_log_mask(q_int, k_int, beta, alpha)
    assert (dcp_sparsity(log_i)[:, -1] > 0.8).all(), "the case should drop most pairs"
    o = dcp_attention(q, k, v, log_i)
    loss = o.square().sum() + 0.1 * dcp_sparsity_loss(log_i) + log_i.clamp_min(-50).sum()
    loss.backward()
    assert torch.isfinite(o).all()
    for name, t in (("q", q), ("q_int", q_int), ("k_int", k_int), ("beta", beta)):
        assert torch.isfinite(t.grad).all(), name
    assert q_int.grad.abs().sum() > 0 and beta.grad != 0


def test_step_is_the_large_alpha_limit():
    q_int, k_int = interaction(2, 40, 8, seed=2)
    step = interaction_log_mask_step(q_int, k_int, 0.5).exp()
    soft = interaction_log_mask(q_int, k_int, 0.5, 1e6).exp()
    assert (step - soft).abs().max() < 1e-3


def test_logits_for_decode():
    q_int, k_int = interaction(2, 9, 8, seed=4)
    z = interaction_logits(q_int[:, -2:], k_int, torch.tensor([0.5], dtype=torch.float64))
    assert z.shape == (2, 2, 9)
    ref = torch.einsum("bqr,bkr->bqk", q_int[:, -2:], k_int) / math.sqrt(8) + 0.5
    torch.testing.assert_close(z, ref, rtol=0, atol=1e-15)


@pytest.mark.parametrize("alpha", [1.0, 3.0, None], ids=lambda a: "step" if a is None else f"a{a!r}")
def test_sparsity_term_and_statistic(alpha):
    q_int, k_int = interaction(2, 30, 8, seed=7)
    if alpha is None:
        log_i = interaction_log_mask_step(q_int, k_int, 0.4)
    else:
        log_i = interaction_log_mask(q_int, k_int, 0.4, alpha)
    i = naive_interaction_mask(q_int, k_int, 0.4, alpha)  # [B, T, T]
    t = 30
    below = torch.ones(t, t, dtype=torch.bool).tril(-1)
    expect_loss = i[:, below].mean()
    torch.testing.assert_close(dcp_sparsity_loss(log_i), expect_loss, rtol=1e-13, atol=0)
    dropped = ((i == 0) & below).sum(-1).double()  # [B, T]
    expect = dropped / torch.arange(t).clamp_min(1)
    stat = dcp_sparsity(log_i)
    assert stat.dtype == torch.float32 and stat.shape == (2, t)
    torch.testing.assert_close(stat, expect.float(), rtol=0, atol=0)
    assert (stat[:, 0] == 0).all()
    one = log_i[:, :1, :1]
    assert dcp_sparsity_loss(one) == 0 and dcp_sparsity(one).tolist() == [[0.0], [0.0]]


def test_the_traced_step_mask_scans_through_prefix_count():
    """The step mask's cumulative count goes through ``lapse::prefix_count`` (a scan Inductor
    calls rather than fuses with the broadcast causal mask, which its split-scan code
    generation fails on: CUDA, long or symbolic T), and equals the float64 cumulative sum of
    ``LOG_FLOOR`` where ``z <= 0`` bit for bit."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(3)
    q_int, k_int = torch.randn(2, 90, 8, generator=g), torch.randn(2, 90, 8, generator=g)
    torch._dynamo.reset()
    traced = torch.compile(interaction_log_mask_step, backend=backend, fullgraph=True)(q_int, k_int, 0.2)
    targets = [node.target for gm in graphs for node in gm.graph.nodes]
    assert torch.ops.lapse.prefix_count.default in targets
    assert not [t for t in targets if getattr(t, "__name__", str(t)) == "cumsum"]
    z = interaction_logits(q_int, k_int, 0.2)
    expected = causal_log_cumsum(torch.where(z > 0, 0.0, LOG_FLOOR))
    assert torch.equal(interaction_log_mask_step(q_int, k_int, 0.2), expected)
    assert torch.equal(traced, expected)
