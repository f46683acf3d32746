"""Accumulated attention per key (H2O/A2SF prefill scores) against a float64 reference.

The reference below is written here, independently of ``lapse.ops.scores``: for every
(batch, query head) it materialises the ``T x T`` softmax in float64 and adds
``w @ P`` (``w_i = alpha ** (T-1-i)`` in Python floats) to the query head's key head.

Every backend gets the log-sum-exp two ways: computed by its own first pass, and given
from ``forgetting_attention(..., return_lse=True)`` (the layout a caller will pass).

Tolerances (STYLE principle 3), errors as max-abs over the output divided by
``max(1, max|reference|)``: float64 runs to 1e-12 (measured at most 2e-15); float32 and
float16 runs to 2x the error of the naive op in the same dtype (the same materialised
math at that precision) plus a floor of ``FLOOR_ULPS`` float32 ulps (9.5e-7). The floor
is for cases where the naive baseline is (nearly) exact, T = 1 or a few live rows, and a
different summation order alone exceeds 2x of it. Measured on these cases: torch float32
at most 3.5e-7 (at most 1.7x the baseline above the floor), Triton float32 under the
interpreter at most 3.1e-7 (1.4x), Triton float16 at most 2e-7 (its half baseline is
2e-5 to 1e-4: the naive op takes its logits from a half matmul). A dropped tile or a
wrong mask gives errors above 1e-3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lapse.ops import attention_key_scores
from lapse.ops.backend import triton_usable
from lapse.ops.forgetting import forgetting_attention
from lapse.ops.scores import first_live_query

F32_ULP = torch.finfo(torch.float32).eps
FLOOR_ULPS = 8


@dataclass(frozen=True)
class Case:
    b: int = 2
    t: int = 63
    hq: int = 8
    h: int = 2
    d: int = 48
    gates: str | None = "mixed"  # None: softmax attention; else see make_inputs
    alpha: float = 1.0
    chunk: int | None = 50  # torch backend tile length; None: the default 128 x 256

    @property
    def id(self) -> str:
        kind = "softmax" if self.gates is None else f"fox_{self.gates}"
        return (f"B{self.b}-T{self.t}-HQ{self.hq}-H{self.h}-D{self.d}-{kind}"
                f"-a{self.alpha:g}-chunk{self.chunk}")


CASES = [
    Case(t=1, gates=None),
    Case(t=1, alpha=0.0, hq=4, h=4),
    Case(t=63),
    Case(t=63, gates=None, alpha=0.9),
    Case(t=63, alpha=0.0, hq=4, h=4),
    Case(t=257, gates=None, chunk=64),
    Case(t=257, alpha=0.9, hq=4, h=4),
    Case(t=257, gates=None, alpha=0.0, chunk=None),
    Case(t=257, alpha=0.9, chunk=None),
    Case(t=257, gates=None, hq=4, h=4, chunk=None),
    # alpha = 0.5: the first ~100 queries weigh below float32's range and are skipped
    Case(b=1, t=257, alpha=0.5, chunk=32),
    # log f = -inf for 10% of the positions; fast and slow decay
    Case(t=257, gates="dead", hq=4, h=2, alpha=0.9),
    Case(b=1, t=257, gates="fast"),
    Case(b=1, t=130, gates="slow", hq=6, h=3, alpha=0.99, chunk=16),
    # alpha^(T-1) underflows even in float64
    Case(b=1, t=400, gates=None, hq=2, h=1, alpha=0.1, chunk=128),
]


def make_inputs(case: Case, seed: int = 0):
    """float64 q, k and log_fgate (None for softmax) holding float32-representable
    values, so float32 and float64 runs see the same inputs. Gate logits: "mixed"
    N(0, 2^2), "fast" N(-1, 1), "slow" N(4, 1), "dead" mixed with 10% log f = -inf."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(case.b, case.t, case.hq, case.d, generator=g)
    k = torch.randn(case.b, case.t, case.h, case.d, generator=g)
    log_fgate = None
    if case.gates is not None:
        z = torch.randn(case.b, case.t, case.hq, generator=g)
        logits = {"mixed": 2 * z, "fast": z - 1, "slow": z + 4, "dead": 2 * z}[case.gates]
        log_fgate = F.logsigmoid(logits)
        if case.gates == "dead":
            dead = torch.rand(case.b, case.t, case.hq, generator=g) < 0.1
            log_fgate = log_fgate.masked_fill(dead, float("-inf"))
        log_fgate = log_fgate.float().double()
    return q.float().double(), k.float().double(), log_fgate


def reference(q, k, log_fgate, alpha, scale=None):
    """A(j) in float64 with one materialised ``[T, T]`` softmax per (batch, query head)."""
    b, t, hq, d = q.shape
    h = k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    w = torch.tensor([alpha ** (t - 1 - i) for i in range(t)], dtype=torch.float64)  # 0**0 = 1
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    a = torch.zeros(b, t, h, dtype=torch.float64)
    for bi in range(b):
        for head in range(hq):
            kv = head // (hq // h)
            s = q[bi, :, head].double() @ k[bi, :, kv].double().T * scale  # [T, T]
            if log_fgate is not None:
                # a pair separated by log f = -inf gets a bias of -1e4: weight exactly 0
                c = torch.cumsum(log_fgate[bi, :, head].double().clamp_min(-1e4), 0)
                s = s + (c[:, None] - c[None, :])
            prob = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
            a[bi, :, kv] += w @ prob
    return a


def forward_lse(q, k, log_fgate):
    """The log-sum-exp ``forgetting_attention`` returns ([B, HQ, T]); softmax attention is
    forgetting attention with log f = 0."""
    if log_fgate is None:
        log_fgate = q.new_zeros(q.shape[:3], dtype=torch.float32)
    gate_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    backend = "naive" if q.dtype == torch.float64 else "torch"
    _, lse = forgetting_attention(q, k, k, log_fgate.to(gate_dtype), return_lse=True,
                                  backend=backend)
    return lse


def run(q, k, log_fgate, case, dtype, backend, given_lse, chunk=None):
    q, k = q.to(dtype), k.to(dtype)
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    log_fgate = None if log_fgate is None else log_fgate.to(gate_dtype)
    lse = forward_lse(q, k, log_fgate) if given_lse else None
    return attention_key_scores(q, k, log_fgate=log_fgate, lse=lse, alpha=case.alpha,
                                chunk_size=chunk, backend=backend)


def rel_err(x, ref):
    return (x.double() - ref).abs().max().item() / max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("given_lse", [False, True], ids=["lse_computed", "lse_given"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_float64_reference(case, given_lse):
    q, k, log_fgate = make_inputs(case)
    ref = reference(q, k, log_fgate, case.alpha)
    for backend in ("naive", "torch"):
        out = run(q, k, log_fgate, case, torch.float64, backend, given_lse, case.chunk)
        assert out.dtype == torch.float64 and out.shape == (case.b, case.t, case.h)
        assert rel_err(out, ref) < 1e-12, backend
    t32 = run(q, k, log_fgate, case, torch.float32, "torch", given_lse, case.chunk)
    n32 = run(q, k, log_fgate, case, torch.float32, "naive", given_lse)
    assert t32.dtype == torch.float32 and torch.isfinite(t32).all()
    assert rel_err(t32, ref) <= 2 * rel_err(n32, ref) + FLOOR_ULPS * F32_ULP


@pytest.mark.parametrize("gated", [False, True], ids=["softmax", "fox"])
@pytest.mark.parametrize("alpha", [1.0, 0.9, 0.0])
def test_column_sums(gated, alpha):
    """Every row of probabilities sums to 1, so sum_j A(j) = G sum_i alpha^(T-1-i) for
    each (batch, key head): T * G for H2O, G for alpha = 0."""
    case = Case(b=2, t=200, hq=6, h=2, gates="mixed" if gated else None, alpha=alpha, chunk=48)
    q, k, log_fgate = make_inputs(case, seed=3)
    expected = 3 * sum(alpha ** (case.t - 1 - i) for i in range(case.t))
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        a = run(q, k, log_fgate, case, dtype, "torch", given_lse=False, chunk=case.chunk)
        assert (a.double().sum(dim=1) - expected).abs().max().item() <= tol * expected
        assert (a >= 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype):
    """Half inputs are upcast and accumulated in float32; float32 scores come back,
    at most 2x the error of the naive op's half-precision logits."""
    case = Case(b=1, t=130, hq=4, h=2, alpha=0.9, chunk=40)
    q, k, log_fgate = make_inputs(case, seed=5)
    ref = reference(q.to(dtype), k.to(dtype), log_fgate, case.alpha)  # the rounded inputs
    out = run(q, k, log_fgate, case, dtype, "torch", given_lse=False, chunk=case.chunk)
    base = run(q, k, log_fgate, case, dtype, "naive", given_lse=False)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) <= 2 * rel_err(base, ref) + FLOOR_ULPS * F32_ULP


def test_auto_is_torch_on_cpu():
    q, k, log_fgate = make_inputs(Case(b=1, t=70, hq=4, h=2), seed=1)
    q, k, log_fgate = q.float(), k.float(), log_fgate.float()
    auto = attention_key_scores(q, k, log_fgate=log_fgate, alpha=0.8)
    torch_ = attention_key_scores(q, k, log_fgate=log_fgate, alpha=0.8, backend="torch")
    assert torch.equal(auto, torch_)


def test_scale_argument():
    q, k, _ = make_inputs(Case(b=1, t=40, hq=2, h=1, gates=None), seed=2)
    out = attention_key_scores(q, k, scale=0.05, backend="torch", chunk_size=16)
    assert rel_err(out, reference(q, k, None, 1.0, scale=0.05)) < 1e-12


def test_first_live_query_skips_only_vanishing_weights():
    """The queries skipped for alpha < 1 weigh below half float32's smallest subnormal,
    less a margin of e (their terms round to 0); at most one kept query does too."""
    cutoff = math.log(2.0**-150) - 1
    for alpha in (0.5, 0.9, 0.999, 1e-30):
        t = 1_000_000
        live = first_live_query(t, alpha, torch.float32)
        assert 0 < live < t - 1
        assert (t - 1 - (live - 1)) * math.log(alpha) < cutoff  # the last skipped query
        assert (t - 1 - (live + 1)) * math.log(alpha) >= cutoff  # the second kept query
    assert first_live_query(10, 1.0, torch.float32) == 0
    assert first_live_query(10, 0.0, torch.float32) == 9
    assert first_live_query(10, 0.5, torch.float32) == 0


class _LargestTensor(TorchFunctionMode):
    """Records the largest tensor any torch function returns inside the block."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.numel = max(self.numel, x.numel())
        return out


@pytest.mark.parametrize("gated", [False, True], ids=["softmax", "fox"])
def test_torch_backend_never_holds_t_by_t(gated):
    """Memory O(T x chunk): no tensor of the torch backend reaches T x T elements of one
    head (the tiles are HQ x chunk x chunk, the per-sequence copies T x HQ x D)."""
    case = Case(b=1, t=1024, hq=2, h=1, d=16, gates="mixed" if gated else None, chunk=32)
    q, k, log_fgate = make_inputs(case)
    q, k = q.float(), k.float()
    log_fgate = None if log_fgate is None else log_fgate.float()
    with _LargestTensor() as spy:
        attention_key_scores(q, k, log_fgate=log_fgate, chunk_size=32, backend="torch")
    assert 0 < spy.numel <= case.t * case.hq * case.d < case.t * case.t


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_CASES = [
    Case(b=1, t=63, hq=8, h=2, alpha=0.9, chunk=16),  # FoX, GQA, tiles not dividing T
    Case(b=1, t=257, hq=4, h=4, gates=None, chunk=None),  # softmax, MHA, default tiles
    Case(b=2, t=100, hq=4, h=2, gates="dead", alpha=0.0, chunk=32),
    Case(b=1, t=200, hq=4, h=1, gates=None, alpha=0.3, chunk=32),  # first ~110 rows skipped
]


@pytest.fixture
def _poison():
    from lapse.ops import scores_triton  # imports Triton

    scores_triton.POISON_OUTPUTS = True
    yield
    scores_triton.POISON_OUTPUTS = False


@pytest.mark.skipif(not triton_usable(torch.empty(0, device=DEVICE)),
                    reason="needs Triton on CUDA or TRITON_INTERPRET=1")
@pytest.mark.usefixtures("_poison")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("given_lse", [False, True], ids=["lse_computed", "lse_given"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: c.id)
def test_triton_matches_float64_reference(case, given_lse, dtype):
    """The Triton kernels (the interpreter on CPU), outputs and lse poisoned with NaN,
    held to 2x the naive op's error in the same dtype plus the floor."""
    q, k, log_fgate = make_inputs(case)
    ref = reference(q.to(dtype), k.to(dtype), log_fgate, case.alpha)  # the rounded inputs
    q, k = q.to(DEVICE), k.to(DEVICE)
    log_fgate = None if log_fgate is None else log_fgate.to(DEVICE)
    out = run(q, k, log_fgate, case, dtype, "triton", given_lse, case.chunk)
    base = run(q, k, log_fgate, case, dtype, "naive", given_lse)
    assert out.dtype == torch.float32 and out.shape == (case.b, case.t, case.h)
    assert torch.isfinite(out).all()
    err, base_err = rel_err(out.cpu(), ref), rel_err(base.cpu(), ref)
    assert err <= 2 * base_err + FLOOR_ULPS * F32_ULP, (err, base_err)


B, T, HQ, H, D = 2, 8, 4, 2, 16


def valid():
    g = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(B, T, HQ, D, generator=g),
        k=torch.randn(B, T, H, D, generator=g),
        log_fgate=F.logsigmoid(torch.randn(B, T, HQ, generator=g)),
        lse=torch.randn(B, HQ, T, generator=g),
        backend="torch",
    )


def with_(**changes):
    def make():
        a = valid()
        for name, change in changes.items():
            a[name] = change(a) if callable(change) else change
        return a

    return make


def _gate_value(value):
    def change(a):
        lf = a["log_fgate"].clone()
        lf[0, 3, 1] = value
        return lf

    return change


ERROR_CASES = [
    ("q-not-tensor", with_(q=lambda a: a["q"].tolist()), TypeError, "q must be a torch.Tensor"),
    ("k-not-tensor", with_(k=3), TypeError, "k must be a torch.Tensor"),
    ("q-rank3", with_(q=lambda a: a["q"][0]), ValueError, r"q must be \[batch, time, heads"),
    ("k-rank5", with_(k=lambda a: a["k"][None]), ValueError, r"k must be \[batch, time, heads"),
    ("q-int", with_(q=lambda a: a["q"].long()), TypeError, "q must be float16, bfloat16"),
    ("dtypes-differ", with_(k=lambda a: a["k"].double()), TypeError, "q and k must share a dtype"),
    ("k-time-differs", with_(k=lambda a: a["k"][:, :-1]), ValueError,
     r"k must be \[batch, time, kv_heads, head_dim\] with the batch and time of q"),
    ("k-batch-differs", with_(k=lambda a: a["k"][:1]), ValueError, "with the batch and time of q"),
    ("head-dims-differ", with_(k=lambda a: a["k"][..., :8]), ValueError,
     "k has head_dim 8 but q has head_dim 16"),
    ("heads-not-multiple", with_(k=lambda a: a["k"][:, :, :1].expand(-1, -1, 3, -1)),
     ValueError, r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    ("head-dim-300", with_(q=lambda a: a["q"].new_zeros(B, T, HQ, 300),
                           k=lambda a: a["k"].new_zeros(B, T, H, 300)),
     ValueError, r"head_dim must be in \[1, 256\]"),
    ("log_fgate-float16", with_(log_fgate=lambda a: a["log_fgate"].half()), TypeError,
     "log_fgate must be float32"),
    ("log_fgate-kv-heads", with_(log_fgate=lambda a: a["log_fgate"][..., :H]), ValueError,
     r"log_fgate must be \[batch, time, query_heads\] = \(2, 8, 4\)"),
    ("log_fgate-positive", with_(log_fgate=_gate_value(0.5)), ValueError,
     r"log_fgate must hold log forget gates in \[-inf, 0\]"),
    ("log_fgate-nan", with_(log_fgate=_gate_value(float("nan"))), ValueError,
     "positive or NaN"),
    ("lse-not-tensor", with_(lse=1.0), TypeError, "lse must be a torch.Tensor"),
    ("lse-time-major", with_(lse=lambda a: a["lse"].transpose(1, 2)), ValueError,
     r"lse must be \[batch, query_heads, time\] = \(2, 4, 8\)"),
    ("lse-float64", with_(lse=lambda a: a["lse"].double()), TypeError, "lse must be float32"),
    ("lse-other-device", with_(lse=lambda a: a["lse"].to("meta")), ValueError,
     "lse is on meta but q is on cpu"),
    ("alpha-above-1", with_(alpha=1.5), ValueError, r"alpha must be in \[0, 1\], got 1.5"),
    ("alpha-negative", with_(alpha=-0.1), ValueError, r"alpha must be in \[0, 1\]"),
    ("alpha-nan", with_(alpha=float("nan")), ValueError, r"alpha must be in \[0, 1\]"),
    ("alpha-tensor", with_(alpha=torch.tensor(0.5)), TypeError, "alpha must be a number"),
    ("alpha-bool", with_(alpha=True), TypeError, "alpha must be a number"),
    ("scale-zero", with_(scale=0.0), ValueError, "scale must be a positive finite number"),
    ("chunk-zero", with_(chunk_size=0), ValueError, "chunk_size must be None or a positive int"),
    ("chunk-float", with_(chunk_size=32.0), ValueError, "chunk_size must be None or a positive"),
    ("backend-unknown", with_(backend="cuda"), ValueError, "backend must be one of"),
    ("triton-chunk-not-power-of-2", with_(chunk_size=48, backend="triton"), ValueError,
     r"chunk_size on the triton backend must be a power of two in \[16, 256\], got 48"),
    ("triton-float64", with_(q=lambda a: a["q"].double(), k=lambda a: a["k"].double(),
                             log_fgate=None, lse=None, backend="triton"),
     TypeError, "backend='triton' takes float16, bfloat16 or float32"),
]


@pytest.mark.parametrize("make, error, pattern", [c[1:] for c in ERROR_CASES],
                         ids=[c[0] for c in ERROR_CASES])
def test_bad_input_raises(make, error, pattern):
    args = make()
    with pytest.raises(error, match=pattern):
        attention_key_scores(args.pop("q"), args.pop("k"), **args)


def test_float64_side_inputs_with_float64_q():
    """float64 gates and lse are accepted with float64 inputs (what forgetting_attention
    returns for them), nowhere else."""
    a = valid()
    q, k = a["q"].double(), a["k"].double()
    out = attention_key_scores(q, k, log_fgate=a["log_fgate"].double(),
                               lse=forward_lse(q, k, a["log_fgate"].double()), backend="torch")
    assert out.dtype == torch.float64


def test_empty_prompt():
    q, k = torch.randn(2, 0, 4, 8), torch.randn(2, 0, 2, 8)
    for backend in ("naive", "torch"):
        assert attention_key_scores(q, k, backend=backend).shape == (2, 0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gated", [False, True], ids=["softmax", "fox"])
@pytest.mark.parametrize("alpha", [1.0, 0.9])
def test_triton_on_cuda_at_prefill_size(gated, alpha):
    """bf16 at a real prompt size (B 2, T 4096, 12 heads over 4, D 64): the Triton kernels
    against the chunked torch path on the same GPU, both against float64 (the torch path
    run in float64 on the same rounded inputs), errors relative to the largest score."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, t, hq, h, d = 2, 4096, 12, 4, 64
    q = torch.randn(b, t, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(b, t, h, d, device="cuda", generator=g).to(torch.bfloat16)
    gate = F.logsigmoid(torch.randn(b, t, hq, device="cuda", generator=g) + 3) if gated else None
    ref = attention_key_scores(
        q.double(),
        k.double(),
        log_fgate=None if gate is None else gate.double(),
        alpha=alpha,
        backend="torch",
    )
    scale = ref.abs().max()
    errs = {}
    for backend in ("triton", "torch"):
        out = attention_key_scores(q, k, log_fgate=gate, alpha=alpha, backend=backend)
        assert torch.isfinite(out).all()
        errs[backend] = ((out.double() - ref).abs().max() / scale).item()
    print(
        f"gated={gated} alpha={alpha}: relative error triton {errs['triton']:.2e}, torch {errs['torch']:.2e}"
    )
    assert errs["triton"] <= 2 * errs["torch"] + FLOOR_ULPS * F32_ULP
