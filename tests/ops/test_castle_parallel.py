"""CASTLE's key-major schedule (``parallel.py``, the mirror of ``triton_parallel.py``)
against the parallel-form oracle in float64: forward, lse and all six gradients, CASTLE
and CASTLE-SWL, at awkward shapes (T not a multiple of the 16-position block, grouped
heads, windows 1, 3, inside and beyond T), held to 1e-12 relative.

Also the bound ``M`` the schedule normalises every row by: ``0 <= lse - M <= HEADROOM + log T``
(so no term overflows and the row's own diagonal term keeps the sum away from 0), and
rows whose logits spread far beyond float32's exp range still come out exact.
"""

from __future__ import annotations

import math

import pytest
from castle_cases import NAMES, Case, make_inputs, rel

from lapse.ops.castle import naive_castle_parallel
from lapse.ops.castle.parallel import HEADROOM, logit_bound, parallel_castle_attention

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [
    Case(b=2, t=1, h=2, hc=1, hu=1, d=48),
    Case(b=3, t=2, h=2, hc=2, hu=2, d=96, window=1),
    Case(b=2, t=17, h=4, hc=2, hu=1, d=48),
    Case(b=1, t=63, h=2, hc=1, hu=2, d=24, window=3),
    Case(b=1, t=65, h=2, hc=2, hu=1, d=16, window=20),
    Case(b=1, t=40, h=2, hc=2, hu=2, d=16, window=64),
]


def _grads(fn, xs, do, dlse, window):
    ys = [x.double().requires_grad_() for x in xs]
    o, lse = fn(*ys, 0.3, window)
    ((o * do.double()).sum() + 0.1 * (lse * dlse.double()).sum()).backward()
    return [o, lse] + [y.grad for y in ys]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_key_major_equals_naive_f64(case):
    xs, do, dlse = make_inputs(case, seed=case.t)
    ref = _grads(naive_castle_parallel, xs, do, dlse, case.window)
    got = _grads(parallel_castle_attention, xs, do, dlse, case.window)
    for name, a, b in zip(NAMES, got, ref, strict=True):
        assert a.shape == b.shape, name
        assert rel(a, b) < 1e-12, f"{name}: {rel(a, b):.1e}"


def test_bound_holds_and_wide_rows_stay_exact():
    """Logits spread over ~300 (far beyond exp's float32 range): the bound keeps every
    term <= exp(HEADROOM), and the output still equals the oracle."""
    case = Case(b=1, t=40, h=2, hc=2, hu=2, d=16, window=5)
    xs, _, _ = make_inputs(case, seed=3)
    xs[0] = xs[0] * 8.0  # q_c: causal logits of size ~ 8 * 0.3 * 16
    qc, kc = (x.double().transpose(1, 2) for x in xs[:2])
    bound = logit_bound(qc, kc, 0.3)
    o, lse = parallel_castle_attention(*(x.double() for x in xs), 0.3, case.window)
    o_ref, lse_ref = naive_castle_parallel(*(x.double() for x in xs), 0.3, case.window)
    assert (lse_ref - bound).max() <= HEADROOM + math.log(case.t)  # T terms <= exp(HEADROOM)
    assert (lse_ref - bound).min() >= -1e-12  # the diagonal logit alone: exp(0)
    assert (lse_ref - bound).max() > 20  # the cap was used
    assert rel(o, o_ref) < 1e-12 and rel(lse, lse_ref) < 1e-12
