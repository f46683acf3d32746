"""The layers on their own: features as constructor arguments, rotary tables, KV-shift.

The models' tests (tests/models) hold the four architectures to a line-by-line restatement
of SPEC section 2; here each piece is checked alone, including feature combinations no
preset uses (a layer must not assume the architecture it was built for)."""

from __future__ import annotations

import math

import pytest
import torch

from lapse.kv import DenseStore
from lapse.layers import ForgettingAttention, KVShift, RotaryEmbedding, SoftmaxAttention, kv_shift

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rotary_rotates_each_pair_by_its_angle_and_shares_its_table():
    d, base = 8, 10000.0
    rope = RotaryEmbedding(d, base)
    x = torch.randn(2, 5, 3, d, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])  # [B, T]: a second sequence further on
    got = rope(x, positions, 16)
    for b in range(2):
        for t in range(5):
            for i in range(d // 2):
                angle = positions[b, t].item() * base ** (-2 * i / d)
                c, s = math.cos(angle), math.sin(angle)
                a, bb = x[b, t, :, i], x[b, t, :, i + d // 2]
                torch.testing.assert_close(got[b, t, :, i], a * c - bb * s, atol=1e-12, rtol=0)
                torch.testing.assert_close(got[b, t, :, i + d // 2], a * s + bb * c, atol=1e-12, rtol=0)
    other = RotaryEmbedding(d, base)
    assert other._tables(16, x.device)[0] is rope._tables(16, x.device)[0]  # one table per (D, base, device)
    with pytest.raises(ValueError, match="even head dim"):
        RotaryEmbedding(7, base)


def test_kv_shift_continues_across_chunks():
    """Shifting a sequence in two chunks, the second starting from the first's last
    projection, equals shifting it at once (what a decoding cache relies on)."""
    shift = KVShift(16, 2)
    x = torch.randn(2, 9, 16)
    proj = torch.randn(2, 9, 2, 4)
    whole = shift.shift(proj, x)
    first = shift.shift(proj[:, :4], x[:, :4])
    second = shift.shift(proj[:, 4:], x[:, 4:], proj[:, 3:4])
    torch.testing.assert_close(torch.cat([first, second], 1), whole)
    alpha = torch.full((1, 3, 1), 0.25)
    ramp = torch.arange(1.0, 4.0)[None, :, None, None]
    assert kv_shift(ramp, alpha)[0, :, 0, 0].tolist() == [0.75, 1.75, 2.75]  # x_0 = 0


@pytest.mark.parametrize(
    "features",
    [dict(), dict(qk_norm=True), dict(kv_shift=True, output_gate=True), dict(kv_shift=True, qk_norm=True)],
    ids=["plain", "qk-norm", "shift+gate", "shift+qk-norm"],
)
@pytest.mark.parametrize("kind", ["softmax", "forgetting"])
def test_any_feature_combination_decodes_like_the_full_forward(kind, features):
    torch.manual_seed(0)
    common = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, layer_idx=0, **features)
    layer = SoftmaxAttention(**common) if kind == "softmax" else ForgettingAttention(**common)
    layer = layer.double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x, torch.arange(9)[None])
        store, parts = DenseStore(1), []
        for start, end in ((0, 5), (5, 6), (6, 9)):
            positions = store.begin(2, end - start, x.device)
            parts.append(layer(x[:, start:end], positions, store))
            store.advance()
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-12, rtol=0)
    assert (layer.logit_bound() is not None) == features.get("qk_norm", False)
