"""Bad input to forgetting_attention raises ValueError/TypeError naming the argument.

Each case starts from a valid call (packed or not) and breaks one thing. Tensors on
another device are simulated with the 'meta' device, which holds no data.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lapse.ops.forgetting import forgetting_attention

B, T, HQ, H, D = 2, 8, 4, 2, 16


def valid():
    """Arguments of a valid dense call: q, k, v, log_fgate and keyword arguments."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, HQ, D, generator=g)
    k = torch.randn(B, T, H, D, generator=g)
    v = torch.randn(B, T, H, D, generator=g)
    log_fgate = torch.nn.functional.logsigmoid(torch.randn(B, T, HQ, generator=g))
    return dict(q=q, k=k, v=v, log_fgate=log_fgate, backend="torch")


def packed(lens=(3, 5)):
    """A valid packed call: B = 1, cu_seqlens over ``lens``."""
    a = valid()
    total = sum(lens)
    for name in ("q", "k", "v", "log_fgate"):
        a[name] = a[name][:1, :total]
    a["cu_seqlens"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return a


def with_(base=valid, **changes):
    def make():
        a = base()
        for name, change in changes.items():
            a[name] = change(a) if callable(change) else change
        return a

    return make


def gates_with(value):
    def change(a):
        lf = a["log_fgate"].clone()
        lf[0, 3, 1] = value
        return lf

    return change


CASES = [
    # (id, arguments, error, message pattern)
    ("q-not-tensor", with_(q=lambda a: a["q"].tolist()), TypeError, "q must be a torch.Tensor"),
    ("q-rank3", with_(q=lambda a: a["q"][0]), ValueError, r"q must be \[batch, time, heads"),
    ("k-rank5", with_(k=lambda a: a["k"][None]), ValueError, r"k must be \[batch, time, heads"),
    ("log_fgate-rank2", with_(log_fgate=lambda a: a["log_fgate"][0]), ValueError,
     r"log_fgate must be \[batch, time, heads\]"),
    ("log_fgate-heads-of-k", with_(log_fgate=lambda a: a["log_fgate"][..., :H]), ValueError,
     r"log_fgate must be \[batch, key_time, query_heads\]"),
    ("q-int", with_(q=lambda a: a["q"].long()), TypeError, "q must be float16, bfloat16"),
    ("qkv-dtypes-differ", with_(k=lambda a: a["k"].double()), TypeError,
     "q, k, v must share a dtype"),
    ("heads-not-multiple", with_(k=lambda a: a["k"][:, :, :1].expand(-1, -1, 3, -1),
                                 v=lambda a: a["v"][:, :, :1].expand(-1, -1, 3, -1)),
     ValueError, r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    ("head-dims-differ", with_(k=lambda a: a["k"][..., :8], v=lambda a: a["v"][..., :8]),
     ValueError, "k has head_dim 8 but q has head_dim 16"),
    ("kv-shapes-differ", with_(v=lambda a: a["v"][:, :-1]), ValueError,
     "k and v must have the same shape"),
    ("batch-differs", with_(k=lambda a: a["k"][:1], v=lambda a: a["v"][:1]), ValueError,
     "k has batch 1 but q has batch 2"),
    ("head-dim-300", with_(q=lambda a: a["q"].new_zeros(B, T, HQ, 300),
                           k=lambda a: a["k"].new_zeros(B, T, H, 300),
                           v=lambda a: a["v"].new_zeros(B, T, H, 300)),
     ValueError, r"head_dim must be in \[1, 256\]"),
    ("Tq-gt-Tk", with_(k=lambda a: a["k"][:, :5], v=lambda a: a["v"][:, :5],
                       log_fgate=lambda a: a["log_fgate"][:, :5]),
     ValueError, "q has 8 positions but k has 5"),
    ("log_fgate-positive", with_(log_fgate=gates_with(0.5)), ValueError,
     r"log_fgate must hold log forget gates in \[-inf, 0\].*1 entries"),
    ("log_fgate-nan", with_(log_fgate=gates_with(float("nan"))), ValueError,
     r"log_fgate must hold log forget gates in \[-inf, 0\]"),
    ("log_fgate-float16", with_(log_fgate=lambda a: a["log_fgate"].half()), TypeError,
     "log_fgate must be float32"),
    ("log_fgate-float64-q-float32", with_(log_fgate=lambda a: a["log_fgate"].double()),
     TypeError, "log_fgate must be float32"),
    ("k-on-meta", with_(k=lambda a: a["k"].to("meta")), ValueError,
     "k is on meta but q is on cpu"),
    ("log_fgate-on-meta", with_(log_fgate=lambda a: a["log_fgate"].to("meta")), ValueError,
     "log_fgate is on meta but q is on cpu"),
    ("cu_seqlens-int64", with_(packed, cu_seqlens=lambda a: a["cu_seqlens"].long()),
     ValueError, "cu_seqlens must be a 1-D int32 tensor"),
    ("cu_seqlens-list", with_(packed, cu_seqlens=[0, 3, 8]), TypeError,
     "cu_seqlens must be a torch.Tensor"),
    ("cu_seqlens-2d", with_(packed, cu_seqlens=lambda a: a["cu_seqlens"][None]), ValueError,
     "cu_seqlens must be a 1-D int32 tensor"),
    ("cu_seqlens-not-from-0", with_(packed, cu_seqlens=torch.tensor([1, 3, 8], dtype=torch.int32)),
     ValueError, "cu_seqlens must start at 0"),
    ("cu_seqlens-decreasing", with_(packed, cu_seqlens=torch.tensor([0, 5, 3, 8],
                                                                    dtype=torch.int32)),
     ValueError, "cu_seqlens must start at 0, be non-decreasing"),
    ("cu_seqlens-short-of-total", with_(packed, cu_seqlens=torch.tensor([0, 3, 7],
                                                                        dtype=torch.int32)),
     ValueError, "end at the packed length 8"),
    ("cu_seqlens-on-meta", with_(packed, cu_seqlens=lambda a: a["cu_seqlens"].to("meta")),
     ValueError, "cu_seqlens is on meta"),
    ("cu_seqlens-batch-2", with_(cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32)),
     ValueError, r"with cu_seqlens, q must be packed as \[1, total"),
    ("backend-unknown", with_(backend="cuda"), ValueError, "backend must be one of"),
    ("acp-negative", with_(acp=-1.0), ValueError, r"acp \(the bound U\) must be a finite"),
    ("acp-inf", with_(acp=math.inf), ValueError, r"acp \(the bound U\) must be a finite"),
    ("acp-unknown-string", with_(acp="data"), ValueError, "acp must be None, 'auto'"),
    ("acp-bool", with_(acp=True), TypeError, "acp must be None, 'auto', a float or a tensor"),
    ("acp-list", with_(acp=[1.0] * HQ), TypeError, "acp must be None, 'auto'"),
    ("acp-tensor-shape", with_(acp=torch.ones(H)), ValueError,
     r"acp as a tensor must be \[query_heads\] = \[4\]"),
    ("acp-tensor-negative", with_(acp=-torch.ones(HQ)), ValueError,
     r"acp \(the bound U\) must be finite and non-negative"),
    ("acp_eps-zero", with_(acp="auto", acp_eps=0.0), ValueError, r"acp_eps must be in \(0, 1\)"),
    ("acp_eps-one", with_(acp=1.0, acp_eps=1.0), ValueError, r"acp_eps must be in \(0, 1\)"),
    ("acp_eps-string", with_(acp=1.0, acp_eps="1e-3"), TypeError, "acp_eps must be a number, got str"),
    ("acp_eps-bool", with_(acp="auto", acp_eps=True), TypeError, "acp_eps must be a number, got bool"),
    ("scale-zero", with_(scale=0.0), ValueError, "scale must be a positive finite number"),
    ("scale-negative", with_(scale=-0.25), ValueError, "scale must be a positive finite"),
    ("scale-nan", with_(scale=math.nan), ValueError, "scale must be a positive finite"),
    ("scale-string", with_(scale="0.25"), TypeError, "scale must be a number, got str"),
    ("scale-bool", with_(scale=True), TypeError, "scale must be a number, got bool"),
    ("scale-tensor", with_(scale=torch.tensor(0.5)), TypeError, "scale must be a number, got Tensor"),
]


@pytest.mark.parametrize(("make", "error", "match"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_raises(make, error, match):
    a = make()
    q, k, v, lf = a.pop("q"), a.pop("k"), a.pop("v"), a.pop("log_fgate")
    with pytest.raises(error, match=match):
        forgetting_attention(q, k, v, lf, **a)


def test_valid_calls_pass():
    """The unbroken starting points are valid (so each case above breaks one thing)."""
    for make in (valid, packed, with_(acp="auto"), with_(packed, acp=torch.ones(HQ)),
                 with_(scale=np.float32(0.5), acp="auto", acp_eps=np.float64(1e-3))):  # NumPy numbers
        a = make()
        q, k, v, lf = a.pop("q"), a.pop("k"), a.pop("v"), a.pop("log_fgate")
        assert forgetting_attention(q, k, v, lf, **a).shape == q.shape


def test_triton_backend_checks(monkeypatch):
    """backend='triton' refuses CPU tensors (without the interpreter) and float64."""
    a = valid()
    q, k, v, lf = a["q"], a["k"], a["v"], a["log_fgate"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        forgetting_attention(q, k, v, lf, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(TypeError, match="backend='triton' takes float16, bfloat16 or float32"):
        forgetting_attention(q.double(), k.double(), v.double(), lf.double(), backend="triton")
    # the interpreter's bfloat16 products are wrong (Triton 3.6): refused there, not garbage
    with pytest.raises(TypeError, match="on the CPU interpreter takes float16 or float32"):
        forgetting_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lf, backend="triton")


@pytest.mark.parametrize("backend", ["naive", "torch"])
def test_empty_batches_give_empty_results(backend):
    """No sequence (B = 0), or packed sequences that are all empty: empty outputs of the right
    shapes on every CPU backend (the naive one stacked an empty list)."""
    q, k, v = torch.randn(0, T, HQ, D), torch.randn(0, T, H, D), torch.randn(0, T, H, D)
    o, lse = forgetting_attention(q, k, v, torch.zeros(0, T, HQ), backend=backend, return_lse=True)
    assert o.shape == (0, T, HQ, D) and lse.shape == (0, HQ, T)
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    q, k, v = torch.randn(1, 0, HQ, D), torch.randn(1, 0, H, D), torch.randn(1, 0, H, D)
    o, lse = forgetting_attention(q, k, v, torch.zeros(1, 0, HQ), backend=backend, return_lse=True,
                                  cu_seqlens=cu)
    assert o.shape == (1, 0, HQ, D) and lse.shape == (1, HQ, 0)
