"""The alpha-sigmoid of DCP (SPEC section 6): closed forms, shape of the curve, values
against a high-precision root solve, gradients.

Measured (torch 2.13, CPU) against a 50-digit mpmath bisection of the SPEC's equation,
over x spread through [-1.2/(a-1), 1.2/(a-1)] and a in {1.000001 ... 1000}:
float64 |p error| <= 2.2e-16 and relative log p error <= 2.0e-15; float32 |p error| <=
8.9e-8 (1.5 ulps in [0.5, 1)) and relative log p error <= 7.6e-7. The tolerances below
are about 2x those.
"""

from __future__ import annotations

import math

import pytest
import torch

from lapse.ops.dcp import LOG_FLOOR, alpha_sigmoid, log_alpha_sigmoid

ALPHAS = [1.000001, 1.001, 1.3, 1.5, 3.0, 8.0, 50.0]
TOL_P = {torch.float64: 5e-16, torch.float32: 1.5e-7}  # measured 2.2e-16, 8.9e-8
TOL_LOG = {torch.float64: 5e-15, torch.float32: 1.5e-6}  # measured 2.0e-15, 7.6e-7


def grid(alpha: float, dtype: torch.dtype, n: int = 41) -> torch.Tensor:
    """x over the unsaturated range and a little beyond, plus 0 and +-tiny."""
    edge = 1.2 / (alpha - 1) if alpha > 1.05 else 40.0
    x = torch.linspace(-edge, edge, n, dtype=torch.float64)
    return torch.cat([x, torch.tensor([0.0, 1e-9, -1e-9, 0.3, -0.3])]).to(dtype)


def mp_alpha_sigmoid(x: float, alpha: float, mpmath):
    """The SPEC's equation solved by a 400-step bisection in 50-digit arithmetic."""
    x, c = mpmath.mpf(x), mpmath.mpf(alpha) - 1
    if c * x >= 1:
        return mpmath.mpf(1)
    if c * x <= -1:
        return mpmath.mpf(0)
    lo, hi = mpmath.mpf(0), mpmath.mpf(1)
    for _ in range(400):
        mid = (lo + hi) / 2
        if mid**c - (1 - mid) ** c < c * x:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def test_alpha_one_is_the_logistic_sigmoid():
    x = torch.linspace(-30, 30, 301, dtype=torch.float64)
    assert torch.equal(alpha_sigmoid(x, 1.0), torch.sigmoid(x))
    assert torch.equal(alpha_sigmoid(x.float(), 1), torch.sigmoid(x.float()))
    assert torch.equal(log_alpha_sigmoid(x, 1.0), torch.nn.functional.logsigmoid(x))


def test_alpha_two_is_the_clipped_line():
    x = torch.linspace(-3, 3, 301, dtype=torch.float64)
    assert torch.equal(alpha_sigmoid(x, 2.0), ((x + 1) / 2).clamp(0, 1))
    inside = x.abs() < 1
    assert torch.equal(log_alpha_sigmoid(x, 2.0)[inside], torch.log((x[inside] + 1) / 2))
    assert (log_alpha_sigmoid(x, 2.0)[x <= -1] == LOG_FLOOR).all()
    assert (log_alpha_sigmoid(x, 2.0)[x >= 1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("alpha", ALPHAS + [1.0, 2.0], ids=lambda a: f"a{a!r}")
def test_monotone_symmetric_saturating(alpha, dtype):
    x = torch.linspace(-2.0 / max(alpha - 1, 0.05), 2.0 / max(alpha - 1, 0.05), 4001, dtype=dtype)
    p = alpha_sigmoid(x, alpha)
    assert (p.diff() >= 0).all(), "not monotone"
    assert ((p >= 0) & (p <= 1)).all()
    # sigma(-x) = 1 - sigma(x), up to the rounding of 1 - p
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(alpha_sigmoid(-x, alpha), 1 - p, rtol=0, atol=eps)
    if alpha > 1:
        s = 1.0 / (alpha - 1)
        far = torch.tensor([1.01 * s, -1.01 * s, 10 * s, -10 * s], dtype=dtype)
        assert alpha_sigmoid(far, alpha).tolist() == [1.0, 0.0, 1.0, 0.0]
        # at the edge itself (as rounded to dtype) p is within an ulp of 1 / 0
        edge = alpha_sigmoid(torch.tensor([s, -s], dtype=dtype), alpha)
        torch.testing.assert_close(edge, torch.tensor([1.0, 0.0], dtype=dtype), rtol=0, atol=eps)
    if alpha >= 1.3:
        # just inside the edge p > 0, seen in log space: p itself may be below the
        # smallest float (1e-10 at a = 1.3; nearer 1 even log p is below the floor)
        log_q = log_alpha_sigmoid(torch.tensor(-s * (1 - 1e-3), dtype=dtype), alpha)
        assert LOG_FLOOR < log_q < 0, "saturates before -1/(a-1)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("alpha", ALPHAS + [1000.0], ids=lambda a: f"a{a!r}")
def test_values_against_high_precision_root(alpha, dtype):
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    x = grid(alpha, dtype)
    p = alpha_sigmoid(x, alpha).double()
    log_p = log_alpha_sigmoid(x, alpha).double()
    for i, xi in enumerate(x.double().tolist()):
        ref = mp_alpha_sigmoid(xi, alpha, mpmath)
        assert abs(p[i].item() - float(ref)) <= TOL_P[dtype], (xi, p[i].item(), float(ref))
        if ref > 0:
            log_ref = float(mpmath.log(ref))
            err = abs(log_p[i].item() - log_ref) / max(1.0, abs(log_ref))
            assert err <= TOL_LOG[dtype], (xi, log_p[i].item(), log_ref)
        else:
            assert log_p[i].item() == LOG_FLOOR


@pytest.mark.parametrize("alpha", [1.001, 1.5, 2.0, 3.0, 8.0], ids=lambda a: f"a{a!r}")
@pytest.mark.parametrize("log", [False, True], ids=["p", "logp"])
def test_gradcheck(alpha, log):
    fn = log_alpha_sigmoid if log else alpha_sigmoid
    # inside the saturation range, away from its edges (finite differences straddle them)
    s = min(1.0 / (alpha - 1), 8.0)
    x = (torch.linspace(-0.9, 0.9, 23, dtype=torch.float64) * s).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: fn(t, alpha), (x,))


@pytest.mark.parametrize("alpha", [1.001, 1.5, 3.0, 8.0], ids=lambda a: f"a{a!r}")
def test_gradient_closed_form_and_clipped(alpha):
    s = 1.0 / (alpha - 1)
    m = min(s, 8.0)  # keeps p representable near a = 1 (the formula's powers overflow)
    x = torch.tensor([-2 * s, -0.5 * m, -0.1 * m, 0.0, 0.25 * m, 0.7 * m, 3 * s])
    x = x.double().requires_grad_()
    clipped = torch.tensor([True, False, False, False, False, False, True])
    p = alpha_sigmoid(x, alpha)
    (g,) = torch.autograd.grad(p.sum(), x)
    pd = p.detach()
    expect = 1 / (pd ** (alpha - 2) + (1 - pd) ** (alpha - 2))
    torch.testing.assert_close(g[~clipped], expect[~clipped], rtol=1e-12, atol=0)
    assert (g[clipped] == 0).all()
    (gl,) = torch.autograd.grad(log_alpha_sigmoid(x, alpha).sum(), x)
    assert (gl[clipped] == 0).all()
    torch.testing.assert_close(gl[~clipped], expect[~clipped] / pd[~clipped], rtol=1e-12, atol=0)


def test_alpha_near_one_is_close_to_sigmoid():
    # The difference is O(a - 1): to first order logit(p) = x - (a-1)/2 (log^2 p -
    # log^2 (1-p)), so |p - sigmoid| <= ~0.24 (a-1) and |log p - log sigmoid| ~ (a-1)
    # x^2 / 2 on |x| <= 20. Measured: 2.38e-4 and 0.203 at a = 1.001, 2.38e-10 and
    # 2.0e-7 at a = 1 + 1e-9; the bounds below are 0.25 (a-1) and 210 (a-1).
    x = torch.linspace(-20, 20, 401, dtype=torch.float64)
    for c in (1e-3, 1e-6, 1e-9):
        assert (alpha_sigmoid(x, 1 + c) - torch.sigmoid(x)).abs().max() <= 0.25 * c
        err = log_alpha_sigmoid(x, 1 + c) - torch.nn.functional.logsigmoid(x)
        assert err.abs().max() <= 210 * c


def test_half_precision_runs_in_float32():
    x = torch.linspace(-3, 3, 101)
    for dtype in (torch.float16, torch.bfloat16):
        p = alpha_sigmoid(x.to(dtype), 3.0)
        assert p.dtype == dtype
        torch.testing.assert_close(p.float(), alpha_sigmoid(x.to(dtype).float(), 3.0).to(dtype).float())


def test_nan_propagates_and_no_nan_gradient():
    x = torch.tensor([math.nan, -1e30, 1e30, -math.inf, math.inf, 0.0], dtype=torch.float64)
    p = alpha_sigmoid(x, 3.0)
    assert math.isnan(p[0]) and p[1:].tolist() == [0.0, 1.0, 0.0, 1.0, 0.5]
    xf = x[1:].clone().requires_grad_()
    (g,) = torch.autograd.grad(log_alpha_sigmoid(xf, 3.0).sum() + alpha_sigmoid(xf, 3.0).sum(), xf)
    assert torch.isfinite(g).all()


def _values_and_grad(fn, x: torch.Tensor, alpha, backend: str = "torch"):
    x = x.clone().requires_grad_()
    y = fn(x, alpha, backend=backend)
    w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype)  # a gradient that is not all ones
    (g,) = torch.autograd.grad((y * w).sum(), x)
    return y.detach(), g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 5.0, 8.0], ids=lambda a: f"a{a!r}")
@pytest.mark.parametrize("fn", [alpha_sigmoid, log_alpha_sigmoid], ids=["p", "logp"])
def test_tensor_alpha_equals_float_alpha_bitwise(fn, alpha, dtype):
    """A 0-d alpha (compiled code) picks the closed forms by torch.where and rounds alpha - 1
    once like a float: the same values and gradients, bitwise (also at 1 and 2)."""
    x = torch.cat([grid(alpha if alpha != 2.0 else 1.5, dtype), torch.tensor([-3.0, 3.0], dtype=dtype)])
    want = _values_and_grad(fn, x, alpha)
    for alpha_t in (torch.tensor(alpha, dtype=torch.float64), torch.tensor(alpha)):
        got = _values_and_grad(fn, x, alpha_t)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert not torch.isnan(got[1]).any()
    if alpha == 1.0:  # the closed forms, exactly
        closed = torch.sigmoid(x) if fn is alpha_sigmoid else torch.nn.functional.logsigmoid(x)
        assert torch.equal(want[0], closed)
    if alpha == 2.0 and fn is alpha_sigmoid:
        assert torch.equal(want[0], ((x + 1) / 2).clamp(0, 1))


def test_tensor_alpha_compiles_once_for_every_value():
    """Under torch.compile a 0-d alpha is an input: one graph, no recompilation when its
    value changes, the values and gradients of eager code (aot_eager: measured bitwise)."""
    x = grid(3.0, torch.float32, n=61)
    alpha_t = torch.ones((), dtype=torch.float64)
    torch._dynamo.reset()  # no graph of another test's shapes
    compiled = torch.compile(log_alpha_sigmoid, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for alpha in (1.0, 1.5, 2.0, 5.0):
            alpha_t.fill_(alpha)
            got = _values_and_grad(lambda x, a, backend: compiled(x, a, backend=backend), x, alpha_t)
            want = _values_and_grad(log_alpha_sigmoid, x, alpha)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
