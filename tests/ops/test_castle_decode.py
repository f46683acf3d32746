"""CASTLE decoding over a UQ-KV cache equals the parallel forward at every prefix.

Each sequence is prefilled (``castle_lookahead_keys`` and its ``q_u, k_c, v_c`` written
into slots), then decoded one token at a time with ``castle_decode_update`` and
``castle_attention_decode``; the output of every step is held against the row of the
parallel form (float64 oracle) at that position. The sequences of a batch have different
lengths, the caches have spare capacity filled with NaN, heads are grouped.
Float64 is held to 1e-12 relative; float32 (measured 2e-7 relative at most) to 2e-6, the
fused Triton step (``castle_decode_step``, interpreter) too.
"""

from __future__ import annotations

import os

import pytest
import torch
from castle_cases import Case, make_inputs, rel

from lapse.ops.castle import (
    castle_attention_decode,
    castle_decode_step,
    castle_decode_update,
    castle_lookahead_keys,
    naive_castle_parallel,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SCALE = 0.3


def _decode_all(xs, prefill, window, capacity, dtype, backend="reference"):
    """Outputs ``[B, T, H, D]`` of every position decoded after prefills of ``prefill[b]``
    tokens (rows before the prefill end are NaN), and the final U cache. ``backend``:
    the two reference functions, or ``castle_decode_step`` on a backend."""
    q_c, k_c, v_c, q_u, k_u, v_u = (x.to(dtype) for x in xs)
    b, t, h, d = q_c.shape
    nan = float("nan")
    u = torch.full((b, capacity, h, d), nan, dtype=dtype)
    qu_cache = torch.full_like(u, nan)
    kc_cache = torch.full((b, capacity, k_c.shape[2], d), nan, dtype=dtype)
    vc_cache = torch.full_like(kc_cache, nan)
    for i, n in enumerate(prefill):
        if n:
            u[i, :n] = castle_lookahead_keys(q_u[i:i + 1, :n], k_u[i:i + 1, :n], v_u[i:i + 1, :n],
                                             scale=SCALE, window=window)[0].to(dtype)
        qu_cache[i, :n], kc_cache[i, :n], vc_cache[i, :n] = q_u[i, :n], k_c[i, :n], v_c[i, :n]
    out = torch.full_like(q_c, nan)
    u_end = torch.full_like(u, nan)
    seqlens = torch.tensor(prefill, dtype=torch.int32)
    rows = torch.arange(b)
    for _ in range(t - min(prefill)):
        pos = seqlens.long().clamp_max(t - 1)  # a finished sequence repeats its last token
        qu_cache[rows, pos], kc_cache[rows, pos], vc_cache[rows, pos] = (
            q_u[rows, pos], k_c[rows, pos], v_c[rows, pos])
        seqlens = (pos + 1).to(torch.int32)
        u_before = u.clone()
        if backend == "reference":
            castle_decode_update(u, qu_cache, k_u[rows, pos], v_u[rows, pos], seqlens,
                                 scale=SCALE, window=window)
            o = castle_attention_decode(q_c[rows, pos], kc_cache, vc_cache, u, seqlens, scale=SCALE)
        else:
            o = castle_decode_step(q_c[rows, pos], k_u[rows, pos], v_u[rows, pos], u, qu_cache,
                                   kc_cache, vc_cache, seqlens, scale=SCALE, window=window,
                                   backend=backend)
        for i in range(b):
            p = int(pos[i])
            if not torch.isnan(out[i, p]).all():
                continue  # finished: the repeated token is not checked
            assert torch.equal(u[i, p], torch.zeros_like(u[i, p]))  # u_t = 0
            lo = 0 if window is None else max(0, p - window)
            untouched = u_before[i, :lo]  # SWL: rows before t - W are not changed
            assert torch.equal(u[i, :lo], untouched)
            out[i, p] = o[i]
            if p == t - 1:
                u_end[i] = u[i]
    return out, u_end


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("window", [None, 1, 3], ids=lambda w: f"W{w}")
def test_decode_equals_parallel_every_prefix(window, backend):
    """The two reference functions (float64 and float32), and the fused Triton step
    (interpreter, float32), token after token from ragged prefills."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    case = Case(b=3, t=23, h=4, hc=2, hu=1, d=24)
    xs, _, _ = make_inputs(case, seed=11)
    ref, _ = naive_castle_parallel(*(x.double() for x in xs), SCALE, window)
    prefill = [0, 5, 17]
    # the cache after the last token is the prefill of the whole sequence
    full = castle_lookahead_keys(*(x.double() for x in xs[3:]), scale=SCALE, window=window)
    if backend == "reference":
        got, u = _decode_all(xs, prefill, window, capacity=30, dtype=torch.float64)
        for i, n in enumerate(prefill):
            assert rel(got[i, n:], ref[i, n:]) < 1e-12
        torch.testing.assert_close(u[:, :case.t], full, rtol=1e-12, atol=1e-12)
    got32, u32 = _decode_all(xs, prefill, window, capacity=30, dtype=torch.float32, backend=backend)
    for i, n in enumerate(prefill):
        assert rel(got32[i, n:], ref[i, n:]) < 2e-6
    assert rel(u32[:, :case.t], full) < 1e-6


def test_u_is_kept_in_float32():
    """Why the UQ-KV cache keeps ``U`` in float32: it is a running sum updated at every
    step, so storing it in bfloat16 rounds it again each time and the error grows with
    the length. Over 1024 decoded tokens (unit-variance inputs, D = 64) the output drifts
    from the float64 decode by 6e-2 relative with a bfloat16 ``U`` (3.3e-1 at 4096; one
    rounding of the exact ``U`` costs only 1.7e-3), by 1.3e-6 with a float32 one."""
    t, h, d = 1024, 1, 64
    g = torch.Generator().manual_seed(0)
    q_u, k_u, v_u, q_c, k_c, v_c = (torch.randn(1, t, h, d, generator=g, dtype=torch.float64)
                                    for _ in range(6))
    n = torch.tensor([t], dtype=torch.int32)
    outs = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        u = torch.zeros(1, t, h, d, dtype=dtype)
        for i in range(t):
            castle_decode_update(u, q_u, k_u[:, i], v_u[:, i], torch.tensor([i + 1], dtype=torch.int32),
                                 scale=d**-0.5, check_values=False)
        outs[dtype] = castle_attention_decode(q_c[:, -1], k_c, v_c, u.double(), n, scale=d**-0.5)
    assert rel(outs[torch.float32], outs[torch.float64]) < 1e-5
    assert rel(outs[torch.bfloat16], outs[torch.float64]) > 1e-2


def test_decode_step_compiles_without_host_reads():
    """With check_values=False a step traces into one graph (no sync, static shapes)."""
    b, s, h, d = 2, 16, 2, 8
    g = torch.Generator().manual_seed(0)
    u, qu = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, d, generator=g)
    kc, vc = torch.randn(b, s, 1, d, generator=g), torch.randn(b, s, 1, d, generator=g)
    q, ku, vu = (torch.randn(b, h, d, generator=g) for _ in range(3))
    n = torch.tensor([3, 9], dtype=torch.int32)

    def step(u, qu, kc, vc, q, ku, vu, n):
        castle_decode_update(u, qu, ku, vu, n, window=4, check_values=False)
        castle_decode_update(u, qu, ku, vu, n, check_values=False)
        return castle_attention_decode(q, kc, vc, u, n, check_values=False)

    eager = step(u.clone(), qu, kc, vc, q, ku, vu, n)
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(u.clone(), qu, kc, vc, q, ku, vu, n), eager)


@pytest.mark.parametrize("call, error, match", [
    (lambda a: castle_decode_update(a["u"], a["qu"], a["ku"], a["vu"], a["n"], window=0),
     ValueError, "window must be >= 1"),
    (lambda a: castle_decode_update(a["u"], a["qu"][:, :, :1], a["ku"], a["vu"], a["n"]),
     ValueError, "same shape"),
    (lambda a: castle_decode_update(a["u"], a["qu"], a["ku"][:, :, :4], a["vu"][:, :, :4], a["n"]),
     ValueError, "head_dim"),
    (lambda a: castle_decode_update(a["u"], a["qu"], a["ku"], a["vu"], a["n"] + 20),
     ValueError, "cache_seqlens must be in"),
    (lambda a: castle_decode_update(a["u"], a["qu"], a["ku"], a["vu"], a["n"].long()),
     ValueError, "int32"),
    (lambda a: castle_attention_decode(a["q"], a["kc"], a["vc"], a["u"][:, :, :1], a["n"]),
     ValueError, "u_cache must be"),
    (lambda a: castle_attention_decode(a["q"].int(), a["kc"], a["vc"], a["u"], a["n"]),
     TypeError, "q_c must be float"),
    (lambda a: castle_attention_decode(a["q"], a["kc"], a["vc"][:, :, :, :4], a["u"], a["n"]),
     ValueError, "v_c_cache"),
], ids=["window0", "qu-heads", "ku-dim", "seqlens-range", "seqlens-dtype", "u-heads", "q-int",
        "vc-dim"])
def test_decode_errors(call, error, match):
    b, s, h, d = 2, 8, 2, 8
    a = dict(u=torch.zeros(b, s, h, d), qu=torch.zeros(b, s, h, d), ku=torch.zeros(b, 1, d),
             vu=torch.zeros(b, 1, d), n=torch.tensor([1, 4], dtype=torch.int32),
             q=torch.zeros(b, h, d), kc=torch.zeros(b, s, 1, d), vc=torch.zeros(b, s, 1, d))
    with pytest.raises(error, match=match):
        call(a)
