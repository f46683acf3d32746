"""The Triton path of forgetting attention against the float64 oracle.

On CPU the kernels run under TRITON_INTERPRET=1 (set before Triton is imported) on small
float32/float16 shapes (the interpreter's bf16 dots are wrong). On a GPU (``-m gpu``)
the same checks run in bf16 at realistic sizes, up to T = 32768, and a T = 131072 check
of the long-context cancellation.

Tolerances (STYLE principle 3): the kernel's relative error against float64 may be at
most 2x (output, lse) / 3x (gradients) the error of the naive PyTorch computation run in
the kernel's dtype, plus a floor. The floor is needed for float32, where the naive
baseline is near 1e-7 and the kernel's different summation order alone gives ~1e-6
(measured: at most 4e-6 on these shapes, 1.5e-5 on the gate gradient, itself a reverse
cumulative sum of many cancelling terms); it is 2e-5, far below any real defect (a
dropped tile or a wrong mask gives errors above 1e-2).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET on CPU

from lapse.ops.forgetting import fa4_bwd, fa4_fwd, forgetting_attention, triton_ops  # noqa: E402
from lapse.ops.forgetting.common import acp_block_start, cumulative_log_gates, validate  # noqa: E402
from lapse.ops.forgetting.pruning import triton_block_start  # noqa: E402

FLOOR = {torch.float32: 2e-5, torch.float16: 2e-4, torch.bfloat16: 1e-3}
# The gate gradient dr_t = sum_{i >= t} dc_i is a suffix sum of O(1) terms that cancel to
# ~0 far from the queries. The kernels take the row sums and the column sums of dS in two
# different kernels (no atomics), so their totals do not cancel bit for bit: in float32
# that leaves ~1e-4 relative on dr (measured 1.2e-4, fast gates, Tq < Tk) while the
# per-position dc itself is as accurate as the naive float32 one (5.3e-6 vs 5.8e-6).
# So dc ("dc" below, the kernel's own output) is held to the 3x rule and dr gets this floor.
FLOOR_DG = {torch.float32: 3e-4, torch.float16: 1e-3, torch.bfloat16: 3e-3}
NAMES = ("o", "lse", "dq", "dk", "dv", "dg", "dc")


def _dc(dr):
    """Per-position gradient wrt c from the gate gradient: dc_t = dr_t - dr_{t+1}."""
    dr = dr.double()
    return dr - torch.cat([dr[:, 1:], torch.zeros_like(dr[:, :1])], dim=1)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    triton_ops.POISON_OUTPUTS = True
    # the Triton kernels themselves: FlashAttention-4's forward and backward, where installed, have
    # their own tests (test_forgetting_fa4.py)
    monkeypatch.setattr(fa4_bwd, "ENABLED", False)
    monkeypatch.setattr(fa4_fwd, "ENABLED", False)
    yield
    triton_ops.POISON_OUTPUTS = False


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _inputs(b, tq, tk, hq, h, d, gate, dtype, device, seed, cu=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, tq, hq, d, generator=g)
    k = torch.randn(b, tk, h, d, generator=g)
    v = torch.randn(b, tk, h, d, generator=g)
    if gate == "mixed":  # some heads local (fast decay), some near 1
        logits = torch.randn(b, tk, hq, generator=g) + torch.linspace(-2, 6, hq)
    elif gate == "fast":
        logits = torch.randn(b, tk, hq, generator=g) - 1.0
    elif gate == "extreme":  # near 0, near 1 and a few -inf
        logits = torch.where(torch.rand(b, tk, hq, generator=g) < 0.5, -20.0, 20.0)
    else:
        raise ValueError(gate)
    lg = F.logsigmoid(logits).float()
    if gate == "extreme":
        lg[:, tk // 3, :] = float("-inf")
        lg[:, -1, 0] = float("-inf")
    do = torch.randn(b, tq, hq, d, generator=g)
    return [x.to(device) for x in (q, k, v, lg, do)]


def _run(q, k, v, lg, do, dtype, backend, acp, cu):
    xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    g = lg.detach().clone().requires_grad_()
    o, lse, st = forgetting_attention(*xs, g, acp=acp, cu_seqlens=cu, return_lse=True,
                                      return_stats=True, backend=backend)
    # lse enters the loss too, so its gradient path is checked
    ((o.double() * do.double()).sum() + 0.1 * lse.double().sum()).backward()
    return [o, lse, xs[0].grad, xs[1].grad, xs[2].grad, g.grad, _dc(g.grad)], st


def _compare(q, k, v, lg, do, dtype, acp=None, cu=None, expect_pruned=None):
    ref, st_ref = _run(q, k, v, lg, do, torch.float64, "naive", acp, cu)
    base, _ = _run(q, k, v, lg, do, dtype, "naive", acp, cu)
    got, st = _run(q, k, v, lg, do, dtype, "triton", acp, cu)
    assert torch.equal(st.block_start.cpu(), st_ref.block_start.cpu())
    if expect_pruned is not None:
        assert (st.pruned_fraction.mean().item() > 0) == expect_pruned
    for name, a, b, r in zip(NAMES, got, base, ref, strict=False):
        assert not torch.isnan(a).any(), f"{name} has NaN (an unwritten tile?)"
        err, err_base = _rel(a, r), _rel(b, r)
        factor = 2.0 if name in ("o", "lse") else 3.0
        floor = FLOOR_DG[dtype] if name == "dg" else FLOOR[dtype]
        assert err <= factor * err_base + floor, (
            f"{name}: kernel error {err:.2e} > {factor} x baseline {err_base:.2e} + floor")



def _check_cpu(case, seed):
    """One CPU_CASES case through the Triton path (interpreter, float32) against the oracle."""
    b, tq, tk, hq, h, d, gate, acp, cu = case
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    q, k, v, lg, do = _inputs(b, tq, tk, hq, h, d, gate, torch.float32, "cpu", seed=seed)
    _compare(q, k, v, lg, do, torch.float32, acp, cu_t, None)


def _check_gpu(case):
    """One GPU_CASES case through the Triton path (bf16) against the oracle."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    b, tq, tk, hq, h, d, gate, acp, cu = case
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    q, k, v, lg, do = _inputs(b, tq, tk, hq, h, d, gate, torch.bfloat16, "cuda", seed=d)
    _compare(q, k, v, lg, do, torch.bfloat16, acp, cu_t, None)

CPU_CASES = [
    # (B, Tq, Tk, HQ, H, D, gate, acp, cu_seqlens)
    (1, 1, 1, 2, 1, 48, "mixed", None, None),
    (2, 63, 63, 4, 2, 64, "mixed", None, None),
    (1, 257, 257, 2, 2, 96, "fast", "auto", None),
    (1, 63, 257, 2, 1, 48, "fast", 1.0, None),
    (1, 1, 257, 2, 2, 64, "mixed", None, None),
    (1, 257, 257, 2, 1, 48, "fast", "auto", [0, 1, 70, 257]),
    (1, 200, 200, 2, 2, 48, "extreme", None, None),
    (1, 200, 200, 2, 2, 48, "extreme", "auto", None),
    # D 96 dense: the D 128 forward's 128 x 128 tiles, 8 warps, tensor descriptors (fwd_config)
    (1, 150, 150, 4, 2, 96, "mixed", None, None),
]


def _id(c):
    b, tq, tk, hq, h, d, gate, acp, cu = c
    return f"B{b}-Tq{tq}-Tk{tk}-HQ{hq}-H{h}-D{d}-{gate}-acp{acp}" + ("-varlen" if cu else "")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", CPU_CASES, ids=[_id(c) for c in CPU_CASES])
def test_triton_matches_naive(case, dtype):
    if torch.cuda.is_available():
        pytest.skip("interpreter shapes; the GPU runs test_triton_gpu")
    b, tq, tk, hq, h, d, gate, acp, cu = case
    if dtype == torch.float16 and (tk > 63 and gate != "extreme" and cu is None and acp is None):
        pytest.skip("float16 on the interpreter: the smaller and the pruned shapes suffice")
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    q, k, v, lg, do = _inputs(b, tq, tk, hq, h, d, gate, dtype, "cpu", seed=tq + tk + d)
    expect = None
    if acp is not None and gate == "fast" and tq > 64:
        expect = True
    _compare(q, k, v, lg, do, dtype, acp, cu_t, expect)


def test_boundary_kernel_matches_reference():
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test")
    q, k, v, lg, _ = _inputs(2, 300, 300, 3, 3, 16, "fast", torch.float32, "cpu", seed=3)
    from lapse.ops.forgetting.common import acp_delta
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    for cu in (None, torch.tensor([0, 64, 65, 300], dtype=torch.int32)):
        qq, kk, vv, gg = (x[:1] for x in (q, k, v, lg)) if cu is not None else (q, k, v, lg)
        p = validate(qq, kk, vv, gg, None, cu, "triton")
        delta = acp_delta(0.5, 1e-3, qq, kk, p)
        ref = acp_block_start(cumulative_log_gates(gg, cu), delta, p)
        c_hi, c_lo = triton_gate_cumsum(gg, p)
        got = triton_block_start(c_hi, c_lo, delta, p)
        assert ref.sum() > 0
        assert torch.equal(got, ref)


@pytest.mark.parametrize("case", [(2, 2100, 2100, 3, None), (1, 700, 700, 40, [0, 1, 300, 300, 700]),
                                  (2, 5, 5, 1, None), (1, 50000, 50000, 2, None), (2, 300, 1500, 3, None)],
                         ids=["chunks", "two-head-blocks-varlen-with-empty", "short", "long", "tq<tk"])
def test_gate_scans_match_float64(case):
    """Both gate scans of gate_scan.py (chunk sums, then each chunk continues from the
    others') against the float64 references: the cumulative log gate, whose ``hi + lo``
    must give it back to float64 rounding, and the gradient's reverse cumulative sum of
    ``rowsum - colsum`` (Tq < Tk through the row sums' offset). Several chunks, more heads
    than one program holds, packed sequences with an empty one, -inf and floored gates."""
    from lapse.ops.forgetting.common import LOG_GATE_FLOOR, gate_grad_from_dc
    from lapse.ops.forgetting.gate_scan import gate_cumsum, gate_grad

    b, tq, tk, hq, cu = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(tk + hq)
    lg = F.logsigmoid(4 * torch.randn(b, tk, hq, generator=g)).to(dev)
    lg[0, tk // 3] = float("-inf")
    lg[-1, tk // 2, 0] = 2 * LOG_GATE_FLOOR
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    x = torch.zeros(b, tq, hq, 8, device=dev)
    kx = torch.zeros(b, tk, hq, 8, device=dev)
    p = validate(x, kx, kx, lg, None, cu_t, "triton")
    c_hi, c_lo = gate_cumsum(lg, p, LOG_GATE_FLOOR)
    want = cumulative_log_gates(lg, cu_t).transpose(1, 2)  # [B, HQ, T] float64
    got = c_hi.double() + c_lo.double()
    assert ((got - want).abs() <= 1e-12 * want.abs().clamp_min(1.0)).all()
    dcc = torch.randn(b, hq, tk, generator=g).to(dev)
    dcr = torch.full_like(dcc, float("nan"))
    dcr[..., :tq] = torch.randn(b, hq, tq, generator=g).to(dev)
    dc = -dcc.double()
    dc[..., tk - tq:] += dcr[..., :tq].double()
    want = gate_grad_from_dc(dc.transpose(1, 2), lg.double(), cu_t).float()
    got = gate_grad(dcc, dcr, lg, p, LOG_GATE_FLOOR)
    assert got.shape == lg.shape and not got.isnan().any()
    assert ((got - want).abs() <= 1e-6 * want.abs().clamp_min(1.0)).all()


@pytest.mark.parametrize("case", [(2, 63, 63, 4, 2, 64, None), (1, 40, 257, 2, 1, 48, None),
                                  (1, 257, 257, 4, 2, 96, [0, 1, 70, 70, 257])],
                         ids=["gqa", "tq<tk", "varlen-with-empty"])
def test_fused_acp_delta_equals_the_unfused_one(case):
    """``triton_acp_delta`` (three launches) gives ``acp_delta("auto", ...)`` with the
    Triton bound bit for bit, packed sequences (an empty one too) and Tq < Tk included.
    Runs on a GPU too (``-k fused_acp``): there ``tl.log`` is libdevice's, ``torch.log``
    ATen's, and a one-ulp difference would move ACP's boundaries at the margin."""
    from lapse.ops.forgetting.common import acp_delta
    from lapse.ops.forgetting.pruning import triton_acp_bound, triton_acp_delta

    b, tq, tk, hq, h, d, cu = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    q, k, v, lg, _ = _inputs(b, tq, tk, hq, h, d, "fast", torch.float32, dev, seed=d)
    q = q * torch.linspace(0.5, 3.0, tq, device=dev)[None, :, None, None]  # norms that differ along time
    p = validate(q, k, v, lg, None, cu_t, "triton")
    for eps in (1e-3, math.exp(-10)):
        want = acp_delta("auto", eps, q, k, p, triton_acp_bound)
        got = triton_acp_delta(q, k, p, eps)
        assert got.dtype == torch.float64 and torch.equal(got, want)


@pytest.mark.parametrize("case", [(2, 300, 300, 4, 2, 64, None), (1, 200, 457, 2, 1, 48, None),
                                  (1, 457, 457, 4, 2, 96, [0, 1, 200, 200, 457])],
                         ids=["gqa", "tq<tk", "varlen-with-empty"])
@pytest.mark.parametrize("looped", [False, True], ids=["one-read", "looped"])
def test_folded_acp_search_equals_delta_then_search(case, looped, monkeypatch):
    """``triton_acp_block_start(acp="auto")`` (each search program computes its own delta
    from the norms' tile maxima) gives the block starts of ``triton_block_start`` after
    ``acp_delta`` (delta in torch from the bound ``U`` per query head), bit for bit: GQA,
    Tq < Tk, packed sequences with an empty one, and the maxima read in one vector or in a
    loop (16-row tiles, read 16 at a time). Slow gates and norms that differ by head (q and
    k alike) make the boundaries follow delta closely: a wrong head's norms or a tile left
    unread move them."""
    from lapse.ops.forgetting import pruning
    from lapse.ops.forgetting.common import acp_delta
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    if looped:
        monkeypatch.setattr(pruning, "NORM_TILE", 16 * 64)
        monkeypatch.setattr(pruning, "PARTS_BLOCK", 16)
    b, tq, tk, hq, h, d, cu = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    q, k, v, lg, _ = _inputs(b, tq, tk, hq, h, d, "fast", torch.float32, dev, seed=d + 1)
    q = q * torch.where(torch.arange(tq, device=dev) < tq - 20, 0.1, 0.3)[None, :, None, None]  # max last
    q = q * torch.linspace(0.5, 2.0, hq, device=dev)[None, None, :, None]
    k = k * torch.linspace(1.0, 0.2, tk, device=dev)[None, :, None, None]  # the largest first
    k = k * torch.linspace(1.0, 2.0, h, device=dev)[None, None, :, None]
    g = torch.Generator(device="cpu").manual_seed(d)
    lg = F.logsigmoid(torch.randn(lg.shape, generator=g) + 1.0).float().to(dev)  # about -0.35 a step
    p = validate(q, k, v, lg, None, cu_t, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    for eps in (1e-3, math.exp(-10)):
        delta = acp_delta("auto", eps, q, k, p, pruning.triton_acp_bound)  # delta in torch, from U
        want = pruning.triton_block_start(c_hi, c_lo, delta, p)
        got = pruning.triton_acp_block_start("auto", eps, q, k, c_hi, c_lo, p)
        assert torch.equal(got, want)
        assert int(want.max()) > 0 and want.unique().numel() > 2  # boundaries that move
    with pytest.raises(ValueError, match="acp_eps"):
        pruning.triton_acp_block_start("auto", 1.5, q, k, c_hi, c_lo, p)


@pytest.mark.parametrize("gate", ["mixed", "fast", "extreme", "tiny"])
def test_staircase_never_steps_down(gate):
    """The boundary search's starts never decrease along a sequence's query blocks, in
    float32 gates of every kind (steps of about -1e-7 included, where the hi + lo sums round):
    ``ROUTE`` takes a head whose last query block keeps every key as one that ACP prunes
    nowhere. Tq < Tk, and packed sequences with an empty one."""
    from lapse.ops.forgetting import pruning
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    steps = 0  # heads whose staircase steps at all: the check has something to hold
    for b, tq, tk, cu in [(2, 1000, 1000, None), (1, 700, 1000, None), (1, 1000, 1000, [0, 0, 300, 1000])]:
        hq = 6
        g = torch.Generator(device="cpu").manual_seed(tq + tk)
        if gate == "tiny":  # steps near float32's resolution of c: its rounding decides
            lg = -torch.rand(b, tk, hq, generator=g) * 1e-7 * torch.logspace(0, 6, hq)
        else:
            lg = _inputs(b, 1, tk, hq, 1, 8, gate, torch.float32, "cpu", seed=tk)[3]
        q, k = torch.zeros(b, tq, hq, 8), torch.zeros(b, tk, hq, 8)
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
        p = validate(q.to(dev), k.to(dev), k.to(dev), lg.to(dev), None, cu_t, "triton")
        c_hi, c_lo = triton_gate_cumsum(lg.to(dev), p)
        for delta in (-1e-6, -0.5, -20.0):
            bs = pruning.triton_block_start(c_hi, c_lo, torch.full((p.batch, hq), delta, dtype=torch.float64,
                                                                   device=dev), p).cpu()
            for i, n in enumerate(p.seqlens or [tq] * b):
                blocks = bs[i, :, : -(-n // 64)]
                assert (blocks[:, 1:] >= blocks[:, :-1]).all(), (gate, delta, i)
                if n:  # (the empty packed sequence has no blocks)
                    steps += int((blocks.amax(-1) > blocks.amin(-1)).sum())
    assert steps > 10


@pytest.mark.parametrize("shape", [(2, 3, 200, 200, None), (1, 2, 40, 300, None),
                                   (1, 4, 9000, 9000, [0, 0, 64, 65, 4000, 9000])],
                         ids=["square", "tq<tk", "varlen-with-empty"])
def test_block_end_kernel_equals_searchsorted(shape):
    """``block_end_from_start`` (one launch) counts what ``block_end_reference``'s
    ``searchsorted`` counts, for random monotone staircases: several chunks of key blocks
    (N > 128) and of query blocks (M > 32), query blocks past a sequence's end left out
    (packed, with an empty sequence), Tq < Tk."""
    from lapse.ops.forgetting.pruning import block_end_from_start, block_end_reference

    b, hq, tq, tk, cu = shape
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(tq + tk)
    mb, off = -(-tq // 64), (tk - tq) // 64
    # a staircase: block m keeps key blocks from bs[m] on, bs non-decreasing and <= its diagonal
    steps = torch.randint(0, 3, (b if cu is None else len(cu) - 1, hq, mb), generator=g)
    diag = torch.arange(mb) + off
    bs = torch.minimum(steps.cumsum(-1), diag).to(torch.int32).to(dev)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    x = torch.zeros(1 if cu else b, tq, hq, 8, device=dev)
    kx = torch.zeros(1 if cu else b, tk, hq, 8, device=dev)
    lg = torch.zeros(1 if cu else b, tk, hq, device=dev)
    p = validate(x, kx, kx, lg, None, cu_t, "triton")
    if cu is not None:  # the bench's layout: [sequences, heads, blocks of the longest]
        bs = bs[..., : -(-p.tq // 64)]
    got, want = block_end_from_start(bs, p), block_end_reference(bs, p)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert int(want.max()) > 0


# ---------------------------------------------------------------- GPU ----------------

GPU_CASES = [
    (2, 1024, 1024, 8, 8, 64, "mixed", None, None),
    (2, 1024, 1024, 8, 8, 64, "fast", "auto", None),
    (1, 4096, 4096, 6, 2, 96, "mixed", "auto", None),
    (1, 4000, 4096, 4, 4, 128, "mixed", None, None),
    (1, 2048, 2048, 4, 4, 128, "fast", "auto", None),
    (1, 2048, 2048, 2, 1, 256, "fast", "auto", None),
    (1, 4096, 4096, 4, 2, 64, "mixed", "auto", [0, 1, 1000, 1001, 3000, 4096]),
    (1, 2048, 2048, 4, 4, 48, "extreme", "auto", None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_id(c) for c in GPU_CASES])
def test_triton_gpu(case):
    _check_gpu(case)


def _last_rows_error(t, hq, d, rate, rows, acp):
    """Forward error of the last `rows` queries at length t against float64, and the same
    for naive float32 (whose float32 cumulative sum loses the bias to cancellation)."""
    g = torch.Generator(device="cuda").manual_seed(t)
    q = torch.randn(1, t, hq, d, device="cuda", generator=g)
    k = torch.randn(1, t, hq, d, device="cuda", generator=g)
    v = torch.randn(1, t, hq, d, device="cuda", generator=g)
    logits = -math.log(math.expm1(rate)) + 0.5 * torch.randn(1, t, hq, device="cuda", generator=g)
    lg = F.logsigmoid(logits).float()
    o = forgetting_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lg, acp=acp)
    ref = forgetting_attention(q[:, -rows:].double(), k.double(), v.double(), lg, backend="naive")
    f32 = forgetting_attention(q[:, -rows:], k, v, lg, backend="naive")
    base = forgetting_attention(q[:, -rows:].bfloat16(), k.bfloat16(), v.bfloat16(), lg,
                                backend="naive")
    return _rel(o[:, -rows:], ref), _rel(f32, ref), _rel(base, ref), -lg.double().sum().item()


@pytest.mark.gpu
@pytest.mark.parametrize("t", [32768, 131072])
def test_long_context_gpu(t):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    err, err_f32, err_base, total = _last_rows_error(t, 2, 64, 0.5, 256, "auto")
    print(f"T={t}: |c_T| = {total:.0f}; kernel bf16 rel err {err:.2e}, naive float32 "
          f"{err_f32:.2e}, naive bf16 {err_base:.2e}")
    assert err <= 2 * err_base + FLOOR[torch.bfloat16]


def test_acp_bound_kernel_matches_reference():
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test")
    from lapse.ops.forgetting.common import acp_bound_from_data
    from lapse.ops.forgetting.pruning import triton_acp_bound

    q, k, v, lg, _ = _inputs(2, 77, 77, 6, 2, 48, "fast", torch.float32, "cpu", seed=5)
    cu = torch.tensor([0, 1, 40, 40, 77], dtype=torch.int32)
    # Tq < Tk: the queries' largest norm among the last rows (the keys' tiles reach further)
    q_short = q[:, 60:].clone()
    q_short[:, -1] *= 5
    for args, c in (((q, k, v, lg), None), ((q[:1], k[:1], v[:1], lg[:1]), cu),
                    ((q_short, k, v, lg), None)):
        p = validate(*args, 0.3, c, "triton")
        torch.testing.assert_close(triton_acp_bound(args[0], args[1], p),
                                   acp_bound_from_data(args[0], args[1], p), rtol=1e-6, atol=0)


TMA_CASES = [c for c in CPU_CASES if c[5] in (48, 64) or (c[5] == 96 and c[7] is None)]


@pytest.mark.parametrize("case", TMA_CASES, ids=[_id(c) for c in TMA_CASES])
def test_forward_through_tensor_descriptors_equals_pointer_loads(case):
    if torch.cuda.is_available():
        pytest.skip("interpreter run; the GPU runs test_forward_through_tensor_descriptors_gpu")
    _check_descriptors(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", TMA_CASES, ids=[_id(c) for c in TMA_CASES])
def test_forward_through_tensor_descriptors_gpu(case):
    """The same on a GPU, in bf16 (at one query and one key ptxas crashes on the descriptor
    kernel: :func:`triton_fwd.tma_mode` takes pointer loads there)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_descriptors(case)


def _check_backward_descriptors(case):
    """The backward's ``TMA="host"`` (the dK/dV kernel's queries and output gradients, the
    dQ kernel's keys and values, through descriptors over ``[B * T, H * D]``) computes what
    the pointer loads compute, bit for bit: rows and keys past a sequence are the next one's,
    and their weights are exactly 0 (GQA, Tq < Tk, packed sequences, ACP; D 64, where the
    descriptors serve, and D 48 / 96, where the launch falls back to pointer loads)."""
    from lapse.ops.forgetting import triton_bwd, triton_fwd
    from lapse.ops.forgetting.pruning import block_end_from_start
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    b, tq, tk, hq, h, d, gate, acp, cu = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    q, k, v, lg, do = (x.to(dtype) if x.is_floating_point() and i != 3 else x
                       for i, x in enumerate(_inputs(b, tq, tk, hq, h, d, gate, dtype, dev, seed=2 * d)))
    p = validate(q, k, v, lg, None, cu_t, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    bs = be = None
    if acp is not None:
        from lapse.ops.forgetting.common import acp_delta

        bs = triton_block_start(c_hi, c_lo, acp_delta(acp, 1e-3, q, k, p), p)
        be = block_end_from_start(bs, p)
    o, lse2 = torch.empty_like(q), torch.empty_like(c_hi)
    triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, cu_t, p, o, lse2)
    assert triton_bwd._host_tma(q, k, v, do, p) == (d == 64)
    kv, qc = triton_bwd.bwd_config(d, hq // h, bs is not None)
    outs = []
    for tma in (False, "host"):
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)] + \
            [torch.full_like(lse2, float("nan")) for _ in range(2)]
        triton_bwd.launch_bwd(q, k, v, o, do, lse2, None, c_hi, c_lo, bs, be, cu_t, p, *grads,
                              (dict(kv, TMA=tma), dict(qc, TMA=tma)))
        outs.append(grads)
    for i, (a, c) in enumerate(zip(*outs, strict=True)):
        if i < 3:  # dq, dk, dv: every element written
            assert not a.isnan().any()
        # dcc, dcr: positions past Tq or Tk stay poisoned on both sides
        torch.testing.assert_close(a, c, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", TMA_CASES, ids=[_id(c) for c in TMA_CASES])
def test_backward_through_tensor_descriptors_equals_pointer_loads(case):
    if torch.cuda.is_available():
        pytest.skip("interpreter run; the GPU runs test_backward_through_tensor_descriptors_gpu")
    _check_backward_descriptors(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", TMA_CASES, ids=[_id(c) for c in TMA_CASES])
def test_backward_through_tensor_descriptors_gpu(case):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_backward_descriptors(case)


def test_one_query_and_one_key_take_pointer_loads():
    """``tma_mode``: descriptors where asked and served, pointer loads for one query and one
    key whatever the config asks (ptxas of Triton 3.6 crashes compiling that kernel for
    sm_90), host descriptors only for contiguous inputs with D a power of two."""
    from lapse.ops.forgetting import triton_fwd

    def mode(tma, tq, tk, d=64, contiguous=True):
        q, k, v, lg, _ = _inputs(1, tq, tk, 2, 1, d, "fast", torch.float32, "cpu", seed=1)
        if not contiguous:
            q = torch.randn(1, 2, tq, d).transpose(1, 2)
        return triton_fwd.tma_mode(tma, q, k, v, validate(q, k, v, lg, None, None, "triton"))

    assert [mode(t, 1, 1) for t in (False, True, "host")] == [0, 0, 0]
    assert [mode(t, 1, 5) for t in (False, True, "host")] == [0, 1, 2]
    assert [mode(t, 7, 7) for t in (False, True, "host")] == [0, 1, 2]
    assert mode("host", 7, 7, d=48) == 1 and mode("host", 7, 7, contiguous=False) == 1


def _check_descriptors(case):
    """``TMA=True`` (keys and values through tensor descriptors made by each program) and
    ``TMA="host"`` (queries, keys and values through descriptors made on the host over
    ``[B * T, H * D]``, D 64 here: rows past a sequence are the next one's, masked) compute
    what the pointer loads compute: the same tiles, rows past each sequence and columns
    past D read as 0 by the descriptor, outputs poisoned first. Equal bit for bit: the same products
    in the same order, only the loads differ."""
    from lapse.ops.forgetting import triton_fwd
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    b, tq, tk, hq, h, d, gate, acp, cu = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=dev)
    q, k, v, lg, _ = (x.to(dtype) if x.is_floating_point() and i < 3 else x
                      for i, x in enumerate(_inputs(b, tq, tk, hq, h, d, gate, dtype, dev, seed=d)))
    p = validate(q, k, v, lg, None, cu_t, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    bs = None
    if acp is not None:
        from lapse.ops.forgetting.common import acp_delta

        bs = triton_block_start(c_hi, c_lo, acp_delta(acp, 1e-3, q, k, p), p)
    assert triton_fwd.tma_ready(k, v)
    outs = []
    assert triton_fwd._host_tma_ready(q, k, v, p) == (d == 64)
    for tma in (False, True, "host"):
        o, lse = torch.full_like(q, float("nan")), torch.full_like(c_hi, float("nan"))
        cfg = dict(triton_fwd.fwd_config(d, q.element_size()), TMA=tma)
        triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, cu_t, p, o, lse, cfg)
        outs.append((o, lse[..., :tq] if cu_t is None else lse))
    (o0, l0), *rest = outs
    for o1, l1 in rest:
        assert not o1.isnan().any() and not l1.isnan().any()
        assert torch.equal(o0, o1) and torch.equal(l0, l1)


def _with_options(monkeypatch, fwd=None, kv=None):
    """Makes the tables add ``fwd`` to the forward's config and ``kv`` to the dK/dV kernel's."""
    from lapse.ops.forgetting import triton_bwd, triton_fwd

    plain_fwd, plain_bwd = triton_fwd.fwd_config, triton_bwd.bwd_config

    def bwd(*args, **kwargs):
        cfg_kv, cfg_q = plain_bwd(*args, **kwargs)
        return dict(cfg_kv, **(kv or {})), cfg_q

    monkeypatch.setattr(triton_fwd, "fwd_config", lambda *a, **k: dict(plain_fwd(*a, **k), **(fwd or {})))
    monkeypatch.setattr(triton_bwd, "bwd_config", bwd)


def _fuse_dq(monkeypatch, mode=True):
    """Makes the Triton backward take one kernel with dQ through atomics (``FUSE_DQ``:
    ``True`` a thread an element, ``"tma"`` a tile at a time by the tensor-memory engine)."""
    _with_options(monkeypatch, kv=dict(FUSE_DQ=mode))


@pytest.mark.parametrize("case", CPU_CASES, ids=[_id(c) for c in CPU_CASES])
def test_backward_with_dq_through_atomics_matches_naive(case, monkeypatch):
    """The fused backward (``FUSE_DQ``: the dK/dV kernel adds dQ and the row sums of dS
    with atomics) held to the float64 oracle like the two-kernel one: GQA, Tq < Tk, ACP,
    packed sequences, -inf gates, outputs poisoned first (the float32 accumulators are
    zeroed by the launch, so an unvisited row would show as 0 against the oracle)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter shapes; the GPU runs test_backward_with_dq_through_atomics_gpu")
    _fuse_dq(monkeypatch)
    _check_cpu(case, seed=case[1] + case[2] + case[5])


# and two batch rows with grouped heads and ACP: T 130 (a partial key block; rows of 520
# bytes, pointer stores only) and T 200 (the descriptors' stores)
KEPT_DS_CASES = CPU_CASES + [(2, 130, 130, 4, 2, 96, "fast", "auto", None),
                             (2, 200, 200, 4, 2, 128, "mixed", 1.0, None)]


@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("free_gib", [70, 20], ids=["much-free", "little-free"])
def test_kept_ds_budget(free_gib, capturing, monkeypatch):
    """The kept dS's budget on an 80 GiB GPU: a quarter of it with most of it free (the bench's
    D 128, T 16k dS, 12.9 GB, fits), half of what is free (with the allocator's cache) when
    that is less, and an eighth while a CUDA graph is captured, whatever is free."""
    from lapse.ops.forgetting import triton_bwd

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * gib))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free_gib * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 4 * gib)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    want = 10 * gib if capturing else min(20 * gib, (free_gib + 2) * gib // 2)
    assert triton_bwd._ds_budget(torch.device("cuda")) == want
    p = SimpleNamespace(tk=16384, tq=16384, batch=2, hq=24, cu_seqlens=None)
    q = SimpleNamespace(device=torch.device("cuda"), element_size=lambda: 2)
    mode = triton_bwd._fuse_mode("ds", q, p, {"BN": 64, "BM": 64})  # 4: dS kept; 0: the two kernels
    assert mode == (4 if free_gib == 70 and not capturing else 0)


@pytest.mark.parametrize("stores", ["descriptors", "pointers"])
@pytest.mark.parametrize("case", KEPT_DS_CASES, ids=[_id(c) for c in KEPT_DS_CASES])
def test_backward_with_dq_from_kept_ds_matches_naive(case, stores, monkeypatch):
    """``FUSE_DQ="ds"``: the dK/dV kernel keeps dS (a staircase of key blocks), and one
    product a tile makes dQ from it, with the row sums of dS. Held to the float64 oracle
    like the two-kernel backward, with the outputs and the scratch buffer NaN-poisoned (a
    tile the dQ kernel reads before the dK/dV kernel wrote it shows). Cases with
    Tq < Tk, packed sequences or key tiles other than 64 (grouped heads at D <= 64) take the
    two kernels: checked that they do, and that the others (six) take the kept dS. dS is
    stored through descriptors (``DS_TMA``, where a row of Tq elements is 16-byte aligned: T
    200 here) or by pointers."""
    from lapse.ops.forgetting import triton_bwd

    if torch.cuda.is_available():
        pytest.skip("interpreter shapes; the GPU runs test_backward_with_dq_from_kept_ds_gpu")
    _with_options(monkeypatch, kv=dict(FUSE_DQ="ds", DS_TMA=stores == "descriptors"))
    b, tq, tk, hq, h, d, gate, acp, cu = case
    kv, _ = triton_bwd.bwd_config(d, hq // h, acp is not None)
    p = SimpleNamespace(cu_seqlens=cu, tq=tq, tk=tk, batch=b, hq=hq)
    serves = triton_bwd._fuse_mode("ds", torch.zeros(1), p, kv)
    assert serves == (4 if cu is None and tq == tk and kv["BN"] == 64 else 0)
    assert triton_bwd._fuse_mode("ds", torch.zeros(1), p, dict(kv, DS_MAX_BYTES=1)) == 0  # over budget
    _check_cpu(case, seed=case[1] + case[2] + case[5])


# a bound (0.5) below the data's largest logit (queries scaled by 4 in the test) and a steady
# decay: the staircase steps inside 128-row tiles, so their edge loop runs (checked)
LONG_ACP_CASES = [
    (1, 257, 257, 4, 2, 128, "mixed", 0.5, None),
    (1, 300, 300, 4, 2, 128, "mixed", 0.5, [0, 1, 100, 300]),
    (1, 200, 257, 4, 1, 128, "mixed", 0.5, None),
    (1, 257, 257, 2, 1, 128, "fast", "auto", None),
]


@pytest.mark.parametrize("case", LONG_ACP_CASES, ids=[_id(c) for c in LONG_ACP_CASES])
def test_long_acp_tiles_match_naive(case, monkeypatch):
    """D 128 with ACP from ``LONG_ACP_KEYS`` keys on: 128-row tiles over 64-key ACP blocks
    (each tile's rows start at different keys: the edge loop runs), 8 warps, host
    descriptors (rows past a packed sequence are the next one's), against the float64
    oracle at interpreter sizes. The table gives it to 16-bit inputs: here float32 takes it
    by the config (without ``ROW_BIAS``, which float32 drops); the GPU test runs it whole,
    in bf16 with the threshold at 0."""
    from lapse.ops.forgetting import triton_fwd

    if torch.cuda.is_available():
        pytest.skip("interpreter shapes; the GPU runs test_long_acp_tiles_gpu")
    long = triton_fwd.fwd_config(128, 2, True, triton_fwd.LONG_ACP_KEYS)
    assert (long["BM"], long["TMA"]) == (128, "host")
    assert triton_fwd.fwd_config(128, 2, True, triton_fwd.LONG_ACP_KEYS - 1)["BM"] == 64
    _with_options(monkeypatch, fwd=long)  # the table keeps it for 16-bit inputs; float32 here
    b, tq, tk, hq, h, d, gate, acp, cu = case
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    q, k, v, lg, do = _inputs(b, tq, tk, hq, h, d, gate, torch.float32, "cpu", seed=tq + tk)
    if gate == "mixed":  # one steady decay (-0.25 a step): the staircase steps inside tiles
        lg = torch.full_like(lg, -0.25)
    if acp == 0.5 and cu is None:
        starts = forgetting_attention(4 * q, k, v, lg, acp=acp, backend="torch", return_stats=True)[1]
        halves = starts.block_start[..., : starts.block_start.shape[-1] // 2 * 2]
        assert (halves[..., 0::2] != halves[..., 1::2]).any()  # a tile whose halves start apart
    _compare(4 * q, k, v, lg, do, torch.float32, acp, cu_t, None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_id(c) for c in GPU_CASES])
def test_long_acp_tiles_gpu(case, monkeypatch):
    from lapse.ops.forgetting import triton_fwd

    if case[7] is None or case[5] != 128:
        pytest.skip("D 128's ACP table only")
    monkeypatch.setattr(triton_fwd, "LONG_ACP_KEYS", 0)
    _check_gpu(case)


# Both of the routed launches have programs to run (checked): with "auto", the "mixed" gates'
# slow heads keep every key and the fast ones prune; with a bound of 0.5 under queries scaled
# by 4 (as LONG_ACP_CASES) and the first third of the keys by 8, half the heads decay steadily
# (-0.25 a step) and half barely (-1e-3): the bound is far below the logits, so the keys ACP
# prunes carry weight (35-46% of the output's norm) and a pruned head run with the dense tiles
# fails the comparison. With two batch rows the first half of the heads decays (each key head's
# query heads alike), with one every second head (a key head's query heads differ: its dK/dV
# takes the ACP launch, one of its dQ the dense one)
ROUTE_CASES = [
    (2, 256, 256, 4, 2, 64, "mixed", 0.5, None),
    (1, 300, 300, 4, 2, 128, "mixed", 0.5, [0, 1, 260, 300]),
    (1, 200, 257, 4, 1, 128, "mixed", 0.5, None),
    (1, 257, 257, 4, 2, 64, "mixed", "auto", None),
]


def _route_small_calls(monkeypatch):
    """``ROUTE`` at the tests' sizes (the launch takes it from ``ROUTE_MIN_ROWS`` query rows)."""
    from lapse.ops.forgetting import triton_fwd

    monkeypatch.setattr(triton_fwd, "ROUTE_MIN_ROWS", 0)


@pytest.mark.parametrize("one_loop", [False, True], ids=["loops", "one_loop"])
@pytest.mark.parametrize("case", ROUTE_CASES, ids=[_id(c) for c in ROUTE_CASES])
def test_routed_forward_matches_naive(case, one_loop, monkeypatch):
    """``ROUTE``: the (sequence, head)s that ACP prunes nowhere run in a launch with the dense
    table's tiles, the others in a second with the ACP table's; each program of either launch
    not its own returns at once. In the backward the dK/dV kernel routes by key head (dense
    where all its query heads are), the dQ kernel by query head. Against the float64 oracle,
    outputs poisoned (a program neither launch runs leaves NaN). ``ONE_LOOP``: every kept key
    in one loop, each tile masked, instead of the diagonal, edge and interior loops."""
    if torch.cuda.is_available():
        pytest.skip("interpreter shapes; the GPU runs test_routed_forward_gpu")
    _route_small_calls(monkeypatch)
    _with_options(monkeypatch, fwd=dict(ROUTE=True, ONE_LOOP=one_loop), kv=dict(ROUTE=True))
    b, tq, tk, hq, h, d, gate, acp, cu = case
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    q, k, v, lg, do = _inputs(b, tq, tk, hq, h, d, gate, torch.float32, "cpu", seed=tq + tk)
    if acp == 0.5:
        q = 4 * q
        k[:, : tk // 3] *= 8
        decays = torch.arange(hq) < hq // 2 if b == 2 else torch.arange(hq) % 2 == 1
        lg = torch.where(decays, -0.25, -1e-3).expand_as(lg).contiguous()
    starts = forgetting_attention(q, k, v, lg, acp=acp, cu_seqlens=cu_t, backend="torch",
                                  return_stats=True)[1].block_start
    unpruned = starts.amax(-1) == 0
    assert unpruned.any() and not unpruned.all()
    _compare(q, k, v, lg, do, torch.float32, acp, cu_t, None)


def test_d64_tables_by_length():
    """At D 64 the 16-bit tables run four programs a multiprocessor (64-row tiles, 128 registers,
    2 stages) where that was measured faster (``triton_fwd.fwd_config``): the ACP
    forward at every length, the dense one below ``SHORT_DENSE_KEYS`` keys. float32 keeps its
    tiles."""
    from lapse.ops.forgetting import triton_fwd

    short = triton_fwd.SHORT_DENSE_KEYS
    four = dict(BM=64, num_stages=2, maxnreg=128)
    pick = lambda cfg: {k: cfg.get(k) for k in four}  # noqa: E731
    assert pick(triton_fwd.fwd_config(64, 2, False, short - 1)) == four
    assert pick(triton_fwd.fwd_config(64, 2, False, short)) == dict(BM=128, num_stages=3, maxnreg=None)
    assert pick(triton_fwd.fwd_config(64, 4, False, 1024))["BM"] == 128  # float32
    for tk in (1024, short, 2 * short):
        assert pick(triton_fwd.fwd_config(64, 2, True, tk)) == four
        assert triton_fwd.fwd_config(64, 2, True, tk)["LOOPS"] == 1  # empty loops not entered
    assert triton_fwd.fwd_config(64, 4, True, 1024).get("maxnreg") is None


LONG_DENSE_CASES = [
    (2, 200, 200, 4, 2, 64, "mixed", None, None),
    (1, 300, 300, 4, 4, 64, "mixed", None, [0, 1, 100, 300]),
    (1, 130, 257, 4, 1, 64, "extreme", None, None),
]


@pytest.mark.parametrize("case", LONG_DENSE_CASES, ids=[_id(c) for c in LONG_DENSE_CASES])
def test_long_dense_tiles_match_naive(case, monkeypatch):
    """The D 64 dense forward's 128-row tiles, which the table gives 16-bit inputs from
    ``SHORT_DENSE_KEYS`` keys on, in float16 at interpreter sizes (the threshold at 0), against
    the float64 oracle: the shorter lengths of the other tests take the 64-row tiles."""
    from lapse.ops.forgetting import triton_fwd

    if torch.cuda.is_available():
        pytest.skip("interpreter shapes; the GPU runs test_long_dense_tiles_gpu")
    monkeypatch.setattr(triton_fwd, "SHORT_DENSE_KEYS", 0)
    assert triton_fwd.fwd_config(64, 2, False, 200)["BM"] == 128
    b, tq, tk, hq, h, d, gate, acp, cu = case
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    q, k, v, lg, do = _inputs(b, tq, tk, hq, h, d, gate, torch.float16, "cpu", seed=tq + tk)
    _compare(q, k, v, lg, do, torch.float16, acp, cu_t, None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_id(c) for c in GPU_CASES])
def test_long_dense_tiles_gpu(case, monkeypatch):
    from lapse.ops.forgetting import triton_fwd

    if case[7] is not None or case[5] > 64:
        pytest.skip("D 64's dense table only")
    monkeypatch.setattr(triton_fwd, "SHORT_DENSE_KEYS", 0)
    _check_gpu(case)


def test_route_where_the_tables_take_it():
    """The tables route 16-bit ACP at D 128 in the forward, at D 64 from ``ROUTE_D64_KEYS``
    keys on, and the backward at D 128 from ``LONG_ACP_KEYS`` keys on without grouped heads:
    where it was measured faster (``fwd_config``, ``bwd_config``)."""
    from lapse.ops.forgetting import triton_bwd, triton_fwd

    long, d64 = triton_fwd.LONG_ACP_KEYS, triton_fwd.ROUTE_D64_KEYS
    assert triton_fwd.fwd_config(128, 2, True, 4096).get("ROUTE")
    assert triton_fwd.fwd_config(128, 2, True, long).get("ROUTE")
    assert triton_fwd.fwd_config(64, 2, True, d64).get("ROUTE")
    assert not triton_fwd.fwd_config(64, 2, True, d64 - 1).get("ROUTE")
    assert not triton_fwd.fwd_config(128, 4, True, long).get("ROUTE")  # float32
    assert not triton_fwd.fwd_config(128, 2, False, long).get("ROUTE")
    assert triton_bwd.bwd_config(128, 1, True, long)[0].get("ROUTE")
    assert not triton_bwd.bwd_config(128, 1, True, long - 1)[0].get("ROUTE")
    assert not triton_bwd.bwd_config(128, 4, True, long)[0].get("ROUTE")
    assert not triton_bwd.bwd_config(64, 1, True, 4 * long)[0].get("ROUTE")
    # with ACP every backward kernel at D 64 and 128 skips its empty loops (LOOPS=1); dense not
    for d in (64, 128):
        assert all(cfg.get("LOOPS") == 1 for cfg in triton_bwd.bwd_config(d, 1, True, long))
        assert not any(cfg.get("LOOPS") for cfg in triton_bwd.bwd_config(d, 1, False, long))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_id(c) for c in GPU_CASES])
@pytest.mark.parametrize("one_loop", [False, True], ids=["loops", "one_loop"])
def test_routed_forward_gpu(case, one_loop, monkeypatch):
    if case[7] is None and not one_loop:
        pytest.skip("ROUTE serves ACP only")
    _route_small_calls(monkeypatch)
    _with_options(monkeypatch, fwd=dict(ROUTE=True, ONE_LOOP=one_loop), kv=dict(ROUTE=True))
    _check_gpu(case)


@pytest.mark.parametrize("case", CPU_CASES, ids=[_id(c) for c in CPU_CASES])
def test_one_loop_forward_matches_naive(case, monkeypatch):
    """``ONE_LOOP`` over the interpreter's cases, dense and ACP, against the float64 oracle."""
    if torch.cuda.is_available():
        pytest.skip("interpreter shapes; the GPU runs test_routed_forward_gpu")
    _with_options(monkeypatch, fwd=dict(ONE_LOOP=True))
    _check_cpu(case, seed=5 * case[1] + case[2] + case[5])


# D 64 (a power of two: the tensor-memory engine's adds take a head's D columns whole):
# batch rows whose last query tile runs past the sequence (its rows add zeros into the next
# row's dQ), Tq < Tk, ACP, packed sequences
BULK_CASES = [
    (2, 63, 63, 4, 2, 64, "mixed", None, None),
    (1, 63, 257, 2, 1, 64, "fast", 1.0, None),
    (1, 257, 257, 2, 1, 64, "fast", "auto", [0, 1, 70, 257]),
]


@pytest.mark.parametrize("case", BULK_CASES, ids=[_id(c) for c in BULK_CASES])
def test_backward_with_dq_through_bulk_adds_matches_naive(case, monkeypatch):
    """``FUSE_DQ="tma"``: each tile's dQ added to a float32 buffer by one bulk operation of
    the tensor-memory engine (a descriptor over ``[B * Tq, HQ * D]``). The interpreter has no
    bulk adds, so on the CPU the kernel adds the same rows of that view by pointers, clipped
    only at its end (``FUSE_DQ`` 3): what this checks is that a tile's rows past its
    sequence add nothing to the next one's dQ."""
    from lapse.ops.forgetting import triton_bwd

    if torch.cuda.is_available():
        pytest.skip("interpreter shapes; the GPU runs test_backward_with_dq_through_bulk_adds_gpu")
    _fuse_dq(monkeypatch, "tma")
    assert triton_bwd._fuse_mode("tma", torch.zeros(1, 2, 2, 64), SimpleNamespace(d=64)) == 3
    _check_cpu(case, seed=case[1] + case[2] + case[5])


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_id(c) for c in GPU_CASES])
def test_backward_with_dq_through_atomics_gpu(case, monkeypatch):
    _fuse_dq(monkeypatch)
    _check_gpu(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_id(c) for c in GPU_CASES])
def test_backward_with_dq_from_kept_ds_gpu(case, monkeypatch):
    _fuse_dq(monkeypatch, "ds")
    _check_gpu(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_id(c) for c in GPU_CASES])
def test_backward_with_dq_through_bulk_adds_gpu(case, monkeypatch):
    _fuse_dq(monkeypatch, "tma")
    _check_gpu(case)


def _fixed_max(monkeypatch):
    """Makes the forward take ``FIXED_MAX``: the diagonal keys' maximum as every other key's
    reference, no online maximum."""
    _with_options(monkeypatch, fwd=dict(FIXED_MAX=True))


@pytest.mark.parametrize("case", CPU_CASES, ids=[_id(c) for c in CPU_CASES])
def test_forward_with_a_fixed_maximum_matches_naive(case, monkeypatch):
    """``FIXED_MAX`` held to the float64 oracle like the default (GQA, Tq < Tk, ACP, packed
    sequences, -inf and extreme gates, outputs poisoned first)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter shapes; the GPU runs test_forward_with_a_fixed_maximum_gpu")
    _fixed_max(monkeypatch)
    _check_cpu(case, seed=5 * case[1] + case[2] + case[5])


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_id(c) for c in GPU_CASES])
def test_forward_with_a_fixed_maximum_gpu(case, monkeypatch):
    _fixed_max(monkeypatch)
    _check_gpu(case)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # the interpreter's, on purpose
def test_fixed_maximum_redoes_a_tile_whose_weights_overflow():
    """One far key whose logit is ~580 (base 2) above the diagonal keys' overflows
    ``FIXED_MAX``'s weights; the tiles that see it must be done again with the online maximum
    and match the oracle (every later row attends to that key alone)."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test")
    from lapse.ops.forgetting import triton_fwd
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    g = torch.Generator().manual_seed(0)
    t, d = 300, 16
    q = 0.1 * torch.randn(1, t, 1, d, generator=g)
    k = 0.1 * torch.randn(1, t, 1, d, generator=g)
    v = torch.randn(1, t, 1, d, generator=g)
    q[..., 0] = 40.0
    k[0, 0, 0, 0] = 40.0  # q_i . k_0 / sqrt(16) = 400 for every i: far above the rest
    lg = torch.zeros(1, t, 1)  # no forgetting: the far key keeps its weight
    p = validate(q, k, v, lg, None, None, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    want = torch.zeros_like(q)
    want[0, 1:, 0] = v[0, 0, 0]  # rows after the first: key 0 alone
    want[0, 0, 0] = v[0, 0, 0]
    outs = {}
    for fixed in (False, True):
        o, lse2 = torch.full_like(q, float("nan")), torch.full_like(c_hi, float("nan"))
        triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, None, None, p, o, lse2,
                              dict(triton_fwd.fwd_config(d, 4), FIXED_MAX=fixed))
        assert torch.isfinite(o).all() and torch.isfinite(lse2[..., :t]).all()
        outs[fixed] = (o, lse2[..., :t])
    assert _rel(outs[True][0], want) < 1e-6
    assert torch.allclose(outs[True][0], outs[False][0], rtol=0, atol=1e-6)
    assert torch.allclose(outs[True][1], outs[False][1], rtol=1e-6, atol=1e-4)


GLUON_VARIANTS = {  # gluon_fwd.py's partitionings (its default is one of them)
    "8-warps": dict(BM=128, num_warps=8, SPLIT=False, COMPUTE_REGS=0, maxnreg=None),
    "2x4-warps": dict(BM=128, num_warps=4, SPLIT=True, COMPUTE_REGS=232, maxnreg=None),
    "4-warps-2-programs": dict(BM=64, num_warps=4, SPLIT=False, COMPUTE_REGS=0, maxnreg=128),
}


def _gluon_forward(monkeypatch, variant=None):
    """Makes the forward take ``gluon_fwd.py``'s Hopper kernel wherever it serves the
    inputs (dense, T_q == T_k, no varlen); the backward stays the Triton one. ``variant``:
    a key of ``GLUON_VARIANTS``, or None for the default options."""
    from lapse.ops.forgetting import gluon_fwd, triton_fwd

    plain = triton_fwd.fwd_config

    def gluon(d, dtype_bytes, acp=False, tk=0):
        if acp or d not in (64, 128):
            return plain(d, dtype_bytes, acp, tk)
        cfg = dict(GLUON=True, **gluon_fwd.gluon_config(d))
        cfg.update(GLUON_VARIANTS.get(variant, {}))
        return cfg

    monkeypatch.setattr(triton_fwd, "fwd_config", gluon)


def test_gluon_config_falls_back_off_hopper(monkeypatch):
    """Where the Gluon kernel cannot run (here: the CPU interpreter), a ``GLUON`` config
    runs the Triton kernel with its default options, to the same float64 rule."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test")
    _gluon_forward(monkeypatch)
    q, k, v, lg, do = _inputs(1, 70, 70, 2, 1, 64, "mixed", torch.float32, "cpu", seed=3)
    _compare(q, k, v, lg, do, torch.float32)


GLUON_CASES = [
    (2, 1024, 1024, 8, 8, 64, "mixed", None, None),
    (3, 257, 257, 4, 2, 64, "extreme", None, None),
    (1, 1, 1, 2, 1, 64, "mixed", None, None),
    (1, 4096, 4096, 4, 4, 128, "mixed", None, None),
    (2, 1000, 1000, 6, 3, 128, "fast", None, None),
    (1, 200, 200, 2, 2, 48, "mixed", None, None),  # D 48: not served, the Triton kernel runs
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(GLUON_VARIANTS))
@pytest.mark.parametrize("case", GLUON_CASES, ids=[_id(c) for c in GLUON_CASES])
def test_gluon_forward_gpu(case, variant, monkeypatch):
    """The Gluon forward (Hopper) against the float64 oracle, outputs poisoned first; the
    Triton backward then runs on its o and lse, so the lse is checked through it too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _gluon_forward(monkeypatch, variant)
    b, tq, tk, hq, h, d, gate, acp, cu = case
    q, k, v, lg, do = _inputs(b, tq, tk, hq, h, d, gate, torch.bfloat16, "cuda", seed=d + tq)
    _compare(q, k, v, lg, do, torch.bfloat16)



GLUON_ACP_VARIANTS = {  # gluon_fwd.launch_acp's options by D: its default, and several consumers a
    # program (three at D 64; at D 128 two fit the shared memory)
    "default": {64: {}, 128: {}},
    "consumers": {64: dict(NC=3, COMPUTE_REGS=160, STAGES=2, PROGRAMS=1),
                  128: dict(NC=2, COMPUTE_REGS=152, STAGES=2, PROGRAMS=1)},
}
GLUON_ACP_CASES = [
    (2, 1024, 1024, 8, 8, 64, "mixed", "auto", None),
    (3, 257, 257, 4, 2, 64, "fast", "auto", None),
    (1, 4160, 4160, 4, 4, 128, "mixed", "auto", None),
    (2, 1000, 1000, 6, 3, 128, "fast", "auto", None),
    (1, 200, 200, 2, 2, 64, "extreme", "auto", None),
    (1, 300, 300, 2, 2, 48, "fast", "auto", None),  # D 48: not served, the Triton kernel runs
]


def test_gluon_acp_config_falls_back_off_hopper(monkeypatch):
    """Where the persistent Gluon ACP kernel cannot run (here: the CPU interpreter), a
    ``GLUON_ACP`` config runs the Triton ACP kernel, to the same float64 rule, pruning."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test")
    from lapse.ops.forgetting import triton_fwd

    plain = triton_fwd.fwd_config
    for option in ({}, "routed"):  # the routed launch: the heads ACP prunes, after the dense tiles'

        def table(d, b, acp=False, tk=0, option=option):
            return dict(plain(d, b, acp, tk), GLUON_ACP=option, ROUTE=1) if acp else plain(d, b, acp, tk)

        monkeypatch.setattr(triton_fwd, "fwd_config", table)
        monkeypatch.setattr(triton_fwd, "ROUTE_MIN_ROWS", 1)
        q, k, v, lg, do = _inputs(1, 200, 200, 2, 1, 64, "mixed", torch.float32, "cpu", seed=5)
        _compare(q, k, v, lg, do, torch.float32, "auto", None, True)


def test_d128_acp_table_routes_to_gluon():
    """The D 128 ACP table (16-bit) asks for the persistent Gluon kernel on its routed launch
    from ``LONG_ACP_KEYS`` keys on (below, it lost on the bench's workload); D 64 and float32
    do not."""
    from lapse.ops.forgetting import triton_fwd

    for tk in (triton_fwd.LONG_ACP_KEYS, 4 * triton_fwd.LONG_ACP_KEYS):
        cfg = triton_fwd.fwd_config(128, 2, True, tk)
        assert cfg["GLUON_ACP"] == "routed" and cfg["ROUTE"] == 1
    for tk in (4096, triton_fwd.LONG_ACP_KEYS - 1):
        cfg = triton_fwd.fwd_config(128, 2, True, tk)
        assert "GLUON_ACP" not in cfg and cfg["ROUTE"] == 1
    assert "GLUON_ACP" not in triton_fwd.fwd_config(64, 2, True, 4096)
    assert "GLUON_ACP" not in triton_fwd.fwd_config(128, 4, True, 4096)
    assert "GLUON_ACP" not in triton_fwd.fwd_config(128, 2, False, 4096)


def test_gluon_acp_routed_only_routed_and_on_its_triton(monkeypatch):
    """The table's ``GLUON_ACP="routed"`` declines (the Triton kernel runs) on a launch that is
    not routed, and on a Triton other than the one it was measured with, before it looks at the
    inputs."""
    from lapse.ops.forgetting import gluon_fwd, triton_fwd

    calls = []
    monkeypatch.setattr(gluon_fwd, "acp_supported", lambda *a: True)  # as on Hopper
    monkeypatch.setattr(gluon_fwd, "acp_config", lambda d: {})
    monkeypatch.setattr(gluon_fwd, "launch_acp", lambda *a, **kw: calls.append(kw))
    p = SimpleNamespace(d=128)

    def launch(routed):
        return triton_fwd._launch_gluon_acp(*[None] * 7, p, None, None, "routed", routed)

    monkeypatch.setattr(triton_fwd, "GLUON_ACP_TRITON", triton.__version__)  # whatever Triton runs
    assert launch(False) is False and not calls
    assert launch(True) is True and calls == [dict(skip_full=True)]
    monkeypatch.setattr(triton_fwd, "GLUON_ACP_TRITON", "0.0.")
    assert launch(True) is False and len(calls) == 1



def test_launch_acp_host_side(monkeypatch):
    """``gluon_fwd.launch_acp``'s host side on the CPU (the kernel replaced by a recorder, the
    device's multiprocessors set): one program a multiprocessor x ``PROGRAMS`` at most, the
    descriptors' blocks, the counts the kernel reads; options its kernel cannot serve are
    refused in one line before any launch."""
    from lapse.ops.forgetting import gluon_fwd

    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((grid, a, kw))

    monkeypatch.setattr(gluon_fwd, "_acp_kernel", Kernel())
    monkeypatch.setattr(gluon_fwd, "_multiprocessors", lambda device: 3)
    b, t, hq, h, d = 2, 200, 4, 2, 128
    q = torch.zeros(b, t, hq, d, dtype=torch.bfloat16)
    k = v = torch.zeros(b, t, h, d, dtype=torch.bfloat16)
    c_hi = torch.zeros(b, hq, 256)
    bs = torch.zeros(b, hq, 4, dtype=torch.int32)
    p = SimpleNamespace(d=d, scale=d ** -0.5)
    gluon_fwd.launch_acp(q, k, v, c_hi, c_hi, bs, p, q, c_hi, None, skip_full=True)
    (grid, args, kw), = launches
    assert grid == (3 * gluon_fwd.acp_config(d)["PROGRAMS"], )  # 4 tiles x 8 heads = 32 items
    assert [x.block_shape for x in args[:3]] == [[64, d]] * 3
    assert args[9:] == (t, 256, 4, hq, hq // h, b * hq, 4, 4 * b * hq)
    assert kw["SKIP_FULL"] is True and kw["BM"] == 64 and kw["NC"] == 1
    for bad in (dict(BM=128), dict(BN=128), dict(STAGES=1), dict(num_warps=8), dict(NC=2)):
        with pytest.raises(ValueError, match="launch_acp needs"):
            gluon_fwd.launch_acp(q, k, v, c_hi, c_hi, bs, p, q, c_hi, {**gluon_fwd.acp_config(d), **bad})
    assert len(launches) == 1
    monkeypatch.setattr(gluon_fwd, "_fwd_kernel", Kernel())  # the dense kernel's launch, the same way
    gluon_fwd.launch(q, k, v, c_hi, c_hi, p, q, c_hi)
    grid, args, kw = launches[1]
    bm = gluon_fwd.gluon_config(d)["BM"]
    assert grid == (triton.cdiv(t, bm), b * hq) and args[8:] == (t, 256, hq, hq // h)
    assert [x.block_shape for x in args[:3]] == [[bm, d], [64, d], [64, d]]

@pytest.mark.parametrize("route", [False, True], ids=["one-launch", "routed"])
def test_launch_fwd_offers_gluon_the_acp_launch_only(monkeypatch, route):
    """``launch_fwd`` offers its ``GLUON_ACP`` option to the ACP launch alone: once, routed
    (``ROUTE``'s second launch) or not; never to the dense tiles' launch. (Here the offer is
    declined, so the Triton kernel runs every launch, to the float64 rule.)"""
    from lapse.ops.forgetting import triton_fwd

    plain = triton_fwd.fwd_config
    offers = []

    def offer(*a):
        offers.append((a[-2], a[-1]))  # (options, routed)
        return False

    monkeypatch.setattr(triton_fwd, "_launch_gluon_acp", offer)
    monkeypatch.setattr(triton_fwd, "ROUTE_MIN_ROWS", 1)

    def table(d, b, acp=False, tk=0):
        cfg = plain(d, b, acp, tk)
        return dict(cfg, GLUON_ACP="routed", **({"ROUTE": 1} if route else {})) if acp else cfg

    monkeypatch.setattr(triton_fwd, "fwd_config", table)
    q, k, v, lg, do = _inputs(1, 200, 200, 2, 1, 64, "mixed", torch.float32, "cpu", seed=5)
    o = forgetting_attention(q, k, v, lg, acp="auto", backend="triton")
    assert offers == [("routed", route)]
    want = forgetting_attention(q.double(), k.double(), v.double(), lg, acp="auto", backend="naive")
    assert _rel(o, want) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("route", [False, True], ids=["all-heads", "routed"])
@pytest.mark.parametrize("variant", list(GLUON_ACP_VARIANTS))
@pytest.mark.parametrize("case", GLUON_ACP_CASES, ids=[_id(c) for c in GLUON_ACP_CASES])
def test_gluon_acp_forward_gpu(case, variant, route, monkeypatch):
    """The persistent Gluon ACP forward (Hopper, opt-in ``GLUON_ACP``) against the float64
    oracle, outputs poisoned first, on every head or on the pruned ones after the dense tiles'
    launch (``ROUTE``); the Triton backward then runs on its o and lse."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from lapse.ops.forgetting import gluon_fwd, triton_fwd

    plain = triton_fwd.fwd_config

    def gluon_acp(d, dtype_bytes, acp=False, tk=0):
        cfg = plain(d, dtype_bytes, acp, tk)
        if not acp:
            return cfg
        cfg.pop("ROUTE", None)
        options = GLUON_ACP_VARIANTS[variant].get(d, {})
        return dict(cfg, GLUON_ACP=options, **({"ROUTE": 1} if route else {}))

    monkeypatch.setattr(triton_fwd, "fwd_config", gluon_acp)
    monkeypatch.setattr(triton_fwd, "ROUTE_MIN_ROWS", 1)
    launches = []
    launch = gluon_fwd.launch_acp
    monkeypatch.setattr(gluon_fwd, "launch_acp", lambda *a, **kw: (launches.append(kw), launch(*a, **kw)))
    b, tq, tk, hq, h, d, gate, acp, cu = case
    q, k, v, lg, do = _inputs(b, tq, tk, hq, h, d, gate, torch.bfloat16, "cuda", seed=d + tq)
    _compare(q, k, v, lg, do, torch.bfloat16, acp, None, True if gate == "fast" else None)
    if d in (64, 128) and torch.cuda.get_device_capability()[0] == 9:  # it served the forward
        assert launches and all(kw["skip_full"] == route for kw in launches)


def _flip_load_options(monkeypatch):
    """Every kernel with its per-row / per-key inputs read the other way than its table
    says: the forward's and the dQ kernel's ``PAIRS`` flipped, the dK/dV kernel's
    ``ROWS4`` off (three loads), every kernel's ``ROW_BIAS`` flipped (16-bit inputs: the
    query's own c_i in every logit, or in the lse only) and the forward's ``FIXED_MAX``
    (the online maximum, or the diagonal keys' as every key's reference), the queries' rows made the other
    way (``MAKE_ROWS`` flipped: by the dQ kernel run first, or by a launch of their own), every
    kernel's grid the other way round (``HEADS_FIRST`` flipped), the unpruned heads routed to
    the dense tiles where the tables do not (``ROUTE`` flipped, forward and backward), the ``LOOPS``
    options off where the table sets them and all on where it does not, so the options
    the tables do not pick stay tested."""
    from lapse.ops.forgetting import triton_bwd, triton_fwd

    fwd, bwd = triton_fwd.fwd_config, triton_bwd.bwd_config

    def loops(cfg):  # the loop options: none where the table has some, all where it has none
        return 0 if cfg.get("LOOPS", 0) else 3

    def fwd_flipped(*a, **kw):
        cfg = fwd(*a, **kw)
        return dict(cfg, PAIRS=not cfg.get("PAIRS", False), LOOPS=loops(cfg),
                    ROW_BIAS=not cfg.get("ROW_BIAS", False), FIXED_MAX=not cfg.get("FIXED_MAX", False),
                    HEADS_FIRST=not cfg.get("HEADS_FIRST", False), ROUTE=0 if cfg.get("ROUTE") else 1)

    def bwd_flipped(*a, **kw):
        kv, q = bwd(*a, **kw)
        return (dict(kv, ROWS4=False, LOOPS=loops(kv), ROW_BIAS=not kv.get("ROW_BIAS", False),
                     HEADS_FIRST=not kv.get("HEADS_FIRST", False), ROUTE=0 if kv.get("ROUTE") else 1),
                dict(q, PAIRS=not q.get("PAIRS", False), MAKE_ROWS=not q.get("MAKE_ROWS", False),
                     LOOPS=loops(q), ROW_BIAS=not q.get("ROW_BIAS", False),
                     HEADS_FIRST=not q.get("HEADS_FIRST", False)))

    monkeypatch.setattr(triton_fwd, "fwd_config", fwd_flipped)
    monkeypatch.setattr(triton_bwd, "bwd_config", bwd_flipped)
    _route_small_calls(monkeypatch)


@pytest.mark.parametrize("case", CPU_CASES, ids=[_id(c) for c in CPU_CASES])
def test_other_load_options_match_naive(case, monkeypatch):
    """The load options the tables do not pick (``PAIRS`` flipped, ``ROWS4`` off) held to
    the float64 oracle like the defaults, outputs poisoned first."""
    if torch.cuda.is_available():
        pytest.skip("interpreter shapes; the GPU runs test_other_load_options_gpu")
    _flip_load_options(monkeypatch)
    _check_cpu(case, seed=3 * case[1] + case[2] + case[5])


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_id(c) for c in GPU_CASES])
def test_other_load_options_gpu(case, monkeypatch):
    _flip_load_options(monkeypatch)
    _check_gpu(case)


def test_bias_off_is_plain_softmax_attention():
    """The timing switch ``BIAS=False`` (forward) / ``BIAS=0`` (backward) computes what
    BENCHMARKS.md says it times: plain causal softmax attention, the gate ignored, here
    against PyTorch's SDPA in float32 (GQA, T not a multiple of any tile). The backward's
    lse carries the queries' ``c_lo`` (launch_bwd folds it in), a ~1e-7 relative shift."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test")
    from lapse.ops.forgetting import triton_bwd, triton_fwd
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    q, k, v, lg, do = _inputs(1, 70, 70, 4, 2, 32, "fast", torch.float32, "cpu", seed=11)
    p = validate(q, k, v, lg, None, None, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    o, lse2 = torch.full_like(q, float("nan")), torch.full_like(c_hi, float("nan"))
    triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, None, None, p, o, lse2,
                          dict(triton_fwd.fwd_config(32, 4), BIAS=False))
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    ref.backward(do.transpose(1, 2))
    assert _rel(o, ref.transpose(1, 2)) < 1e-6
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)] + [torch.zeros_like(lse2) for _ in range(2)]
    kv, qc = triton_bwd.bwd_config(32, 2)
    triton_bwd.launch_bwd(q, k, v, o, do, lse2, None, c_hi, c_lo, None, None, None, p, *grads,
                          (dict(kv, BIAS=0), dict(qc, BIAS=0)))
    for got, want in zip(grads[:3], (qt.grad, kt.grad, vt.grad), strict=True):
        assert _rel(got, want.transpose(1, 2)) < 1e-5
