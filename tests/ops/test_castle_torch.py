"""CASTLE's oracles and PyTorch path: recurrent == parallel == blocked (SPEC section 5).

- float64: the recurrent definition, the parallel form and the blocked torch path agree
  to rounding (held to 1e-12 relative), forward and all six gradients;
- float32 / bfloat16: the torch path against the float64 oracle by the 2x / 3x rule of
  ``castle_cases.py``. Measured on these cases: float32 torch 2.1e-7..5.8e-7 against
  naive float32 1.8e-7..5.4e-7 (ratio <= 1.2); bfloat16 torch (float32 inside)
  3e-3..7e-3 against naive bfloat16 4e-3..1.1e-2. The floor 1e-6 (float32) only matters
  at T = 1, where both are at the final rounding.
"""

from __future__ import annotations

import pytest
import torch
from castle_cases import NAMES, Case, compare, make_inputs, rel, run

from lapse.ops.castle import (
    castle_attention,
    castle_lookahead_keys,
    naive_castle_parallel,
    naive_castle_recurrent,
)
from lapse.ops.castle.naive import naive_lookahead_keys

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [
    Case(b=2, t=1, h=2, hc=1, hu=1, d=48),
    Case(b=3, t=2, h=2, hc=2, hu=2, d=96, window=1),
    Case(b=2, t=63, h=4, hc=2, hu=1, d=48),
    Case(b=1, t=65, h=2, hc=2, hu=2, d=96, window=3),
    Case(b=1, t=257, h=2, hc=1, hu=2, d=64, window=3),
    Case(b=1, t=130, h=2, hc=2, hu=1, d=48, window=200),
    Case(lens=(1, 70, 0, 64), h=4, hc=2, hu=2, d=48, window=3),
]
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


def _grads_f64(fn, xs, do, dlse, window):
    ys = [x.double().requires_grad_() for x in xs]
    o, lse = fn(*ys, 0.3, window)
    ((o * do.double()).sum() + 0.1 * (lse * dlse.double()).sum()).backward()
    return [o, lse] + [y.grad for y in ys]


@pytest.mark.parametrize("case", [c for c in CASES if c.t <= 65 and c.lens is None],
                         ids=lambda c: c.id)
def test_recurrent_equals_parallel_f64(case):
    xs, do, dlse = make_inputs(case, seed=1)
    a = _grads_f64(naive_castle_recurrent, xs, do, dlse, case.window)
    b = _grads_f64(naive_castle_parallel, xs, do, dlse, case.window)
    for name, x, y in zip(NAMES, a, b, strict=True):
        assert rel(x, y) < 1e-12, name


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_torch_equals_naive_f64(case):
    xs, do, dlse = make_inputs(case, seed=2)
    ref = run(xs, do, dlse, torch.float64, "naive", case)
    got = run(xs, do, dlse, torch.float64, "torch", case)
    for name, a, r in zip(NAMES, got, ref, strict=True):
        assert rel(a, r) < 1e-12, f"{name}: {rel(a, r):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_torch_low_precision(case, dtype):
    compare(case, dtype, "torch", FLOOR[dtype], seed=3)


@pytest.mark.parametrize("backend", ["naive", "torch"])
def test_window_at_least_t_is_castle(backend):
    xs, _, _ = make_inputs(Case(b=2, t=40, h=2, hc=1, hu=2, d=16), seed=4)
    full = castle_attention(*xs, backend=backend)
    for w in (39, 40, 1000):  # j - s <= T - 1 always
        torch.testing.assert_close(castle_attention(*xs, window=w, backend=backend), full,
                                   rtol=1e-6, atol=1e-6)
    assert rel(castle_attention(*xs, window=20, backend=backend), full) > 1e-4


def test_packed_equals_separate():
    case = Case(lens=(5, 1, 33), h=2, hc=1, hu=1, d=16, window=2)
    xs, _, _ = make_inputs(case, seed=5)
    o = castle_attention(*xs, window=2, cu_seqlens=case.cu_seqlens(), backend="torch")
    start = 0
    for n in case.lens:
        part = castle_attention(*(x[:, start:start + n] for x in xs), window=2, backend="naive")
        torch.testing.assert_close(o[:, start:start + n], part, rtol=1e-5, atol=1e-6)
        start += n


def test_silu_is_there():
    """The lookahead score enters as -SiLU(s^U): the variant without SiLU differs, and
    with zero lookahead values CASTLE is plain causal softmax attention."""
    xs, _, _ = make_inputs(Case(b=1, t=30, h=2, hc=2, hu=2, d=16), seed=6)
    xs = [x.double() for x in xs]
    o = castle_attention(*xs, backend="torch")
    with_silu, _ = naive_castle_parallel(*xs, 0.25, None, use_silu=True)
    without, _ = naive_castle_parallel(*xs, 0.25, None, use_silu=False)
    assert rel(o, with_silu) < 1e-12
    assert rel(o, without) > 1e-2
    xs[5] = torch.zeros_like(xs[5])  # v_u = 0: U = 0, SiLU(0) = 0
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        xs[0].transpose(1, 2), xs[1].transpose(1, 2), xs[2].transpose(1, 2), is_causal=True)
    torch.testing.assert_close(castle_attention(*xs, backend="torch"), sdpa.transpose(1, 2))


@pytest.mark.parametrize("window", [None, 1, 3])
def test_lookahead_keys(window):
    """U at the end of the sequence: the last row is zero, the blocked sum equals the
    materialised one, and grouped k_u/v_u are repeated over the query heads."""
    xs, _, _ = make_inputs(Case(b=2, t=70, h=4, hc=1, hu=2, d=24), seed=7)
    q_u, k_u, v_u = (x.double() for x in xs[3:])
    u = castle_lookahead_keys(q_u, k_u, v_u, scale=0.3, window=window)
    assert u.shape == q_u.shape and u.dtype == torch.float64
    assert torch.equal(u[:, -1], torch.zeros_like(u[:, -1]))
    assert u[:, -2].abs().min() > 0
    torch.testing.assert_close(u, naive_lookahead_keys(q_u, k_u, v_u, 0.3, window),
                               rtol=1e-12, atol=1e-12)


def test_lse_and_dtype():
    xs, _, _ = make_inputs(Case(b=1, t=9, h=2, hc=2, hu=2, d=8), seed=8)
    xs = [x.bfloat16() for x in xs]
    o, lse = castle_attention(*xs, return_lse=True, backend="torch")
    assert o.dtype == torch.bfloat16 and o.shape == xs[0].shape
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 9)
