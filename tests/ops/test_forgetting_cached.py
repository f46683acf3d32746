"""forgetting_attention_cached: T new tokens over a cache of (k, v, c) against the naive op.

Every backend is held to the float64 naive op over each whole sequence (its last T
rows), within 2x the error of the naive op run in the input's dtype plus a small floor
(plus, for a float32 ``c``, the bound of its rounding, as in test_forgetting_decode.py).
Cache slots past a sequence's length hold NaN, so a path that reads them fails. Also:
``cumulative_log_gates`` continuing a cached sequence, and the compiled call (CPU:
``aot_eager``; GPU: ``reduce-overhead``) against the eager one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

from lapse.ops.forgetting import (
    cumulative_log_gates,
    forgetting_attention_cached,
    forgetting_attention_decode,
    naive_forgetting_attention,
)

NAN = float("nan")

# the Triton cases use CPU tensors: they run under the interpreter (tests/conftest.py)
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need TRITON_INTERPRET=1"
)

# Triton's interpreter warns on its own scalar conversions; nothing to act on here.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@dataclass(frozen=True)
class Case:
    t: int = 5  # new tokens
    hq: int = 4
    h: int = 2
    d: int = 48
    lens: tuple[int, ...] = (5, 37, 64)  # cache_seqlens, the T new tokens included
    capacity: int = 80
    dtype: torch.dtype = torch.float32
    c_dtype: torch.dtype = torch.float64
    dead: bool = False  # some log gates are -inf
    backend: str = "torch"

    @property
    def id(self) -> str:
        dt = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16"}[self.dtype]
        c = "c64" if self.c_dtype == torch.float64 else "c32"
        tags = ["dead"] * self.dead
        shape = f"B{len(self.lens)}-T{self.t}-S{self.capacity}-HQ{self.hq}-H{self.h}-D{self.d}"
        return "-".join([shape, dt, c, *tags, self.backend])


def make_cache(case: Case, seed: int = 0):
    """Whole sequences (for the naive op) and the cache holding their first ``lens[b]``
    tokens, NaN in every slot past them; ``q`` are the queries of the last T tokens."""
    g = torch.Generator().manual_seed(seed)
    b, s, hq, h, d, t = len(case.lens), case.capacity, case.hq, case.h, case.d, case.t
    q_all = torch.randn(b, s, hq, d, generator=g, dtype=torch.float64).to(case.dtype)
    k = torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(case.dtype)
    v = torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(case.dtype)
    # gates from nearly 1 to nearly 0: some heads keep long memory, some forget at once
    log_fgate = torch.nn.functional.logsigmoid(3 * torch.randn(b, s, hq, generator=g) + 2)
    if case.dead:
        log_fgate[2, 40, 0] = -math.inf  # cuts off keys < 40 for the 64-long sequence
        log_fgate[1, case.lens[1] - 2, 1] = -math.inf  # inside the new tokens
    lens = torch.tensor(case.lens, dtype=torch.int32)
    c = cumulative_log_gates(log_fgate)  # [B, S, HQ] float64
    unread = torch.arange(s)[None, :] >= lens[:, None]  # [B, S]
    k_cache = torch.where(unread[:, :, None, None], NAN, k)
    v_cache = torch.where(unread[:, :, None, None], NAN, v)
    c_cache = torch.where(unread[:, :, None], NAN, c).to(case.c_dtype)
    slots = lens[:, None].long() - t + torch.arange(t)  # [B, T]
    q = torch.stack([q_all[i, slots[i]] for i in range(b)])  # [B, T, HQ, D]
    return dict(q=q, q_all=q_all, k=k, v=v, log_fgate=log_fgate, lens=lens,
                k_cache=k_cache, v_cache=v_cache, c_cache=c_cache)


def naive_cached(x, t: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The last ``t`` rows of the naive op over each sequence's first ``lens[b]`` tokens."""
    rows = []
    for i, n in enumerate(x["lens"].tolist()):
        q, k, v = (x[name][i : i + 1, :n].to(dtype) for name in ("q_all", "k", "v"))
        o, _ = naive_forgetting_attention(q, k, v, x["log_fgate"][i : i + 1, :n], scale)
        rows.append(o[0, n - t :])  # [T, HQ, D]
    return torch.stack(rows)  # [B, T, HQ, D]


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


CASES = [
    Case(),
    Case(t=1),
    Case(dtype=torch.float64),
    Case(t=1, dtype=torch.float64),
    Case(hq=8, h=1, dead=True),
    Case(t=1, hq=6, h=3, d=64, dead=True),
    Case(c_dtype=torch.float32),
    Case(t=1, hq=2, h=2, c_dtype=torch.float32, dead=True),
    Case(t=5, lens=(5, 5), capacity=5),  # a full cache, nothing before the new tokens
    pytest.param(Case(t=1, backend="triton"), marks=needs_interpreter),
    pytest.param(Case(t=1, hq=8, h=1, dead=True, backend="triton"), marks=needs_interpreter),
    pytest.param(Case(t=1, c_dtype=torch.float32, backend="triton"), marks=needs_interpreter),
    pytest.param(Case(t=5, backend="triton"), marks=needs_interpreter),  # T > 1: torch path
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cached_matches_naive(case):
    x = make_cache(case)
    scale = case.d**-0.5
    o = forgetting_attention_cached(
        x["q"], x["k_cache"], x["v_cache"], x["c_cache"], x["lens"], backend=case.backend
    )
    assert o.shape == x["q"].shape and o.dtype == case.dtype
    assert torch.isfinite(o).all()
    ref = naive_cached(x, case.t, scale, torch.float64)
    tol = 1e-12  # float64 throughout: measured below 1e-15
    if case.dtype != torch.float64:
        # the naive op in the input's dtype against itself in float64
        tol = 2 * max_err(naive_cached(x, case.t, scale, case.dtype), ref) + 1e-6
    if case.c_dtype == torch.float32:
        # A float32 c_j is off by at most eps/2 |c_j|, so each bias by eps max|c| (the
        # naive op has no such error: it sums the gates of each row itself); a bias error
        # e moves the softmax output by at most 2 e max|v|.
        c_max = x["c_cache"].double().nan_to_num(nan=0.0).abs().max().item()  # read slots
        tol += 2 * torch.finfo(torch.float32).eps * c_max * x["v"].abs().max().item()
    assert max_err(o, ref) <= tol, (max_err(o, ref), tol)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_one_token_is_the_decode_op(backend):
    x = make_cache(Case(t=1))
    args = (x["k_cache"], x["v_cache"], x["c_cache"], x["lens"])
    o = forgetting_attention_cached(x["q"], *args, scale=0.3, backend=backend)
    o_decode = forgetting_attention_decode(x["q"][:, 0], *args, scale=0.3, backend=backend)
    torch.testing.assert_close(o, o_decode[:, None], rtol=0, atol=0)


def test_cumulative_log_gates_continues_a_sequence():
    """c of a sequence cut in two: the second part continued from the first part's last
    c equals c of the whole (to rounding: the sum is regrouped), floors included."""
    g = torch.Generator().manual_seed(3)
    log_fgate = torch.nn.functional.logsigmoid(torch.randn(2, 30, 4, generator=g))
    log_fgate[1, 20, 2] = -math.inf
    whole = cumulative_log_gates(log_fgate)
    first = cumulative_log_gates(log_fgate[:, :12])
    second = cumulative_log_gates(log_fgate[:, 12:], initial=first[:, -1])
    assert second.dtype == torch.float64
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-14, atol=1e-12)
    # the model layer's formula, bit for bit
    expected = torch.cumsum(log_fgate[:, 12:].double().clamp_min(-1000.0), dim=1) + first[:, -1:]
    assert torch.equal(second, expected)
    as_f32 = cumulative_log_gates(log_fgate[:, 12:], initial=first[:, -1], dtype=torch.float32)
    assert as_f32.dtype == torch.float32 and torch.equal(as_f32, second.float())
    with pytest.raises(ValueError, match=r"initial must be \[batch, heads\]"):
        cumulative_log_gates(log_fgate, initial=first[:, -1, :2])


def _good_args():
    b, t, s, hq, h, d = 2, 3, 16, 4, 2, 8
    return dict(
        q=torch.randn(b, t, hq, d),
        k_cache=torch.randn(b, s, h, d),
        v_cache=torch.randn(b, s, h, d),
        c_cache=torch.zeros(b, s, hq, dtype=torch.float64),
        cache_seqlens=torch.tensor([3, 16], dtype=torch.int32),
    )


BAD_INPUTS = [
    ("q-rank", dict(q=torch.randn(2, 4, 8)), ValueError, r"q must be \[batch, new_tokens"),
    ("too-many-tokens", dict(q=torch.randn(2, 17, 4, 8)), ValueError, "q has 17 new tokens"),
    ("c-shape", dict(c_cache=torch.zeros(2, 16, 2)), ValueError, "c_cache must be"),
    ("seqlens-below-T", dict(cache_seqlens=torch.tensor([2, 16], dtype=torch.int32)),
     ValueError, r"cache_seqlens must be in \[3, capacity = 16\]"),
    ("backend", dict(backend="naive"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize(
    "changes, exc, match", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_inputs_raise(changes, exc, match):
    with pytest.raises(exc, match=match):
        forgetting_attention_cached(**(_good_args() | changes))


def _step(q, k_cache, v_cache, c_cache, lens, backend):
    # what a compiled decode step calls: no value checks, so no host sync
    return forgetting_attention_cached(q, k_cache, v_cache, c_cache, lens, backend=backend,
                                       check_values=False)


@pytest.mark.parametrize(
    "t, backend",
    [(1, "torch"), (5, "torch"), pytest.param(1, "triton", marks=needs_interpreter)],
)
def test_compiles_without_graph_breaks(t, backend):
    """fullgraph=True: Dynamo traces the checks, the torch path and the custom op."""
    torch._dynamo.reset()
    x = make_cache(Case(t=t, lens=(9, 37, 64)))
    args = (x["q"], x["k_cache"], x["v_cache"], x["c_cache"])
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    for lens in (x["lens"], x["lens"] - 2):  # the second call reuses the graph
        got = compiled(*args, lens, backend)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, _step(*args, lens, backend), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_decode_step_on_cuda(dtype):
    """The CUDA path under torch.compile(mode="reduce-overhead", fullgraph=True), i.e.
    replayed as a CUDA graph, equals eager exactly: the same kernels on the same inputs,
    with num_splits chosen from shapes only."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, hq, h, d = 4, 4096, 16, 4, 64
    k = torch.randn(b, s, h, d, device="cuda", generator=g, dtype=dtype)
    v = torch.randn(b, s, h, d, device="cuda", generator=g, dtype=dtype)
    lg = torch.nn.functional.logsigmoid(torch.randn(b, s, hq, device="cuda", generator=g) + 4)
    c = cumulative_log_gates(lg)  # [B, S, HQ] float64
    lens = torch.tensor([s, 1000, 1, 3001], dtype=torch.int32, device="cuda")
    compiled = torch.compile(_step, mode="reduce-overhead", fullgraph=True)
    for step in range(4):  # warm-up, recording, then replays with new queries and lengths
        q = torch.randn(b, 1, hq, d, device="cuda", generator=g, dtype=dtype)
        got = compiled(q, k, v, c, lens, "auto").clone()  # the graph's output is reused
        expected = _step(q, k, v, c, lens, "auto")
        assert torch.isfinite(got).all(), step
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        lens = (lens + 7).clamp_max(s)
