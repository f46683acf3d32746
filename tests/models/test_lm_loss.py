"""The decoder's loss compiled (what ``prepare_blocks`` gives the trainer) against the eager
one: the loss and the logits' gradient, bf16 logits, labels with left-out positions. On the
CPU (Inductor's C++ code) and, marked ``gpu``, on CUDA at a real vocabulary."""

from __future__ import annotations

import pytest
import torch

from lapse.models import Decoder, prepare_blocks, preset
from lapse.models.decoder import lm_loss


def _loss_and_grad(fn, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, labels)
    loss.backward()
    return loss.detach(), x.grad


def _check(device: str, b: int, t: int, v: int, rtol_grad: float) -> None:
    torch.manual_seed(0)
    logits = (3 * torch.randn(b, t, v, device=device)).to(torch.bfloat16)
    labels = torch.randint(0, v, (b, t), device=device)
    labels[0, : t // 3] = -100
    torch._dynamo.reset()
    want, want_grad = _loss_and_grad(lm_loss, logits, labels)
    got, got_grad = _loss_and_grad(torch.compile(lm_loss), logits, labels)
    assert got_grad.dtype == torch.bfloat16 and torch.isfinite(got_grad).all()
    assert (got_grad[0, : t // 3] == 0).all()  # left-out positions get no gradient
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (got, want)
    err = (got_grad.float() - want_grad.float()).norm() / want_grad.float().norm()
    print(f"{device}: loss {got.item():.6f} / {want.item():.6f}, grad rel err {err:.2e}")
    assert err <= rtol_grad


# The gradient is rounded to bf16 once either way; a different float32 summation order may
# move an element by one bf16 step (2^-8 relative): 4e-3 allows that for every element.
# Measured: 0 on the CPU (torch 2.13).


def test_compiled_loss_equals_eager_on_cpu():
    _check("cpu", 2, 37, 259, rtol_grad=4e-3)


@pytest.mark.gpu
def test_compiled_loss_equals_eager_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check("cuda", 2, 2048, 50304, rtol_grad=4e-3)


def test_prepare_blocks_compiles_the_loss():
    model = Decoder(preset("tiny", "fox-pro"))
    assert model.loss_fn is lm_loss
    prepare_blocks(model, compile=True)
    assert getattr(model.loss_fn, "_torchdynamo_orig_callable", None) is lm_loss
