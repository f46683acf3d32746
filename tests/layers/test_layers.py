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


def test_the_qk_norm_bound_holds_for_bfloat16_queries_and_keys():
    """``logit_bound`` bounds ``|scale q.k|`` for the q and k the kernels read: with gains
    equal across a head's channels the normalised vectors sit on the bound's sphere, and
    rounding to bfloat16 lifts about half of them above it (by up to 2^-8), so a bound
    without the rounding factor fails here."""
    torch.manual_seed(0)
    layer = ForgettingAttention(d_model=64, n_heads=4, n_kv_heads=2, head_dim=32, layer_idx=0, qk_norm=True)
    with torch.no_grad():
        layer.q_norm.weight.copy_(torch.tensor([0.5, 1.0, 1.7, 3.0])[:, None].expand_as(layer.q_norm.weight))
        layer.k_norm.weight.copy_(torch.tensor([1.3, 0.8])[:, None].expand_as(layer.k_norm.weight))
    layer = layer.bfloat16()
    seen = {}
    q_src, k_src = layer.qk_sources()
    q_src.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o))
    k_src.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o))
    with torch.no_grad():
        layer(torch.randn(4, 512, 64, dtype=torch.bfloat16), torch.arange(512)[None])
    q, k = seen["q"].float(), seen["k"].float()  # [B, T, H, D]
    assert q.dtype == k.dtype == torch.float32 and seen["q"].dtype == torch.bfloat16
    k = k.repeat_interleave(2, dim=2)
    largest = q.norm(dim=-1).amax((0, 1)) * k.norm(dim=-1).amax((0, 1)) * layer.scale  # >= |scale q.k|
    bound = layer.logit_bound()
    assert (largest <= bound).all(), (largest, bound)
    assert (largest > bound / (1 + 2**-8) ** 4).all()  # on the sphere: the factor is what it covers
