"""CASTLE's Triton paths (the wavefront ``"triton"`` and the key-major schedule
``"triton-parallel"``) against the float64 oracle (forward, lse and all six gradients).

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) with 16-position
blocks, so T = 15 / 17 are one block minus / plus one and T = 257 spans 17 wavefront
steps; float32 and float16 (the interpreter's bf16 dots are wrong). Every output and
scratch buffer is NaN-poisoned first. On a GPU the same comparisons run in bf16 at
realistic sizes in test_castle_triton_gpu.py.

Tolerances: the 2x (o, lse) / 3x (gradients) rule of castle_cases.py. Measured here:
float32 wavefront 1.2e-7..4.0e-7 against naive float32 1.3e-7..3.4e-7 (ratio <= 1.4);
key-major 4.6e-8..7.2e-7 (ratio <= 2.7, on a gradient: its rows are sums of per-pair
float32 partials added by atomics, one rounding more per pair than an accumulator);
the floors (1e-6 float32, 1e-3 float16) matter only at T = 1. There, with one key per
row, the exact dZ of the output term is 0, and the kernel's flash-style dZ = P (dP -
Delta), Delta = rowsum(dO * O) summed apart from dP, is about one ulp of |dO . V|
instead: measured 2.2e-5 relative on dq_c and dk_c in float32 (naive float32: 4.6e-8),
hence GRAD_FLOOR_T1 = 1e-4 for that case only (float16's baseline covers it).
"""

from __future__ import annotations

import pytest
import torch
from castle_cases import Case, compare, make_inputs, rel

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET on CPU

from lapse.ops.castle import castle_attention, triton_ops  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3}
BACKENDS = ["triton", "triton-parallel"]  # the wavefront and the key-major schedule
GRAD_FLOOR_T1 = 1e-4

CASES = [
    Case(b=2, t=1, h=2, hc=1, hu=1, d=48),
    Case(b=3, t=2, h=2, hc=2, hu=2, d=96, window=1),
    Case(b=2, t=15, h=4, hc=2, hu=1, d=48),
    Case(b=1, t=17, h=2, hc=1, hu=2, d=96, window=3),
    Case(b=1, t=63, h=2, hc=2, hu=2, d=48, window=1),
    Case(b=2, t=65, h=2, hc=1, hu=2, d=24, window=20),
    Case(b=1, t=40, h=2, hc=2, hu=1, d=16, window=64),
    Case(b=1, t=257, h=1, hc=1, hu=1, d=16, window=3),
    Case(b=1, t=100, h=2, hc=1, hu=1, d=32),
    Case(lens=(1, 20, 0, 33), h=2, hc=1, hu=2, d=48, window=3),
]


@pytest.fixture(autouse=True)
def _poison():
    triton_ops.POISON_OUTPUTS = True
    yield
    triton_ops.POISON_OUTPUTS = False


def _cpu_only():
    if torch.cuda.is_available():
        pytest.skip("interpreter shapes; the GPU runs test_castle_triton_gpu.py")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_triton_matches_oracle(case, dtype, backend):
    _cpu_only()
    if dtype == torch.float16 and case.t > 65:
        pytest.skip("float16 on the interpreter: the smaller shapes suffice")
    grad_floor = GRAD_FLOOR_T1 if case.t == 1 and dtype == torch.float32 else 0.0
    compare(case, dtype, backend, FLOOR[dtype], seed=case.t + case.d, grad_floor=grad_floor)


@pytest.mark.parametrize("backend", BACKENDS)
def test_triton_window_at_least_t_is_castle(backend):
    _cpu_only()
    xs, _, _ = make_inputs(Case(b=1, t=40, h=2, hc=1, hu=2, d=16), seed=4)
    full = castle_attention(*xs, backend=backend)
    # the key-major path sums rows with atomics: equal up to the order of the additions
    tol = dict(rtol=0, atol=0) if backend == "triton" else {}
    for w in (39, 40, 1000):  # j - s <= T - 1 always
        torch.testing.assert_close(castle_attention(*xs, window=w, backend=backend), full, **tol)
    assert rel(castle_attention(*xs, window=20, backend=backend), full) > 1e-4


def test_triton_parallel_wide_logits():
    """Causal logits spread over ~100 in a row (beyond float32's exp range from the
    row's bound without the HEADROOM cap): the key-major path still matches."""
    _cpu_only()
    case = Case(b=1, t=40, h=2, hc=1, hu=2, d=16, window=5)
    xs, _, _ = make_inputs(case, seed=3)
    xs[0] = xs[0] * 8.0
    ref = castle_attention(*(x.double() for x in xs), window=5, backend="naive")
    got = castle_attention(*xs, window=5, backend="triton-parallel")
    assert rel(got, ref) < 1e-5


def test_triton_equals_torch_f32():
    """The two blocked paths agree closer than either does to float64 at these sizes."""
    _cpu_only()
    case = Case(b=1, t=70, h=4, hc=2, hu=2, d=32, window=5)
    xs, _, _ = make_inputs(case, seed=9)
    a = castle_attention(*xs, window=5, backend="triton")
    b = castle_attention(*xs, window=5, backend="torch")
    assert rel(a, b) < 1e-6


@pytest.mark.parametrize("window", [None, 2, 40])
def test_triton_backward_tiles_differently(monkeypatch, window):
    """The backward shares only per-position tensors with the forward (lse, the final U),
    so it may use other blocks: here 16 forward, 32 and 8 backward."""
    _cpu_only()
    from lapse.ops.castle.triton_fwd import block_config

    case = Case(b=1, t=70, h=2, hc=1, hu=2, d=16, window=window)
    for bwd_bt in (32, 8):
        monkeypatch.setattr(triton_ops, "block_config", lambda d, interpret, backward=False, bt=bwd_bt:
                            dict(BT=bt, num_warps=1) if backward else block_config(d, interpret))
        compare(case, torch.float32, "triton", FLOOR[torch.float32], seed=12)
