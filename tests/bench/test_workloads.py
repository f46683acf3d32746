"""The attention benchmark's workload, at small scale on CPU."""

import math

import pytest
import torch

from lapse.bench.workloads import (
    LOCAL_RATE_RANGE,
    VARLEN_FRACTIONS,
    WorkloadSpec,
    dense_causal_flops,
    make_workload,
    varlen_lengths,
)

SMALL = dict(seq_len=128, tokens=512)
VARIANTS = {
    "base": WorkloadSpec(**SMALL),
    "d128": WorkloadSpec(**SMALL, heads=12, head_dim=128),
    "gqa": WorkloadSpec(**SMALL, heads=24, kv_heads=6),
    "varlen": WorkloadSpec(**SMALL, varlen=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_shapes_and_dtypes(name):
    spec = VARIANTS[name]
    wl = make_workload(spec, device="cpu", seed=0)
    b, t = (1, 512) if spec.varlen else (4, 128)
    assert wl.q.shape == (b, t, spec.heads, spec.head_dim)
    assert wl.k.shape == wl.v.shape == (b, t, spec.num_kv_heads, spec.head_dim)
    assert wl.log_fgate.shape == (b, t, spec.heads)
    assert wl.q.dtype == wl.k.dtype == wl.v.dtype == torch.bfloat16
    assert wl.log_fgate.dtype == torch.float32
    assert bool((wl.log_fgate <= 0).all()) and bool(torch.isfinite(wl.log_fgate).all())
    assert (wl.cu_seqlens is not None) == spec.varlen


def test_deterministic_given_seed():
    spec = VARIANTS["gqa"]
    a, b = make_workload(spec, device="cpu", seed=3), make_workload(spec, device="cpu", seed=3)
    c = make_workload(spec, device="cpu", seed=4)
    for name in ("q", "k", "v", "log_fgate", "local_rate"):  # local_rate holds NaN
        torch.testing.assert_close(
            getattr(a, name), getattr(b, name), rtol=0, atol=0, equal_nan=True
        )
    assert not torch.equal(a.q, c.q)
    assert not torch.equal(a.log_fgate, c.log_fgate)


def test_qk_rms_normalised_and_v_standard_normal():
    spec = WorkloadSpec(seq_len=256, tokens=1024, heads=4, head_dim=64)
    wl = make_workload(spec, device="cpu", seed=0)
    for x in (wl.q, wl.k):
        norms = x.float().norm(dim=-1)
        torch.testing.assert_close(norms, torch.full_like(norms, math.sqrt(64)), rtol=1e-2, atol=0)
    assert abs(float(wl.v.float().mean())) < 0.01
    assert abs(float(wl.v.float().std()) - 1) < 0.01
    # U = D * scale, with the factor for bf16 rounding, bounds |scale q.k| of the bf16 tensors
    assert spec.qk_norm_bound == pytest.approx(math.sqrt(64) * (1 + 2**-8) ** 4)
    s = torch.einsum("bthd,bshd->bhts", wl.q.float(), wl.k.float()).abs().max() * spec.scale
    assert float(s) <= spec.qk_norm_bound
    # |scale q.k| <= |q| |k| scale: the largest bf16 norms pass sqrt(D), and stay within the bound
    largest = wl.q.float().norm(dim=-1).max() * wl.k.float().norm(dim=-1).max() * spec.scale
    assert math.sqrt(64) < float(largest) <= spec.qk_norm_bound


def test_gate_statistics():
    spec = WorkloadSpec(seq_len=2048, tokens=4096, heads=20)
    wl = make_workload(spec, device="cpu", seed=1)
    local = wl.is_local
    assert int(local.sum()) == 14  # 70% of 20 heads
    rates = wl.local_rate[local]
    lo, hi = LOCAL_RATE_RANGE
    assert bool(((rates >= lo) & (rates <= hi)).all())
    assert bool(torch.isnan(wl.local_rate[~local]).all())
    forget = -wl.log_fgate.double()  # [B, T, HQ], -log f per token
    # global heads: logits 9 + 0.5 N(0, 1), so f is close to 1
    f_global = torch.exp(-forget[..., ~local])
    assert float(f_global.mean()) > 0.999 and float(f_global.min()) > 0.99
    # local heads: without noise -log f = a_h; the noise moves the mean only a little
    mean_rate = forget[..., local].mean(dim=(0, 1))
    ratio = mean_rate / rates.double()
    assert bool(((ratio > 0.8) & (ratio < 1.4)).all()), ratio


def test_varlen_lengths_full_size():
    lengths = varlen_lengths(32768)
    assert len(lengths) == len(VARLEN_FRACTIONS) == 8
    assert sum(lengths) == 32768
    assert len(set(lengths)) == 8  # mixed
    assert min(lengths) > 0


def test_varlen_small():
    spec = WorkloadSpec(tokens=1000, varlen=True, heads=4, kv_heads=2)
    wl = make_workload(spec, device="cpu", seed=0)
    cu = wl.cu_seqlens
    assert cu.dtype == torch.int32 and cu.shape == (9,)
    assert int(cu[0]) == 0 and int(cu[-1]) == 1000
    assert bool((cu[1:] > cu[:-1]).all())
    assert torch.diff(cu).tolist() == spec.seqlens
    assert wl.q.shape == (1, 1000, 4, 64)


def test_dense_causal_flops():
    spec = WorkloadSpec(seq_len=4096)
    assert dense_causal_flops(spec) == 8 * 4 * 4096**2 * 24 * 64 / 2
    varlen = WorkloadSpec(varlen=True)
    assert dense_causal_flops(varlen) == sum(2 * n * n * 24 * 64 for n in varlen.seqlens)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(heads=24, kv_heads=5),
        dict(head_dim=0),
        dict(head_dim=300),
        dict(seq_len=3000, tokens=32768),
        dict(varlen=True, tokens=4),
    ],
    ids=["heads-not-multiple", "D0", "D300", "tokens-not-multiple", "varlen-too-small"],
)
def test_bad_spec_raises(kwargs):
    with pytest.raises(ValueError):
        WorkloadSpec(**kwargs)
