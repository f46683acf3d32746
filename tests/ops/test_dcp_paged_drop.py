"""The DCP decode step's drop kernel (``ops/dcp/paged_drop.py``) against its torch path
(the reference: the keys of the table's whole width gathered, z in float32, the flags
written through the table), under ``TRITON_INTERPRET=1`` on CPU: the same flags set, no
other entry of the pool touched (slots past the lengths, other sequences' pages, the
scratch page), at awkward sizes (r not a multiple of the kv heads, G > 1, ragged lengths
that end mid-page)."""

from __future__ import annotations

import math

import pytest
import torch

from lapse.ops.dcp import LOG_FLOOR
from lapse.ops.dcp.paged_drop import dcp_paged_drop


def state(b=3, kh=2, g=2, r=7, s=16, wp=5, lengths=(70, 33, 2), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    part = -(-r // kh)
    pages = b * kh * wp + 1  # the last: scratch
    perm = torch.randperm(pages - 1, generator=gen)
    table = torch.full((b, kh, wp), -1, dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)[:, None].expand(b, kh).contiguous()
    used = 0
    for i in range(b):
        for h in range(kh):
            n = -(-int(lens[i, h]) // s)
            table[i, h, :n] = perm[used : used + n].int()
            used += n
    kint = torch.randn(pages, s, part, generator=gen).to(dtype)
    drop = torch.where(torch.rand(pages, s, g, generator=gen) < 0.3, -LOG_FLOOR, 0.0).float()
    q = torch.randn(b, r, generator=gen).to(dtype)
    return q, kint, drop, table, lens


def z_reference(q, kint, table, lens, beta):
    b, kh, wp = table.shape
    s, part = kint.shape[1:]
    r = q.shape[1]
    z = torch.full((b, wp * s), math.nan, dtype=torch.float64)
    for i in range(b):
        for w in range(int(lens[i, 0])):
            key = torch.cat([kint[table[i, h, w // s], w % s] for h in range(kh)])[:r].double()
            z[i, w] = (q[i].double() @ key) / math.sqrt(r) + beta
    return z


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "shape",
    [dict(), dict(kh=1, g=1, r=64, lengths=(80, 1, 17)), dict(kh=4, g=3, r=10)],
    ids=["k2g2", "k1g1", "k4g3"],
)
def test_kernel_sets_the_flags_the_reference_sets_and_nothing_else(dtype, shape):
    q, kint, drop, table, lens = state(dtype=dtype, **shape)
    beta = 0.8
    want, got = drop.clone(), drop.clone()
    dcp_paged_drop(q, kint, want, table, lens, torch.tensor(beta), backend="torch")
    dcp_paged_drop(q, kint, got, table, lens, torch.tensor(beta), backend="triton")
    z = z_reference(q, kint, table, lens, beta)
    assert (want != drop).any()  # some slots drop
    differ = (got != want).any(-1)  # [P, S]
    if differ.any():  # only a z within rounding of 0 may decide differently
        s = kint.shape[1]
        for p, o in differ.nonzero().tolist():
            i, h, c = (table == p).nonzero()[0].tolist()
            assert abs(z[i, c * s + o]) < 1e-5
    # the newest slot of each sequence is never dropped by its own token
    s = kint.shape[1]
    for i in range(table.shape[0]):
        n = int(lens[i, 0]) - 1
        for h in range(table.shape[1]):
            page = table[i, h, n // s]
            assert torch.equal(got[page, n % s], drop[page, n % s])


def test_bad_inputs():
    q, kint, drop, table, lens = state()
    with pytest.raises(ValueError, match="lengths"):
        dcp_paged_drop(q, kint, drop, table, lens[:, :1], 0.0)
    with pytest.raises(ValueError, match="float32"):
        dcp_paged_drop(q, kint, drop.double(), table, lens, 0.0)
    with pytest.raises(ValueError, match="r ="):
        dcp_paged_drop(torch.randn(3, 99), kint, drop, table, lens, 0.0)
    with pytest.raises(ValueError, match="backend"):
        dcp_paged_drop(q, kint, drop, table, lens, 0.0, backend="naive")


@pytest.mark.gpu
def test_kernel_on_the_gpu_sets_the_reference_flags():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, kint, drop, table, lens = (
        x.cuda()
        for x in state(b=4, kh=8, g=1, r=64, wp=130, lengths=(2000, 1500, 999, 17), dtype=torch.bfloat16)
    )
    want, got = drop.clone(), drop.clone()
    beta = torch.tensor(0.8, device="cuda")
    dcp_paged_drop(q, kint, want, table, lens, beta, backend="torch")
    dcp_paged_drop(q, kint, got, table, lens, beta, backend="triton")
    assert (want != drop).any()
    assert (got != want).any(-1).sum() <= 2  # z within float32 rounding of 0 may decide either way
