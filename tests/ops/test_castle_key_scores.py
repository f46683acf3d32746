"""castle_key_scores: the prompt's accumulated attention per key (H2O, A2SF) for CASTLE.

The reference is written from the definition (SPEC sections 5 and 7) in float64: for
every query ``i`` its lookahead vectors ``u^i_j`` summed term by term, the softmax of
``q^C_i . k^C_j * scale - SiLU(q^C_i . u^i_j * scale)`` over ``j <= i``, weighted by
``alpha^(T-1-i)`` and summed over the query heads of each kv head. Float64 is held to
1e-12 relative (measured 1e-16), float32 to 1e-5 (measured 1e-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lapse.ops.castle import castle_key_scores
from lapse.ops.castle.chunked import chunked_key_scores

pytestmark = pytest.mark.usefixtures("one_thread")

SCALE = 0.4


def reference(q_c, k_c, q_u, k_u, v_u, window, alpha):
    b, t, h, _ = q_c.shape
    hc = k_c.shape[2]
    kc, ku, vu = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k_c, k_u, v_u))
    scores = torch.zeros(b, t, h, dtype=torch.float64)
    for i in range(t):
        js = torch.arange(t)
        g = torch.sigmoid(torch.einsum("bshd,bjhd->bhsj", q_u, ku) * SCALE)  # [B, H, s, j]
        look = (js[:, None] < js[None, :]) & (js[None, :] <= i)  # s < j <= i
        if window is not None:
            look = look & (js[None, :] <= js[:, None] + window)
        u = torch.einsum("bhsj,bjhd->bhsd", torch.where(look, g, 0.0), vu)  # [B, H, s, D]
        q = q_c[:, i]  # [B, H, D]
        z = torch.einsum("bhd,bshd->bhs", q, kc) * SCALE - F.silu(torch.einsum("bhd,bhsd->bhs", q, u) * SCALE)
        z = z.masked_fill(js > i, float("-inf"))
        scores += alpha ** (t - 1 - i) * torch.softmax(z, -1).transpose(1, 2)
    return scores.view(b, t, hc, h // hc).sum(-1)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("alpha", [1.0, 0.8, 0.0])
@pytest.mark.parametrize("heads", [(4, 2, 1), (2, 2, 2)], ids=["H4-HC2-HU1", "H2-HC2-HU2"])
def test_key_scores_equal_the_definition(window, alpha, heads):
    h, hc, hu = heads
    g = torch.Generator().manual_seed(0)
    b, t, d = 2, 21, 10
    q_c, q_u = (torch.randn(b, t, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k_c = torch.randn(b, t, hc, d, generator=g, dtype=torch.float64)
    k_u, v_u = (torch.randn(b, t, hu, d, generator=g, dtype=torch.float64) for _ in range(2))
    ref = reference(q_c, k_c, q_u, k_u, v_u, window, alpha)
    got = castle_key_scores(q_c, k_c, q_u, k_u, v_u, scale=SCALE, window=window, alpha=alpha)
    assert got.dtype == torch.float64 and got.shape == (b, t, hc)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    got32 = castle_key_scores(*(x.float() for x in (q_c, k_c, q_u, k_u, v_u)), scale=SCALE, window=window,
                              alpha=alpha)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), ref, rtol=1e-5, atol=1e-5)
    # chunks of 8 (three block rows) give the same
    blocked = chunked_key_scores(q_c, k_c, q_u, k_u, v_u, SCALE, window, alpha, chunk=8)
    torch.testing.assert_close(blocked, ref, rtol=1e-12, atol=1e-12)
