"""Forgetting attention never waits for the GPU (CUDA): no device-to-host copy or
synchronisation in the forward or the backward, dense or with ACP, eager or through the
custom ops a compiled layer calls, so the host queues the next kernels while these run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lapse.ops.forgetting import forgetting_attention, set_value_checks
from lapse.ops.forgetting.library import compiled_forgetting_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(b=2, t=1000, hq=4, h=2, d=64):
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(b, t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    f = F.logsigmoid(torch.randn(b, t, hq, device="cuda", generator=g) + 2.0)  # ACP prunes most tiles
    return [x.requires_grad_() for x in (q, k, v, f)]


@pytest.mark.parametrize("acp", [None, "auto", 12.0, "tensor"])
@pytest.mark.parametrize("path", ["eager", "custom-op"])
def test_no_sync_forward_or_backward(acp, path):
    q, k, v, f = _inputs()
    bound = torch.full((q.shape[2],), 12.0, device="cuda") if acp == "tensor" else acp
    if path == "custom-op" and isinstance(bound, float):
        pytest.skip("the custom ops take a bound as a tensor or 'auto'")
    op = forgetting_attention if path == "eager" else compiled_forgetting_attention
    do = torch.randn_like(q)

    def step():
        o = op(q, k, v, f, acp=bound)
        return torch.autograd.grad(o, (q, k, v, f), do)

    step()  # the kernels compile (and autotune) on the first call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(bool(torch.isfinite(g).all()) for g in grads)


def test_value_checks_when_asked_for():
    q, k, v, f = _inputs()
    bad = f.detach().clone()
    bad[0, 3, 1] = 0.5
    forgetting_attention(q, k, v, bad)  # off by default on CUDA: no read-back
    previous = set_value_checks(True)
    try:
        with pytest.raises(ValueError, match="positive or NaN"):
            forgetting_attention(q, k, v, bad)
    finally:
        set_value_checks(previous)
