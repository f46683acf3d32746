"""CASTLE's Triton paths (wavefront and key-major) on a GPU (``pytest -m gpu``): bf16 at
realistic sizes, peak memory, and a timing report against SDPA. Skipped without CUDA; never runs in CI.

Accuracy: the 2x (o, lse) / 3x (gradients) rule of castle_cases.py against the naive
parallel form in bf16, with the float64 reference from the blocked torch path (the naive
float64 one is O(T^3)); floor 1e-3 as for the other bf16 kernels of lapse.
"""

from __future__ import annotations

import pytest
import torch
from castle_cases import Case, compare, make_inputs, time_ms

from lapse.ops.castle import castle_attention

pytestmark = pytest.mark.gpu
BACKENDS = ["triton", "triton-parallel"]  # the wavefront and the key-major schedule

GPU_CASES = [
    Case(b=2, t=2048, h=8, hc=8, hu=8, d=64),
    Case(b=1, t=4096, h=8, hc=2, hu=2, d=128, window=512),
    Case(b=1, t=2048, h=8, hc=4, hu=8, d=128),  # D 128 without a window: 16-position backward blocks
    Case(b=2, t=1000, h=4, hc=4, hu=1, d=96, window=3),
    Case(b=1, t=2048, h=4, hc=4, hu=4, d=48, window=4096),
    Case(b=1, t=1, h=4, hc=2, hu=2, d=64),
    Case(lens=(1, 700, 0, 1348), h=4, hc=2, hu=4, d=64, window=128),
]


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.fixture
def _poison():
    from lapse.ops.castle import triton_ops

    triton_ops.POISON_OUTPUTS = True
    yield
    triton_ops.POISON_OUTPUTS = False


@pytest.mark.usefixtures("_poison")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_triton_gpu_bf16(case, backend):
    errors = compare(case, torch.bfloat16, backend, 1e-3, seed=case.d, device="cuda",
                     ref_backend="torch")
    print(case.id, backend, {k: f"{a:.1e}/{b:.1e}" for k, (a, b) in errors.items()})


@pytest.mark.parametrize("backend", BACKENDS)
def test_triton_gpu_peak_memory_16k(backend):
    """T = 16384, 8 heads of 64, fwd + bwd: the extra memory is O(T D) (float32 U, R and
    gradient buffers), far below one T x T bf16 matrix per head (4 GiB over 8 heads)."""
    case = Case(b=1, t=16384, h=8, hc=8, hu=8, d=64)
    xs, do, _ = make_inputs(case, device="cuda")
    ys = [x.bfloat16().requires_grad_() for x in xs]
    do = do.bfloat16()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    castle_attention(*ys, backend=backend).backward(do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    tt_matrix = case.h * case.t * case.t * 2
    print(f"{backend} T=16384 H=8 D=64 fwd+bwd: peak extra {extra / 2**20:.0f} MiB "
          f"(one T x T bf16 matrix over the heads: {tt_matrix / 2**20:.0f} MiB)")
    assert extra < tt_matrix / 8


def _speed_row(t: int, d: int) -> dict:
    f = torch.nn.functional.scaled_dot_product_attention
    case = Case(b=16384 // t, t=t, h=8, hc=8, hu=8, d=d)
    xs, do, _ = make_inputs(case, device="cuda")
    ys = [x.bfloat16().requires_grad_() for x in xs]
    do = do.bfloat16()
    qkv = [y.transpose(1, 2) for y in ys[:3]]
    row = {}
    for name, fwd in (
        ("sdpa", lambda: f(*qkv, is_causal=True).transpose(1, 2)),
        ("castle", lambda: castle_attention(*ys, backend="triton")),
        ("castle-swl512", lambda: castle_attention(*ys, window=512, backend="triton")),
        ("castle-parallel", lambda: castle_attention(*ys, backend="triton-parallel")),
        ("castle-swl512-parallel", lambda: castle_attention(*ys, window=512, backend="triton-parallel")),
    ):
        with torch.no_grad():
            row[name] = time_ms(fwd)
        row[name + "+bwd"] = time_ms(lambda fwd=fwd: fwd().backward(do))
    return row


@pytest.mark.parametrize("d", [64, 128])
def test_triton_gpu_speed_report(d):
    """Not a benchmark (lapse bench owns those): a printed fwd and fwd+bwd time against
    SDPA at B x T = 16k tokens, 8 heads, bf16, for a first look on a GPU."""
    for t in (2048, 4096, 8192):
        row = _speed_row(t, d)
        print(f"T={t} D={d}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()))
