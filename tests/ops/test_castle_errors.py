"""Bad input to castle_attention raises ValueError/TypeError naming the argument, before
any work. Each case starts from a valid call and breaks one thing."""

from __future__ import annotations

import pytest
import torch

from lapse.ops.castle import castle_attention, castle_lookahead_keys

B, T, H, HC, HU, D = 2, 8, 4, 2, 1, 16


def valid():
    g = torch.Generator().manual_seed(0)
    heads = dict(q_c=H, k_c=HC, v_c=HC, q_u=H, k_u=HU, v_u=HU)
    a = {name: torch.randn(B, T, h, D, generator=g) for name, h in heads.items()}
    a["backend"] = "torch"
    return a


def with_(**changes):
    def make():
        a = valid()
        for name, change in changes.items():
            a[name] = change(a) if callable(change) else change
        return a

    return make


def packed():
    a = valid()
    for name in ("q_c", "k_c", "v_c", "q_u", "k_u", "v_u"):
        a[name] = a[name][:1]
    a["cu_seqlens"] = torch.tensor([0, 3, 8], dtype=torch.int32)
    return a


CASES = [
    ("q_c-not-tensor", with_(q_c=lambda a: a["q_c"].tolist()), TypeError, "q_c must be a torch.Tensor"),
    ("k_u-3d", with_(k_u=lambda a: a["k_u"][0]), ValueError, "k_u must be \\[batch, time"),
    ("int-dtype", with_(v_u=lambda a: a["v_u"].long()), TypeError, "v_u must be float16"),
    ("bool-dtype", with_(q_c=lambda a: a["q_c"] > 0), TypeError, "q_c must be float16"),
    ("mixed-dtype", with_(k_c=lambda a: a["k_c"].double()), TypeError, "share a dtype"),
    ("q_u-head-dim", with_(q_u=lambda a: a["q_u"][..., :8]), ValueError, "q_u has head_dim 8"),
    ("v_c-head-dim", with_(v_c=lambda a: a["v_c"][..., :8]), ValueError, "v_c has head_dim 8"),
    ("k_u-time", with_(k_u=lambda a: a["k_u"][:, :5]), ValueError, "k_u is \\[batch, time\\]"),
    ("v_c-batch", with_(v_c=lambda a: a["v_c"][:1]), ValueError, "v_c is \\[batch, time\\]"),
    ("q_u-heads", with_(q_u=lambda a: a["q_u"][:, :, :2]), ValueError, "q_u must have the shape of q_c"),
    ("k_c-v_c-heads", with_(v_c=lambda a: a["v_c"][:, :, :1]), ValueError, "k_c and v_c must have"),
    ("k_u-v_u-heads", with_(v_u=lambda a: a["k_c"]), ValueError, "k_u and v_u must have"),
    ("k_c-group", with_(k_c=lambda a: a["q_c"][:, :, :3], v_c=lambda a: a["q_c"][:, :, :3]),
     ValueError, "k_c has 3 heads"),
    ("k_u-group", with_(k_u=lambda a: a["q_c"][:, :, :3], v_u=lambda a: a["q_c"][:, :, :3]),
     ValueError, "k_u has 3 heads"),
    ("window-0", with_(window=0), ValueError, "window must be >= 1"),
    ("window-negative", with_(window=-3), ValueError, "window must be >= 1"),
    ("window-float", with_(window=2.0), TypeError, "window must be None or an int"),
    ("window-bool", with_(window=True), TypeError, "window must be None or an int"),
    ("scale-0", with_(scale=0.0), ValueError, "scale must be a positive"),
    ("backend", with_(backend="cuda"), ValueError, "backend must be one of"),
    ("cu_seqlens-batch", with_(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32)), ValueError,
     "packed as \\[1, total"),
    ("cu_seqlens-dtype", lambda: {**packed(), "cu_seqlens": packed()["cu_seqlens"].long()},
     ValueError, "int32"),
    ("cu_seqlens-end", lambda: {**packed(), "cu_seqlens": torch.tensor([0, 3, 7], dtype=torch.int32)},
     ValueError, "end at the packed length"),
    ("triton-f64", with_(backend="triton", **{n: (lambda a, n=n: a[n].double())
                                              for n in ("q_c", "k_c", "v_c", "q_u", "k_u", "v_u")}),
     (TypeError, ValueError), "float64|triton"),
]


@pytest.mark.parametrize("make, error, match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(make, error, match):
    with pytest.raises(error, match=match):
        castle_attention(**make())


def test_valid_calls_run():
    castle_attention(**valid())
    castle_attention(**packed())


def test_lookahead_keys_errors():
    a = valid()
    with pytest.raises(ValueError, match="window must be >= 1"):
        castle_lookahead_keys(a["q_u"], a["k_u"], a["v_u"], window=0)
    with pytest.raises(ValueError, match="q_u must be"):
        castle_lookahead_keys(a["q_u"][..., :8], a["k_u"], a["v_u"])
    with pytest.raises(TypeError, match="float dtype"):
        castle_lookahead_keys(a["q_u"].long(), a["k_u"].long(), a["v_u"].long())
