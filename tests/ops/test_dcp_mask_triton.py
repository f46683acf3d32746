"""The fused Triton ``log I`` (``ops/dcp/mask_triton.py``: the alpha-sigmoid below the
diagonal, the float64 column scan, the one-kernel backward) against the torch path and
float64, under ``TRITON_INTERPRET=1`` on CPU, outputs NaN-poisoned.

Tolerances from measured error (torch 2.13, Triton 3.6 interpreter): each float32 path
against the float64 torch path, ``log I``, ``dq_int``, ``dk_int`` and ``dbeta``; the
Triton path is held to 3x the torch float32 path's error plus 4 ulps of the quantity's
largest magnitude, as the alpha-sigmoid kernel's tests are (the solver's error near
saturation dominates both, README.md).
"""

from __future__ import annotations

import math

import pytest
import torch

from lapse.ops.dcp import LOG_FLOOR, alpha_sigmoid_triton, interaction_log_mask, naive_interaction_mask

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(alpha_sigmoid_triton, "POISON_OUTPUTS", True)


def inputs(b: int, t: int, r: int = 6, seed: int = 3, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, r, generator=g, dtype=torch.float64) * spread
    k = torch.randn(b, t, r, generator=g, dtype=torch.float64) * spread
    grad = torch.randn(b, t, t, generator=g, dtype=torch.float64)
    return q, k, grad


def mask_and_grads(q_int, k_int, grad, alpha, dtype, backend, beta=0.3):
    q, k = (x.to(dtype).clone().requires_grad_() for x in (q_int, k_int))
    b = torch.tensor(beta, dtype=dtype, device=q.device, requires_grad=True)
    log_i = interaction_log_mask(q, k, b, alpha, backend=backend)
    causal = torch.isfinite(log_i)
    torch.where(causal, log_i * grad.to(dtype), 0.0).sum().backward()
    kept = torch.where(causal, log_i, 0.0).detach()
    return log_i.detach(), [x.double() for x in (kept, q.grad, k.grad, b.grad)]


@pytest.mark.parametrize("alpha", [1.0, 1.001, 1.5, 2.0, 4.0, 8.0], ids=lambda a: f"a{a}")
@pytest.mark.parametrize("t", [1, 31, 45, 70], ids=lambda t: f"T{t}")
def test_fused_mask_is_as_close_to_float64_as_the_torch_path(alpha, t):
    q, k, grad = inputs(2, t, spread=1.2)
    _, ref = mask_and_grads(q, k, grad, alpha, torch.float64, "torch")
    _, torch32 = mask_and_grads(q, k, grad, alpha, torch.float32, "torch")
    log_i, triton32 = mask_and_grads(q, k, grad, alpha, torch.float32, "triton")
    if t > 30 and alpha >= 4:
        assert (ref[0] <= LOG_FLOOR).any() and (ref[0] < 0).any()  # some pairs drop, some fade
    for r, a, b in zip(ref, torch32, triton32, strict=True):
        assert torch.isfinite(b).all()
        floor = 4 * torch.finfo(torch.float32).eps * r.abs().max()
        assert (b - r).abs().max() <= 3 * (a - r).abs().max() + floor
    # the structure, exactly: 0 on the diagonal, -inf above it, finite below
    rows, cols = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
    assert (log_i[:, rows == cols] == 0).all()
    assert (log_i[:, cols > rows] == -math.inf).all()
    assert torch.isfinite(log_i[:, rows > cols]).all()


def test_fused_mask_equals_the_materialised_product_and_is_irreversible():
    q, k, _ = inputs(2, 40, spread=1.5)
    beta = 0.2
    log_i = interaction_log_mask(q.float(), k.float(), beta, 6.0, backend="triton").double()
    want = naive_interaction_mask(q, k, beta, 6.0)  # I, the product, float64
    lower = torch.ones(40, 40, dtype=torch.bool).tril()
    got = torch.where(lower, log_i.exp(), 0.0)
    assert (got - want).abs().max() < 1e-5
    strict = torch.ones(40, 40, dtype=torch.bool).tril(-1)
    dropped = (log_i <= LOG_FLOOR) & strict  # once dropped (query k, key j < k), dropped for query k + 1
    assert dropped.any()
    assert (dropped[:, :-1] <= dropped[:, 1:]).all()


def test_fused_backward_ignores_what_the_gradient_holds_on_and_above_the_diagonal():
    q, k, grad = inputs(1, 37)
    upper = torch.ones(37, 37, dtype=torch.bool).triu()
    poisoned = torch.where(upper, math.nan, grad)
    _, want = mask_and_grads(q, k, torch.where(upper, 0.0, grad), 3.0, torch.float32, "triton")
    qf, kf = (x.float().clone().requires_grad_() for x in (q, k))
    log_i = interaction_log_mask(qf, kf, 0.3, 3.0, backend="triton")
    (dq, dk) = torch.autograd.grad(log_i, (qf, kf), grad_outputs=poisoned.float())
    assert torch.equal(dq.double(), want[1]) and torch.equal(dk.double(), want[2])


def test_fused_mask_compiles_once_for_every_alpha():
    """A scheduled alpha is a 0-d tensor under torch.compile: one graph for every value,
    the closed forms at 1 and 2 included, equal to the eager calls."""
    q, k, grad = inputs(1, 33)
    alpha_t = torch.ones((), dtype=torch.float64)
    torch._dynamo.reset()

    def fn(q, k, alpha):
        return interaction_log_mask(q, k, 0.3, alpha, backend="triton")

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for alpha in (1.0, 1.5, 2.0, 5.0):
            alpha_t.fill_(alpha)
            outs = []
            for f, a in ((compiled, alpha_t), (fn, alpha)):
                qf, kf = (x.float().clone().requires_grad_() for x in (q, k))
                log_i = f(qf, kf, a)
                loss = torch.where(torch.isfinite(log_i), log_i * grad.float(), 0.0).sum()
                dq, dk = torch.autograd.grad(loss, (qf, kf))
                outs.append((log_i.detach(), dq, dk))
            for got, want in zip(*outs, strict=True):
                assert torch.equal(got, want)


def test_fused_mask_refuses_float64_and_bad_alpha():
    q, k, _ = inputs(1, 8)
    with pytest.raises(TypeError, match="float64"):
        interaction_log_mask(q, k, 0.3, 3.0, backend="triton")
    with pytest.raises(ValueError, match="alpha"):
        interaction_log_mask(q.float(), k.float(), 0.3, 0.5, backend="triton")
    with pytest.raises(ValueError, match="0-d"):
        interaction_log_mask(q.float(), k.float(), 0.3, torch.ones(2, dtype=torch.float64), backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [333, 1024], ids=lambda t: f"T{t}")
def test_fused_mask_on_the_gpu_is_as_close_to_float64_as_the_torch_path(t):
    """The compiled kernels (not the interpreter) at a training length and an awkward one."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, grad = (x.cuda() for x in inputs(2, t, r=64, spread=1.0))
    _, ref = mask_and_grads(q, k, grad, 4.0, torch.float64, "torch")
    _, torch32 = mask_and_grads(q, k, grad, 4.0, torch.float32, "torch")
    log_i, triton32 = mask_and_grads(q, k, grad, torch.tensor(4.0, device="cuda"), torch.float32, "triton")
    assert (ref[0] <= LOG_FLOOR).any()
    for r, a, b in zip(ref, torch32, triton32, strict=True):
        floor = 4 * torch.finfo(torch.float32).eps * r.abs().max()
        assert (b - r).abs().max() <= 3 * (a - r).abs().max() + floor
    rows, cols = torch.meshgrid(torch.arange(t, device="cuda"), torch.arange(t, device="cuda"), indexing="ij")
    assert (log_i[:, rows == cols] == 0).all() and (log_i[:, cols > rows] == -math.inf).all()
