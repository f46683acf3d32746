"""forgetting_attention_decode: one query over a cache of (k, v, c) against the naive op.

The torch backend is held to the float64 naive prefill op (its last query row); the
Triton kernel (interpreter, float32/float16) to the float64 reference, within 2x the
error of the naive op run in the kernel's dtype plus a small floor. Cache slots that
must never be read hold NaN, and kernel outputs and workspace start as NaN.
"""



import math
import os
from dataclasses import dataclass

import pytest
import torch

from lapse.ops.forgetting import LOG_GATE_FLOOR, naive_forgetting_attention
from lapse.ops.forgetting.decode import _decode_torch, forgetting_attention_decode
from lapse.ops.forgetting.decode_triton import _choose_num_splits, _resident_programs, launch_decode

# the Triton tests below use CPU tensors: they run under the interpreter (tests/conftest.py)
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need TRITON_INTERPRET=1"
)

NAN = float("nan")

# Triton's interpreter warns on its own scalar conversions; nothing to act on here.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@dataclass(frozen=True)
class Case:
    hq: int = 4
    h: int = 2
    d: int = 48
    c_dtype: torch.dtype = torch.float64
    window: bool = False
    dead: bool = False  # some log gates are -inf
    lens: tuple[int, ...] = (1, 63, 200)
    capacity: int = 256

    @property
    def id(self) -> str:
        c = "c64" if self.c_dtype == torch.float64 else "c32"
        tags = ["win"] * self.window + ["dead"] * self.dead
        return "-".join(
            [f"B{len(self.lens)}-S{self.capacity}-HQ{self.hq}-H{self.h}-D{self.d}", c, *tags]
        )


def make_cache(case: Case, dtype: torch.dtype, seed: int = 0):
    """A random sequence per batch entry, written into a cache of capacity S.

    Returns the clean tensors (for the naive op) and the cache (the same values, with
    NaN in every slot the op must not read and c rounded to ``case.c_dtype``).
    """
    g = torch.Generator().manual_seed(seed)
    b, s, hq, h, d = len(case.lens), case.capacity, case.hq, case.h, case.d
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    k = torch.randn(b, s, h, d, generator=g).to(dtype)
    v = torch.randn(b, s, h, d, generator=g).to(dtype)
    # Gates from nearly 1 (log f ~ -1e-3) to nearly 0 (log f ~ -7), so some heads keep
    # long memory and some forget within a few tokens.
    log_fgate = torch.nn.functional.logsigmoid(3 * torch.randn(b, s, hq, generator=g) + 2)
    lens = torch.tensor(case.lens, dtype=torch.int32)
    if case.dead:
        log_fgate[-1, 150, 0] = -math.inf  # cuts off keys < 150 for the 200-long sequence
        log_fgate[-1, 30, hq - 1] = -math.inf
        log_fgate[1, case.lens[1] - 1, 1] = -math.inf  # the new token forgets everything
    c = torch.cumsum(log_fgate.double().clamp_min(LOG_GATE_FLOOR), dim=1)  # [B, S, HQ]

    if case.window:
        u = torch.rand(b, hq, generator=g)
        window_start = (u * lens[:, None].double()).long().clamp_max(lens[:, None] - 1)
        window_start[-1, 0] = lens[-1] - 1  # only the new token kept
        window_start = window_start.to(torch.int32)
    else:
        window_start = None

    pos = torch.arange(s)
    unread_kv = pos[None, :, None] >= lens[:, None, None]  # [B, S, 1]
    unread_c = unread_kv.expand(b, s, hq)
    if window_start is not None:
        first_kv = window_start.view(b, h, hq // h).amin(-1)  # [B, H] the group's first key
        unread_kv = unread_kv | (pos[None, :, None] < first_kv[:, None, :])  # [B, S, H]
        unread_c = unread_c | (pos[None, :, None] < window_start[:, None, :])  # [B, S, HQ]
    k_cache = torch.where(unread_kv[..., None], NAN, k).to(dtype)
    v_cache = torch.where(unread_kv[..., None], NAN, v).to(dtype)
    c_cache = torch.where(unread_c, NAN, c.to(case.c_dtype))
    return dict(
        q=q, k=k, v=v, log_fgate=log_fgate, lens=lens, window_start=window_start,
        k_cache=k_cache, v_cache=v_cache, c_cache=c_cache,
    )


def naive_decode(q, k, v, log_fgate, lens, window_start, scale):
    """The last row of the naive prefill op on each sequence's first ``lens[b]`` tokens."""
    os_, lses = [], []
    for b, n in enumerate(lens.tolist()):
        block_start = None if window_start is None else window_start[b : b + 1, :, None]
        o, lse = naive_forgetting_attention(
            q[b : b + 1, None], k[b : b + 1, :n], v[b : b + 1, :n], log_fgate[b : b + 1, :n],
            scale, block_start=block_start, block=1,
        )  # o [1, 1, HQ, D], lse [1, HQ, 1]
        os_.append(o[0, 0])
        lses.append(lse[0, :, 0])
    return torch.stack(os_), torch.stack(lses).double()  # [B, HQ, D], [B, HQ]


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


TORCH_CASES = [
    Case(),
    Case(hq=2, h=2, d=64),
    Case(d=64, window=True),
    Case(hq=2, h=2, d=48, window=True, dead=True),
    Case(d=48, dead=True),
    Case(hq=8, h=1, d=64, window=True),
    Case(c_dtype=torch.float32),
    Case(hq=2, h=2, d=64, c_dtype=torch.float32, window=True, dead=True),
]


@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: c.id)
def test_torch_backend_matches_naive(case):
    x = make_cache(case, torch.float64)
    scale = case.d**-0.5
    o, lse = forgetting_attention_decode(
        x["q"], x["k_cache"], x["v_cache"], x["c_cache"], x["lens"],
        window_start=x["window_start"], return_lse=True, backend="torch",
    )
    o_ref, lse_ref = naive_decode(
        x["q"], x["k"], x["v"], x["log_fgate"], x["lens"], x["window_start"], scale
    )
    assert o.dtype == torch.float64 and lse.dtype == torch.float32
    if case.c_dtype == torch.float64:
        o_tol, lse_tol = 1e-10, 1e-6  # lse is returned as float32
    else:
        # A float32 c_j is off by at most eps/2 |c_j|, so each bias by eps max|c|; a bias
        # error e moves the softmax output by at most 2 e max|v| and the lse by e.
        c_max = x["c_cache"].double().nan_to_num(nan=0.0).abs().max().item()  # read slots
        bias_err = torch.finfo(torch.float32).eps * c_max
        o_tol = 2 * bias_err * x["v"].abs().max().item() + 1e-10
        lse_tol = bias_err + 1e-6
    assert max_err(o, o_ref) <= o_tol, (max_err(o, o_ref), o_tol)
    assert max_err(lse, lse_ref) <= lse_tol, (max_err(lse, lse_ref), lse_tol)


def test_decode_steps_match_prefill():
    """Growing the cache one token at a time with c_t = c_{t-1} + r_t (SPEC section 1)
    reproduces every row of the prefill op."""
    g = torch.Generator().manual_seed(1)
    b, t, hq, h, d, s = 2, 40, 4, 2, 32, 48
    q = torch.randn(b, t, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    log_fgate = torch.nn.functional.logsigmoid(2 * torch.randn(b, t, hq, generator=g) + 1)
    o_prefill, _ = naive_forgetting_attention(q, k, v, log_fgate, d**-0.5)  # [B, T, HQ, D]
    k_cache = torch.full((b, s, h, d), NAN, dtype=torch.float64)
    v_cache = torch.full((b, s, h, d), NAN, dtype=torch.float64)
    c_cache = torch.full((b, s, hq), NAN, dtype=torch.float64)
    c_prev = torch.zeros(b, hq, dtype=torch.float64)
    for i in range(t):
        k_cache[:, i], v_cache[:, i] = k[:, i], v[:, i]
        c_prev = c_prev + log_fgate[:, i].double()
        c_cache[:, i] = c_prev
        lens = torch.full((b,), i + 1, dtype=torch.int32)
        o = forgetting_attention_decode(q[:, i], k_cache, v_cache, c_cache, lens, backend="torch")
        assert max_err(o, o_prefill[:, i]) <= 1e-10, i


def test_auto_backend_on_cpu_is_torch():
    x = make_cache(Case(window=True), torch.float32)
    args = (x["q"], x["k_cache"], x["v_cache"], x["c_cache"], x["lens"])
    o_auto = forgetting_attention_decode(*args, window_start=x["window_start"])
    o_torch = forgetting_attention_decode(*args, window_start=x["window_start"], backend="torch")
    torch.testing.assert_close(o_auto, o_torch, rtol=0, atol=0)


@dataclass(frozen=True)
class KernelCase:
    case: Case
    dtype: torch.dtype
    num_splits: int | None  # None: the launcher's choice
    slot_innermost_c: bool = False  # c as the DenseStore keeps it: [B, HQ, S] memory

    @property
    def id(self) -> str:
        dt = {torch.float32: "fp32", torch.float16: "fp16"}[self.dtype]
        layout = "-c_bhs" if self.slot_innermost_c else ""
        return f"{self.case.id}-{dt}-split{self.num_splits or 'auto'}{layout}"


KERNEL_CASES = [
    KernelCase(Case(), torch.float32, 1),
    KernelCase(Case(d=64, window=True), torch.float32, 3),
    KernelCase(Case(hq=8, h=1, d=48, c_dtype=torch.float32, window=True, dead=True),
               torch.float32, 2),
    KernelCase(Case(hq=2, h=2, d=48, c_dtype=torch.float32, window=True, dead=True),
               torch.float16, 4),
    KernelCase(Case(hq=8, h=1, d=64, dead=True), torch.float16, 3),
    KernelCase(Case(d=64, window=True), torch.float16, 1),
    KernelCase(Case(d=48, window=True, dead=True), torch.float16, 5),
    KernelCase(Case(hq=2, h=2, d=64, lens=(1, 63, 600), capacity=640), torch.float16, None),
    KernelCase(Case(hq=3, h=3, d=64, window=True, dead=True), torch.float16, 3, True),
    # one split over several BN-128 tiles after a window start
    KernelCase(Case(hq=3, h=3, d=64, window=True, lens=(1, 300, 600), capacity=640), torch.float16, 1),
    KernelCase(Case(hq=4, h=2, d=48, window=True), torch.float32, 2, True),
]


@pytest.mark.parametrize("kc", KERNEL_CASES, ids=lambda kc: kc.id)
@needs_interpreter
def test_triton_kernel_matches_reference(kc):
    case = kc.case
    x = make_cache(case, kc.dtype)
    if kc.slot_innermost_c:
        x["c_cache"] = x["c_cache"].transpose(1, 2).contiguous().transpose(1, 2)
    b, hq, d = x["q"].shape
    scale = d**-0.5
    num_splits = kc.num_splits
    if num_splits is None:  # what the launcher would choose, so the workspace fits
        tile_bytes = 2 * 64 * 64 * x["q"].element_size()
        num_splits = _choose_num_splits(
            case.capacity, b * case.h, _resident_programs(x["q"].device, tile_bytes)
        )
        assert num_splits > 1
    o = torch.full((b, hq, d), NAN, dtype=kc.dtype)
    lse = torch.full((b, hq), NAN)
    workspace = (
        torch.full((b, hq, num_splits, d), NAN),
        torch.full((b, hq, num_splits), NAN),
        torch.full((b, hq, num_splits), NAN),
    )
    launch_decode(
        x["q"], x["k_cache"], x["v_cache"], x["c_cache"], x["lens"], x["window_start"],
        scale, o, lse, num_splits, workspace,
    )
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()

    # Reference: float64 math on the same (rounded) inputs and the same cached c.
    f64 = {n: x[n].double() for n in ("q", "k_cache", "v_cache", "c_cache")}
    o_ref, lse_ref = _decode_torch(
        f64["q"], f64["k_cache"], f64["v_cache"], f64["c_cache"], x["lens"],
        x["window_start"], scale,
    )
    # Baselines, the stricter one counts: the naive op in the kernel's dtype against
    # itself in float64, and the torch backend (float32 math, output rounded to the
    # dtype) on the same cache against the float64 reference.
    args = (x["q"], x["k"], x["v"], x["log_fgate"], x["lens"], x["window_start"], scale)
    o_lo, lse_lo = naive_decode(*args)
    o_hi, lse_hi = naive_decode(*(a.double() if i < 3 else a for i, a in enumerate(args)))
    o_t, lse_t = _decode_torch(
        x["q"], x["k_cache"], x["v_cache"], x["c_cache"], x["lens"], x["window_start"], scale
    )
    floor = 1e-6 if kc.dtype == torch.float32 else 1e-4
    o_tol = 2 * min(max_err(o_lo, o_hi), max_err(o_t, o_ref)) + floor
    lse_tol = 2 * min(max_err(lse_lo, lse_hi), max_err(lse_t, lse_ref)) + 1e-6
    assert max_err(o, o_ref) <= o_tol, (max_err(o, o_ref), o_tol)
    assert max_err(lse, lse_ref) <= lse_tol, (max_err(lse, lse_ref), lse_tol)


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@needs_interpreter
def test_triton_kernel_without_bias_is_softmax_attention(dtype, num_splits):
    """``c_cache=None``: plain softmax attention over each row's first ``lens`` slots (the
    Transformer's step), against SDPA in float64 on the held keys, NaN in every slot the
    kernel must not read; the tuned launch options of the bias-free kernel (BN 128,
    4 stages) run under the interpreter too."""
    case = Case(hq=4, h=2, d=64, lens=(1, 63, 300), capacity=320, dead=True)
    x = make_cache(case, dtype)
    b, hq, d = x["q"].shape
    o, lse = forgetting_attention_decode(
        x["q"], x["k_cache"], x["v_cache"], None, x["lens"], return_lse=True,
        num_splits=num_splits, backend="triton",
    )
    o_t, lse_t = forgetting_attention_decode(
        x["q"], x["k_cache"], x["v_cache"], None, x["lens"], return_lse=True, backend="torch"
    )
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    for i, n in enumerate(case.lens):
        q = x["q"][i].double()[:, None]  # [HQ, 1, D]
        k = x["k"][i, :n].double().repeat_interleave(hq // case.h, 1).transpose(0, 1)  # [HQ, n, D]
        v = x["v"][i, :n].double().repeat_interleave(hq // case.h, 1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)[:, 0]  # [HQ, D]
        lse_ref = torch.logsumexp(q @ k.transpose(1, 2) * d**-0.5, -1)[:, 0]  # [HQ]
        # the torch path in float32 math, output rounded to the dtype, sets the scale
        floor = 1e-6 if dtype == torch.float32 else 1e-3
        tol = 2 * max_err(o_t[i], ref) + floor
        assert max_err(o[i], ref) <= tol, (i, max_err(o[i], ref), tol)
        assert max_err(lse[i], lse_ref) <= 2 * max_err(lse_t[i], lse_ref) + 1e-5


@needs_interpreter
def test_triton_public_function_writes_out():
    case = Case(hq=4, h=2, d=48, window=True, dead=True)
    x = make_cache(case, torch.float16)
    args = (x["q"], x["k_cache"], x["v_cache"], x["c_cache"], x["lens"])
    out = torch.full_like(x["q"], NAN)
    o, lse = forgetting_attention_decode(
        *args, window_start=x["window_start"], return_lse=True, out=out, num_splits=3,
        backend="triton",
    )
    assert o.data_ptr() == out.data_ptr()
    o_ref, lse_ref = forgetting_attention_decode(
        *args, window_start=x["window_start"], return_lse=True, backend="torch"
    )
    torch.testing.assert_close(o, o_ref, rtol=0, atol=2e-3)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=1e-5)


def _good_args():
    b, s, hq, h, d = 2, 16, 4, 2, 8
    return dict(
        q=torch.randn(b, hq, d),
        k_cache=torch.randn(b, s, h, d),
        v_cache=torch.randn(b, s, h, d),
        c_cache=torch.zeros(b, s, hq, dtype=torch.float64),
        cache_seqlens=torch.tensor([3, 16], dtype=torch.int32),
    )


BAD_INPUTS = [
    ("q-rank", dict(q=torch.randn(2, 1, 4, 8)), ValueError, "q must be"),
    ("k-rank", dict(k_cache=torch.randn(2, 16, 16)), ValueError, "k_cache must be"),
    ("v-shape", dict(v_cache=torch.randn(2, 15, 2, 8)), ValueError, "same shape"),
    ("gqa", dict(q=torch.randn(2, 3, 8)), ValueError, "multiple of key/value heads"),
    ("head-dim", dict(q=torch.randn(2, 4, 7)), ValueError, "head_dim"),
    ("kv-dtype", dict(k_cache=torch.randn(2, 16, 2, 8).half(),
                      v_cache=torch.randn(2, 16, 2, 8).half()), TypeError, "share a dtype"),
    ("c-dtype", dict(c_cache=torch.zeros(2, 16, 4, dtype=torch.float16)), TypeError,
     "c_cache must be float32 or float64"),
    ("c-shape", dict(c_cache=torch.zeros(2, 16, 2)), ValueError, "c_cache must be"),
    ("seqlens-dtype", dict(cache_seqlens=torch.tensor([3, 16])), ValueError,
     "cache_seqlens must be int32"),
    ("seqlens-shape", dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), ValueError,
     "cache_seqlens must be int32"),
    ("seqlens-zero", dict(cache_seqlens=torch.tensor([0, 16], dtype=torch.int32)), ValueError,
     r"cache_seqlens must be in \[1"),
    ("seqlens-over", dict(cache_seqlens=torch.tensor([3, 17], dtype=torch.int32)), ValueError,
     r"cache_seqlens must be in \[1"),
    ("window-shape", dict(window_start=torch.zeros(2, 2, dtype=torch.int32)), ValueError,
     "window_start must be int32"),
    ("window-dtype", dict(window_start=torch.zeros(2, 4, dtype=torch.int64)), ValueError,
     "window_start must be int32"),
    ("window-past-token", dict(window_start=torch.tensor([[0, 0, 3, 0], [0] * 4],
                                                         dtype=torch.int32)),
     ValueError, r"window_start must be in \[0"),
    ("window-negative", dict(window_start=torch.full((2, 4), -1, dtype=torch.int32)),
     ValueError, r"window_start must be in \[0"),
    ("not-tensor", dict(c_cache=[0.0]), TypeError, "c_cache must be a torch.Tensor"),
    ("scale", dict(scale=-1.0), ValueError, "scale must be"),
    ("backend", dict(backend="naive"), ValueError, "backend must be one of"),
    ("out-shape", dict(out=torch.empty(2, 4, 9)), ValueError, "out must be"),
    ("device", dict(cache_seqlens=torch.tensor([3, 16], dtype=torch.int32, device="meta")),
     ValueError, "cache_seqlens is on meta"),
    ("triton-float64", dict(q=torch.randn(2, 4, 8, dtype=torch.float64),
                            k_cache=torch.randn(2, 16, 2, 8, dtype=torch.float64),
                            v_cache=torch.randn(2, 16, 2, 8, dtype=torch.float64),
                            backend="triton"), TypeError, "float64"),
    ("num-splits", dict(num_splits=0, backend="triton"), ValueError, "num_splits"),
]


@pytest.mark.parametrize(
    "changes, exc, match", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_inputs_raise(changes, exc, match):
    args = _good_args() | changes
    with pytest.raises(exc, match=match):
        forgetting_attention_decode(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,h,d,s", [(32, 8, 128, 32768), (16, 16, 64, 4096), (8, 2, 96, 70001)])
def test_triton_decode_gpu(hq, h, d, s):
    """bf16 at realistic cache sizes: kernel vs the torch reference on the same cache,
    within 2x the reference's own error against float64 plus a floor."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(s)
    b = 4
    q = torch.randn(b, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
    lg = torch.nn.functional.logsigmoid(
        torch.randn(b, s, hq, device="cuda", generator=g) + 4).double()
    c = lg.clamp_min(LOG_GATE_FLOOR).cumsum(1)
    lens = torch.tensor([s, s // 2, 1, s - 17], dtype=torch.int32, device="cuda")
    start = (lens[:, None] - 1 - torch.randint(0, 3000, (b, hq), device="cuda", generator=g))
    start = start.clamp_min(0).to(torch.int32)
    out = torch.full_like(q, NAN)
    o = forgetting_attention_decode(q, k, v, c, lens, window_start=start, out=out,
                                    backend="triton")
    ref = forgetting_attention_decode(q.double(), k.double(), v.double(), c, lens,
                                      window_start=start, backend="torch")
    base = forgetting_attention_decode(q, k, v, c, lens, window_start=start, backend="torch")
    assert torch.isfinite(o).all()
    err, err_base = max_err(o, ref), max_err(base, ref)
    assert err <= 2 * err_base + 1e-3, (err, err_base)
