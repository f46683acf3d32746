"""DCP attention: the fine-tuning path (``backend="torch"``, SDPA with the mask as a bias)
against the materialised float64 oracle, forward and every gradient, through the mask
to ``q_int``, ``k_int`` and ``beta``; and with nothing dropped it is plain causal attention.

Tolerance rule (STYLE principle 3): the torch path's float32 error against the float64
oracle is at most 2x (output) / 3x (gradients) the error of the oracle run in float32,
plus a floor of 8 ulps of ``max(1, max|reference|)``. Measured over the cases below
(max-abs error over max(1, max|ref|)): output 1.2e-7 - 1.1e-6, gradients up to 2.8e-4
(d beta at a = 8, baseline 2.7e-4: the alpha-sigmoid's dp/dz = 32 at p = 1/2 sets it);
the one ratio to the baseline above 1.6x was 4.5x, d beta = 5.9e-7 (a sum over all
B T^2 pairs in another order), below the floor (9.5e-7). In float64 the two paths
agree to 1.2e-14 (bound 1e-12).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from lapse.ops.dcp import dcp_attention, dcp_sparsity_loss, interaction_log_mask

F32_ULP = torch.finfo(torch.float32).eps
NAMES = ("o", "dq", "dk", "dv", "dq_int", "dk_int", "dbeta")


@dataclass(frozen=True)
class Case:
    b: int
    t: int
    hq: int
    h: int
    d: int
    r: int
    alpha: float
    beta: float

    @property
    def id(self) -> str:
        return (f"B{self.b}-T{self.t}-HQ{self.hq}-H{self.h}-D{self.d}-r{self.r}"
                f"-a{self.alpha!r}-beta{self.beta}")


CASES = [
    Case(2, 63, 4, 2, 48, 16, 1.0, 2.0),
    Case(2, 63, 4, 2, 48, 16, 1.001, 0.5),
    Case(2, 63, 4, 2, 48, 16, 3.0, 0.5),
    Case(1, 130, 6, 2, 40, 64, 8.0, 2.0),
    Case(1, 130, 6, 2, 40, 64, 1.5, 0.5),
    Case(2, 33, 3, 3, 24, 8, 2.0, 1.0),
    Case(2, 1, 2, 2, 16, 8, 3.0, 1.0),
]


def make_inputs(c: Case, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return dict(q=rnd(c.b, c.t, c.hq, c.d), k=rnd(c.b, c.t, c.h, c.d), v=rnd(c.b, c.t, c.h, c.d),
                q_int=rnd(c.b, c.t, c.r), k_int=rnd(c.b, c.t, c.r),
                beta=torch.tensor(c.beta, dtype=torch.float64), do=rnd(c.b, c.t, c.hq, c.d))


def run(c: Case, x: dict, dtype: torch.dtype, backend: str) -> list[torch.Tensor]:
    """Output and gradients of ``sum(o * do) + sparsity`` through mask and attention."""
    a = {n: t.detach().to(dtype).requires_grad_() for n, t in x.items() if n != "do"}
    log_i = interaction_log_mask(a["q_int"], a["k_int"], a["beta"], c.alpha)
    o = dcp_attention(a["q"], a["k"], a["v"], log_i, backend=backend)
    loss = (o * x["do"].to(dtype)).sum() + dcp_sparsity_loss(log_i)
    loss.backward()
    return [o.detach()] + [a[n].grad for n in ("q", "k", "v", "q_int", "k_int", "beta")]


def errors(out: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    return [((u.double() - r).abs().max() / max(1.0, r.abs().max().item())).item()
            for u, r in zip(out, ref, strict=True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_torch_path_equals_reference_forward_and_backward(case):
    x = make_inputs(case)
    ref = run(case, x, torch.float64, "naive")
    for name, e in zip(NAMES, errors(run(case, x, torch.float64, "torch"), ref), strict=True):
        assert e <= 1e-12, (name, e)
    base = errors(run(case, x, torch.float32, "naive"), ref)
    got = errors(run(case, x, torch.float32, "torch"), ref)
    for name, e, b in zip(NAMES, got, base, strict=True):
        factor = 2 if name == "o" else 3
        assert e <= factor * b + 8 * F32_ULP, (name, e, b)


@pytest.mark.parametrize("backend", ["torch", "naive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape", [(2, 63, 4, 2, 48), (1, 17, 3, 1, 20)],
                         ids=lambda s: f"B{s[0]}-T{s[1]}-HQ{s[2]}-H{s[3]}-D{s[4]}")
def test_nothing_dropped_is_causal_attention(shape, dtype, backend):
    b, t, hq, h, d = shape
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, t, hq, d, generator=g, dtype=dtype)
    k = torch.randn(b, t, h, d, generator=g, dtype=dtype)
    v = torch.randn(b, t, h, d, generator=g, dtype=dtype)
    log_i = torch.zeros(b, t, t, dtype=torch.float32).tril()  # above the diagonal: 0, masked anyway
    o = dcp_attention(q, k, v, log_i, backend=backend)
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    # measured: the torch path is bit-identical to SDPA's is_causal on CPU; the naive
    # path is off by 3.6e-7 (float32) and 8.9e-16 (float64)
    tol = 2e-6 if dtype == torch.float32 else 4e-15
    torch.testing.assert_close(o, ref, rtol=0, atol=tol)


def test_half_precision_runs():
    c = Case(1, 40, 4, 2, 32, 8, 3.0, 0.5)
    x = make_inputs(c)
    ref = run(c, x, torch.float64, "naive")
    out = run(c, x, torch.bfloat16, "torch")
    assert out[0].dtype == torch.bfloat16
    e = errors(out, ref)
    base = errors(run(c, x, torch.bfloat16, "naive"), ref)
    assert all(math.isfinite(v) for v in e)
    # measured: output 4.2e-3 against the naive path's 5.2e-3 in bfloat16
    assert e[0] <= 2 * base[0] + 8 * 2**-8, (e[0], base[0])
