"""The deferred CASTLE decode step on a GPU (``pytest -m gpu``): the kernel against the
immediate torch step at the 125M model's shapes over steps that cross folds, and a
printed per-step timing of the immediate and the deferred kernel under CUDA-graph replay
(not asserted: ``lapse bench decode --castle-fold-every M`` owns the measurement). Skipped without
CUDA.

Tolerances as in ``test_castle_decode_gpu.py`` (float32 arithmetic on the same bf16
inputs, only the order of sums differs; ``o`` rounded to bf16).
"""

from __future__ import annotations

import pytest
import torch
import triton.testing
from castle_cases import rel

from lapse.ops.castle import castle_decode_fold, castle_decode_step

pytestmark = pytest.mark.gpu

H, D = 7, 64


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _inputs(lens: list[int], capacity: int, steps: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    b = len(lens)
    n = torch.tensor(lens, dtype=torch.int32, device="cuda")
    unused = (torch.arange(capacity, device="cuda")[None, :] >= (n[:, None] + steps - 1))[:, :, None, None]
    cache = dict(
        u=torch.where(unused, float("nan"), randn(b, capacity, H, D, dtype=torch.float32) * 0.3),
        qu=torch.where(unused, float("nan"), randn(b, capacity, H, D)),
        kc=torch.where(unused, float("nan"), randn(b, capacity, H, D)),
        vc=torch.where(unused, float("nan"), randn(b, capacity, H, D)),
    )
    new = [dict(q_c=randn(b, H, D), k_u=randn(b, H, D), v_u=randn(b, H, D)) for _ in range(steps)]
    return new, cache, n


def _steps(new, cache, n, u, window, backend, ring=None):
    return [castle_decode_step(x["q_c"], x["k_u"], x["v_u"], u, cache["qu"], cache["kc"], cache["vc"], n + i,
                               window=window, return_lse=True, check_values=False, backend=backend,
                               pending=ring) for i, x in enumerate(new)]


def _ring(b: int, m: int):
    return (torch.full((b, m, H, D), float("nan"), device="cuda", dtype=torch.bfloat16),
            torch.full((b, m, H, D), float("nan"), device="cuda", dtype=torch.bfloat16),
            torch.full((b, m), -1, device="cuda", dtype=torch.int32))


@pytest.mark.parametrize("m", [4, 8], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("window", [None, 128], ids=lambda w: f"W{w}")
def test_deferred_kernel_equals_the_immediate_step_at_125m_shapes(window, m):
    lens = [4096, 4097, 1, 3000, 4150, 129, 4095, 2048]
    steps = 2 * m + 3
    new, cache, n = _inputs(lens, 4176, steps)
    u_ref, u = cache["u"].clone(), cache["u"].clone()
    ring = _ring(len(lens), m)
    ref = _steps(new, cache, n, u_ref, window, "torch")
    got = _steps(new, cache, n, u, window, "triton", ring)
    for (o, lse), (o_ref, lse_ref) in zip(got, ref, strict=True):
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        assert rel(o, o_ref) < 4e-3 and rel(lse, lse_ref) < 1e-5
    last = n + steps - 1
    castle_decode_fold(u, cache["qu"], ring, last, window=window)
    for i, k in enumerate(last.tolist()):
        assert rel(u[i, :k], u_ref[i, :k]) < 1e-5
        assert torch.isnan(u[i, k:]).all(), "a slot past the length was written"


@pytest.mark.parametrize("batch", [8, 1], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("window", [None, 512], ids=lambda w: f"W{w}")
def test_deferred_kernel_speed_report(window, batch):
    """One layer, 4096 held slots: a CUDA graph of M = 8 steps (one fold), per step."""
    m = 8
    new, cache, n = _inputs([4096] * batch, 4176, m)
    times = {}
    for name, ring in (("immediate", None), ("deferred", _ring(batch, m))):
        u = cache["u"].clone()
        ms = triton.testing.do_bench_cudagraph(lambda: _steps(new, cache, n, u, window, "triton", ring),  # noqa: B023
                                               rep=50, return_mode="median")
        times[name] = 1e3 * ms / m
    print(f"B={batch} W={window} M={m}: immediate {times['immediate']:.1f} us, deferred "
          f"{times['deferred']:.1f} us per layer step")
