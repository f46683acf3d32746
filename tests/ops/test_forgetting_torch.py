"""The chunked PyTorch backend (and the naive op in float32) against the float64 oracle.

Every case runs ``forgetting_attention`` on the same random inputs four ways: the naive
op in float64 (the reference), the torch backend in float64 (held to 1e-10 relative),
and both the torch backend and the naive op in float32. The naive float32 run is the
baseline: the torch backend's float32 error may be at most 2x (output, lse) / 3x
(gradients) the baseline's error, plus a floor (errors are max-abs over the tensor):

- ``FLOOR_ULPS`` ulps of ``max(1, max|reference|)`` (inputs are O(1)): where the
  baseline is exact (one key per row: o = v) the final rounding alone exceeds 2x of it;
- for the gradients, ``DS_FLOOR_ULPS`` ulps of ``max|dO| * max|V|``. The flash-style
  backward forms ``dS_ij = P_ij (dP_ij - delta_i)`` with ``delta_i = rowsum(dO_i * O_i)``,
  two separately rounded numbers of size ``|dO_i . V_j|``, while the naive op's softmax
  backward takes delta from the same ``dP`` values, so where attention is one-hot (a
  single key, gates near 0) the exact and the naive dS are ~0 and the chunked one is
  about one ulp of ``|dO . V|``. Measured: gates near 0 give dq/dk errors of 3e-6 =
  1.3 such ulps (naive float32: 3e-7); elsewhere the torch backend is 2-20x *more*
  accurate than the naive op in float32 (its bias comes from a float64 ``c``).

Real bugs show up as errors of 1e-4 and more. The float64 runs are held to 1e-10 of
``max(1, max|reference|)``.

With ACP every backend gets the same ``acp`` arguments, so the naive op masks exactly
the tiles the torch backend skips (one shared ``block_start``), and the cases use gates
that decay fast enough that tiles really are pruned (asserted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import lapse.ops.forgetting.chunked as chunked
from lapse.ops.forgetting import forgetting_attention

FLOOR_ULPS = 8
DS_FLOOR_ULPS = 4
F32_ULP = torch.finfo(torch.float32).eps
NAMES = ("o", "lse", "dq", "dk", "dv", "dlog_fgate")


@dataclass(frozen=True)
class Case:
    b: int = 1
    tq: int = 63
    tk: int = 63
    hq: int = 4
    h: int = 2
    d: int = 48
    lens: tuple[int, ...] | None = None  # packed sequence lengths (cu_seqlens); b = 1
    acp: object = None  # None, "auto", a float, or "heads" (a [HQ] tensor of bounds)
    acp_eps: float = math.exp(-10)
    gates: str = "mixed"  # gate logits: see make_inputs
    qk_scale: float = 1.0  # multiplies q and k (small norms make ACP bounds tighter)
    expect_pruned: bool = False

    @property
    def id(self) -> str:
        if self.lens is None:
            shape = f"B{self.b}-Tq{self.tq}-Tk{self.tk}"
        else:
            shape = "varlen" + "_".join(map(str, self.lens))
        acp = {None: "", "auto": "-acp_auto", "heads": "-acp_heads"}.get(
            self.acp, f"-acp{self.acp}"
        )
        eps = "" if self.acp_eps == math.exp(-10) else f"-eps{self.acp_eps:g}"
        return f"{shape}-HQ{self.hq}-H{self.h}-D{self.d}-{self.gates}{acp}{eps}"


CASES = [
    # dense: lengths that are not multiples of a tile, D not a power of two, GQA
    Case(b=2, tq=1, tk=1, hq=2, h=2, d=64),
    Case(b=2, tq=63, tk=63, hq=4, h=2, d=48),
    Case(b=1, tq=257, tk=257, hq=2, h=1, d=96),
    Case(b=2, tq=257, tk=257, hq=4, h=4, d=64, gates="slow"),
    Case(b=2, tq=63, tk=257, hq=6, h=2, d=48),
    Case(b=1, tq=1, tk=257, hq=4, h=2, d=96),
    Case(lens=(1, 63, 130, 257), hq=4, h=2, d=48),
    Case(lens=(5, 0, 300), hq=2, h=2, d=64),
    # extreme gates: f near 0, f near 1, some f = 0 (log f = -inf)
    Case(b=2, tq=257, tk=257, hq=2, h=1, d=64, gates="closed"),
    Case(b=1, tq=257, tk=257, hq=2, h=2, d=48, gates="open"),
    Case(b=2, tq=130, tk=257, hq=4, h=2, d=48, gates="dead"),
    Case(lens=(1, 70, 257), hq=2, h=1, d=96, gates="dead"),
    # ACP: pruned tiles, partly pruned tiles and heads that prune nothing
    Case(b=2, tq=257, tk=257, hq=4, h=2, d=64, acp="auto", gates="fast", expect_pruned=True),
    Case(b=1, tq=200, tk=300, hq=4, h=2, d=48, acp=2.0, gates="fast", qk_scale=0.3,
         expect_pruned=True),
    Case(b=2, tq=257, tk=257, hq=4, h=4, d=96, acp="heads", gates="per_head", qk_scale=0.3,
         expect_pruned=True),
    Case(b=1, tq=1, tk=257, hq=2, h=1, d=48, acp=1.0, gates="fast", qk_scale=0.3,
         expect_pruned=True),
    Case(lens=(1, 63, 257, 140), hq=4, h=2, d=48, acp="auto", gates="per_head",
         expect_pruned=True),
    Case(b=1, tq=257, tk=257, hq=2, h=1, d=64, acp="auto", gates="closed", expect_pruned=True),
    Case(b=1, tq=257, tk=257, hq=2, h=2, d=48, acp="auto", gates="open"),
    Case(b=2, tq=257, tk=257, hq=2, h=1, d=48, acp="auto", gates="dead", expect_pruned=True),
    # ACP with a bound U far below max|scale q.k|, a large eps and slowly decaying gates:
    # not what a user should ask for, but the pruned weights are then large enough (1e-4
    # and more) that a pair masked differently from the naive op shows; with a valid
    # bound they are below 1e-12. "split" gates differ inside each query-head group, so
    # some rows of a tile are fully pruned while the group still needs the tile (rows at
    # -inf in the online softmax).
    Case(b=2, tq=257, tk=257, hq=4, h=2, d=48, acp=0.0, acp_eps=0.5, gates="medium",
         expect_pruned=True),
    Case(b=1, tq=520, tk=520, hq=4, h=2, d=32, acp=0.0, acp_eps=0.5, gates="split",
         expect_pruned=True),
    Case(b=1, tq=300, tk=520, hq=2, h=2, d=32, acp=0.5, acp_eps=0.3, gates="split",
         expect_pruned=True),
    Case(lens=(1, 300, 64, 430), hq=2, h=1, d=48, acp=0.0, acp_eps=0.5, gates="split",
         expect_pruned=True),
]


def make_inputs(case: Case, seed: int = 0):
    """float64 q, k, v, log_fgate (float32 values), cu_seqlens and (acp, acp_eps).

    Gate logits: "mixed" N(0, 2^2) (f anywhere in (0, 1)); "slow" N(4, 1); "fast"
    N(-1, 1); "per_head" fast to slow across heads (offsets -2 .. 4); "medium" N(2, 0.5^2)
    (log f ~ -0.13: a tile 64 keys back has weights ~e^-8, not negligible); "split"
    medium on even heads and N(8, 0.5^2) on odd ones; "closed" -20 (f ~ 2e-9); "open"
    +20 (log f ~ -2e-9); "dead" mixed with 10% log f = -inf.
    """
    g = torch.Generator().manual_seed(seed)
    b, tq, tk = (1, sum(case.lens), sum(case.lens)) if case.lens else (case.b, case.tq, case.tk)
    q = torch.randn(b, tq, case.hq, case.d, generator=g) * case.qk_scale
    k = torch.randn(b, tk, case.h, case.d, generator=g) * case.qk_scale
    v = torch.randn(b, tk, case.h, case.d, generator=g)
    z = torch.randn(b, tk, case.hq, generator=g)
    logits = {
        "mixed": 2 * z,
        "slow": z + 4,
        "fast": z - 1,
        "per_head": z + torch.linspace(-2, 4, case.hq),
        "medium": 0.5 * z + 2,
        "split": 0.5 * z + torch.tensor([2.0, 8.0]).repeat(case.hq)[: case.hq],
        "closed": torch.full_like(z, -20.0),
        "open": torch.full_like(z, 20.0),
        "dead": 2 * z,
    }[case.gates]
    log_fgate = F.logsigmoid(logits)
    if case.gates == "dead":
        dead = torch.rand(b, tk, case.hq, generator=g) < 0.1
        log_fgate = log_fgate.masked_fill(dead, float("-inf"))
    cu = None
    if case.lens:
        cu = torch.tensor([0, *torch.tensor(case.lens).cumsum(0).tolist()], dtype=torch.int32)
    acp = case.acp
    if acp == "heads":
        # per-head bounds as QK-norm gains would give: U = max|scale q.k| for each head,
        # rounded up, computed here from the data
        s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(case.hq // case.h, 2))
        acp = (s.abs().amax(dim=(0, 2, 3)) / math.sqrt(case.d) * 1.01).float()  # [HQ]
    # float32-representable values, so the float32 and float64 runs see the same inputs
    return [x.float().double() for x in (q, k, v, log_fgate)], cu, (acp, case.acp_eps)


def run(inputs, cu, acp, backend, dtype, do):
    """o, lse, stats and the four gradients of one backend at one dtype."""
    q, k, v = (x.to(dtype).requires_grad_() for x in inputs[:3])
    # gates stay float32 (log space) whatever q's dtype; float64 only with float64 q
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    log_fgate = inputs[3].to(gate_dtype).requires_grad_()
    acp, acp_eps = acp
    o, lse, stats = forgetting_attention(
        q, k, v, log_fgate, acp=acp, acp_eps=acp_eps, cu_seqlens=cu, backend=backend,
        return_lse=True, return_stats=True,
    )
    grads = torch.autograd.grad(o, (q, k, v, log_fgate), do.to(o.dtype))
    return (o, lse, *grads), stats


def max_err(x, ref):
    return (x.double() - ref).abs().max().item() if ref.numel() else 0.0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_float64_reference(case):
    inputs, cu, acp = make_inputs(case)
    do = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1))
    do = do.float().double()
    ref, ref_stats = run(inputs, cu, acp, "naive", torch.float64, do)
    t64, stats64 = run(inputs, cu, acp, "torch", torch.float64, do)
    t32, stats32 = run(inputs, cu, acp, "torch", torch.float32, do)
    n32, _ = run(inputs, cu, acp, "naive", torch.float32, do)

    # every backend pruned exactly the same tiles
    assert torch.equal(stats64.block_start, ref_stats.block_start)
    assert torch.equal(stats32.block_start, ref_stats.block_start)
    if case.expect_pruned:
        assert stats32.pruned_fraction.max() > 0, "the case was meant to prune tiles"

    grad_scale = do.abs().max().item() * inputs[2].abs().max().item()  # max|dO| max|V|
    for name, x64, x32, base, r in zip(NAMES, t64, t32, n32, ref, strict=True):
        assert x32.dtype == torch.float32 and x64.dtype == torch.float64, name
        assert x64.shape == x32.shape == r.shape, name
        for x in (x64, x32, base):
            assert not x.isnan().any(), f"{name}: NaN"
        scale = max(r.abs().max().item() if r.numel() else 0.0, 1.0)
        # float64: the same math up to summation order
        assert max_err(x64, r) <= 1e-10 * scale, name
        # float32: at most 2x / 3x the error of the naive op in float32, plus the floor
        factor = 2.0 if name in ("o", "lse") else 3.0
        err, err_base = max_err(x32, r), max_err(base, r)
        floor = FLOOR_ULPS * F32_ULP * scale
        if name not in ("o", "lse"):
            floor += DS_FLOOR_ULPS * F32_ULP * grad_scale
        assert err <= factor * err_base + floor, (
            f"{name}: torch float32 error {err:.3g} vs naive float32 {err_base:.3g} "
            f"(floor {floor:.3g})"
        )


def test_output_layout():
    """o in the input dtype, lse [B, HQ, Tq] float32 ([1, HQ, total] packed)."""
    case = Case(b=2, tq=63, tk=100, hq=4, h=2, d=48)
    (q, k, v, lf), _, _ = make_inputs(case)
    o, lse = forgetting_attention(q.float(), k.float(), v.float(), lf.float(), backend="torch",
                                  return_lse=True)
    assert o.dtype == torch.float32 and o.shape == (2, 63, 4, 48)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 63)
    o, lse = forgetting_attention(q, k, v, lf, backend="torch", return_lse=True)
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    case = Case(lens=(3, 60), hq=4, h=2, d=48)
    (q, k, v, lf), cu, _ = make_inputs(case)
    o, lse = forgetting_attention(q.float(), k.float(), v.float(), lf.float(), cu_seqlens=cu,
                                  backend="torch", return_lse=True)
    assert o.shape == (1, 63, 4, 48) and lse.shape == (1, 4, 63)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision(dtype):
    """bf16/fp16 inputs: output and gradients in the input dtype, within 2x / 3x the
    naive op's error in that dtype (the torch backend accumulates in float32)."""
    case = Case(b=1, tq=130, tk=257, hq=4, h=2, d=64, acp="auto", gates="fast")
    inputs, cu, acp = make_inputs(case)
    inputs = [x.to(dtype).double() if i < 3 else x for i, x in enumerate(inputs)]
    do = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1))
    do = do.to(dtype).double()
    ref, _ = run(inputs, cu, acp, "naive", torch.float64, do)
    low, _ = run(inputs, cu, acp, "torch", dtype, do)
    base, _ = run(inputs, cu, acp, "naive", dtype, do)
    ulp = torch.finfo(dtype).eps
    grad_scale = do.abs().max().item() * inputs[2].abs().max().item()  # max|dO| max|V|
    for name, x, b, r in zip(NAMES, low, base, ref, strict=True):
        expected = torch.float32 if name in ("lse", "dlog_fgate") else dtype
        assert x.dtype == expected, name
        factor = 2.0 if name in ("o", "lse") else 3.0
        scale = max(r.abs().max().item(), 1.0)
        floor = FLOOR_ULPS * ulp * scale
        if name not in ("o", "lse"):
            floor += DS_FLOOR_ULPS * ulp * grad_scale
        assert max_err(x, r) <= factor * max_err(b, r) + floor, name


def test_saves_no_quadratic_memory():
    """What the backward keeps is O(T) (q, k, v, o, lse, c, gates), not O(T^2)."""
    t = 1024
    q, k, v = (torch.randn(1, t, 1, 16, requires_grad=True) for _ in range(3))
    lf = F.logsigmoid(torch.randn(1, t, 1)).requires_grad_()
    o = forgetting_attention(q, k, v, lf, backend="torch")
    saved = [x for x in o.grad_fn.saved_tensors if x is not None]
    assert sum(x.numel() for x in saved) < 8 * t * 16


def test_acp_skips_tiles(monkeypatch):
    """Pruned key chunks are not computed at all, not only masked, per head and per tile."""
    calls = []
    scores = chunked._scores

    def counting(scratch, q_i, *args):
        calls.append(q_i.shape[0])  # key/value heads computed in this tile
        return scores(scratch, q_i, *args)

    monkeypatch.setattr(chunked, "_scores", counting)
    t = 2048
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, t, 2, 16, generator=g) for _ in range(3))

    def head_tiles(gate_logits, acp):
        calls.clear()
        lf = F.logsigmoid(torch.tensor(gate_logits).expand(1, t, 2).contiguous())
        _, stats = forgetting_attention(q, k, v, lf, backend="torch", acp=acp,
                                        return_stats=True)
        return sum(calls), min(calls), stats.pruned_fraction[0]

    dense, _, _ = head_tiles([-3.0, -3.0], None)
    # both heads forget within a few tokens: most tiles are skipped outright
    pruned, _, frac = head_tiles([-3.0, -3.0], "auto")
    assert (frac > 0.8).all() and pruned < 0.5 * dense
    # head 0 forgets, head 1 barely does: tiles that only head 1 needs run with one head
    _, fewest, frac = head_tiles([-3.0, 8.0], "auto")
    assert frac[0] > 0.8 and frac[1] == 0 and fewest == 1
