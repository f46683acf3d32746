"""The fused Triton alpha-sigmoid (``ops/dcp/alpha_sigmoid_triton.py``) against the torch
bisection, forward and backward, run under ``TRITON_INTERPRET=1`` on CPU.

Tolerances from measured error (torch 2.13, Triton 3.6 interpreter), both float32 paths
against the float64 torch path over x spread through [-1.2/(a-1), 1.2/(a-1)]:
``|p error|``: torch 1.2e-7, Triton 1.6e-7; ``|log p error|`` (unclipped): torch 6.5e-4,
Triton 6.5e-4, at most 2.7x the torch error at one alpha (a = 8: 4.7e-4 against 1.7e-4).
The large log p errors sit next to saturation (``|x| -> 1/(a-1)``), where ``t`` is the
root of an equation whose slope is ``c sigmoid(-t)``: float32 rounding of ``h`` (1e-7)
moves ``t`` by ``1e-7 / (c e^-t)``, whichever way ``h`` is rounded. So each path is held
to 3x the torch float32 error plus a floor of 4 ulps of the quantity.
"""

from __future__ import annotations

import pytest
import torch

from lapse.ops.dcp import (
    LOG_FLOOR,
    alpha_sigmoid,
    alpha_sigmoid_triton,
    interaction_log_mask,
    log_alpha_sigmoid,
)

# log(0) = -inf on purpose (x = 0 in the kernel); numpy warns about it in the interpreter
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")

ALPHAS = [1.000001, 1.001, 1.3, 1.5, 3.0, 8.0, 50.0]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(alpha_sigmoid_triton, "POISON_OUTPUTS", True)


def points(alpha: float, shape=(3, 37, 41)) -> torch.Tensor:
    """float32 x (exactly, so every path sees the same input) through and past the
    unsaturated range, in an awkward shape (not a multiple of the block), with 0 and +-tiny."""
    edge = 1.2 / (alpha - 1) if alpha > 1.05 else 40.0
    n = torch.Size(shape).numel()
    x = torch.linspace(-edge, edge, n - 4, dtype=torch.float64)
    x = torch.cat([x, torch.tensor([0.0, 1e-9, -1e-9, 0.3], dtype=torch.float64)])
    return x.float().double().reshape(shape)


def run(fn, x: torch.Tensor, alpha: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = fn(x, alpha, backend=backend)
    w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)  # a gradient that is not all ones
    (g,) = torch.autograd.grad((y * w).sum(), x)
    return y.detach().double(), g.double()


@pytest.mark.parametrize("fn", [alpha_sigmoid, log_alpha_sigmoid], ids=["p", "log_p"])
@pytest.mark.parametrize("alpha", ALPHAS, ids=lambda a: f"a{a}")
def test_triton_matches_the_float64_reference_as_closely_as_torch_float32(fn, alpha):
    x = points(alpha)
    ref, gref = run(fn, x, alpha, "torch")  # float64
    out = {b: run(fn, x.float(), alpha, b) for b in ("torch", "triton")}
    kept = ref > LOG_FLOOR if fn is log_alpha_sigmoid else torch.ones_like(ref, dtype=torch.bool)
    scale = gref.abs().clamp_min(1e-3)
    err = {
        b: ((y - ref)[kept].abs().max(), ((g - gref).abs() / scale).max()) for b, (y, g) in out.items()
    }
    y, g = out["triton"]
    assert not torch.isnan(y).any() and not torch.isnan(g).any()
    ulp = 4 * torch.finfo(torch.float32).eps
    assert err["triton"][0] <= 3 * err["torch"][0] + ulp * ref.abs().max().clamp_min(1)
    assert err["triton"][1] <= 3 * err["torch"][1] + ulp
    if fn is log_alpha_sigmoid:  # the clipped ones floor exactly, with no gradient
        assert torch.equal(y[~kept], ref[~kept])
        assert (g[~kept] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_takes_16_bit_inputs_in_float32(dtype):
    x = points(3.0, (5, 33)).to(dtype)
    want = log_alpha_sigmoid(x.float(), 3.0, backend="triton").to(dtype)
    assert torch.equal(log_alpha_sigmoid(x, 3.0, backend="triton"), want)


def test_triton_edges_nan_saturation_and_empty():
    x = torch.tensor([float("nan"), 0.0, 0.5, -0.5, 1e30, -1e30, float("inf"), -float("inf")])
    p = alpha_sigmoid(x, 3.0, backend="triton")
    assert torch.isnan(p[0])
    assert torch.equal(p[1:], torch.tensor([0.5, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]))
    assert torch.equal(log_alpha_sigmoid(x[2:], 3.0, backend="triton"), torch.tensor([0.0, LOG_FLOOR] * 3))
    assert alpha_sigmoid(torch.empty(0, 4), 3.0, backend="triton").shape == (0, 4)


def test_mask_with_triton_is_as_close_to_float64_as_with_torch_forward_and_backward():
    g = torch.Generator().manual_seed(3)
    q_int = torch.randn(2, 45, 6, generator=g, dtype=torch.float64)
    k_int = torch.randn(2, 45, 6, generator=g, dtype=torch.float64)
    grad = torch.randn(2, 45, 45, generator=g, dtype=torch.float64)

    def mask(dtype, backend):
        q, k = (x.to(dtype).clone().requires_grad_() for x in (q_int, k_int))
        beta = torch.tensor(0.3, dtype=dtype, requires_grad=True)
        log_i = interaction_log_mask(q, k, beta, 4.0, backend=backend)
        causal = torch.isfinite(log_i)
        torch.where(causal, log_i * grad.to(dtype), 0.0).sum().backward()
        return [x.double() for x in (torch.where(causal, log_i, 0.0).detach(), q.grad, k.grad, beta.grad)]

    ref = mask(torch.float64, "torch")
    assert (ref[0] <= LOG_FLOOR).any() and (ref[0] > LOG_FLOOR).any()  # some pairs drop
    torch32, triton32 = mask(torch.float32, "torch"), mask(torch.float32, "triton")
    for r, a, b in zip(ref, torch32, triton32, strict=True):
        floor = 4 * torch.finfo(torch.float32).eps * r.abs().max()
        assert (b - r).abs().max() <= 3 * (a - r).abs().max() + floor


def test_triton_backend_refuses_float64_and_unknown_backends():
    with pytest.raises(TypeError, match="float64"):
        alpha_sigmoid(torch.zeros(3, dtype=torch.float64), 3.0, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        alpha_sigmoid(torch.zeros(3), 3.0, backend="naive")


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 5.0, 8.0], ids=lambda a: f"a{a}")
@pytest.mark.parametrize("fn", [alpha_sigmoid, log_alpha_sigmoid], ids=["p", "log_p"])
def test_triton_tensor_alpha_equals_float_alpha_bitwise(fn, alpha):
    """The kernels read alpha from a 0-d tensor either way (a float is put in one): the
    same values and gradients, bitwise, the closed forms at 1 and 2 included."""
    x = points(alpha if alpha != 2.0 else 1.5).flatten()  # alpha 2: past the clip at |x| = 1
    x = torch.cat([x, torch.tensor([-3.0, 3.0], dtype=torch.float64)])
    want = run(fn, x.float(), alpha, "triton")
    for alpha_t in (torch.tensor(alpha, dtype=torch.float64), torch.tensor(alpha)):
        got = run(fn, x.float(), alpha_t, "triton")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_triton_ops_compile_once_for_every_alpha():
    """The launches are custom operators: torch.compile (fullgraph) calls them without
    tracing into the kernels, and a new alpha value needs no new graph."""
    x = points(3.0, (7, 45)).float()
    alpha_t = torch.ones((), dtype=torch.float64)
    torch._dynamo.reset()  # no graph of another test's shapes
    compiled = torch.compile(log_alpha_sigmoid, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for alpha in (1.0, 1.5, 2.0, 5.0):
            alpha_t.fill_(alpha)
            got = run(lambda x, a, backend: compiled(x, a, backend=backend), x, alpha_t, "triton")
            want = run(log_alpha_sigmoid, x, alpha, "triton")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
