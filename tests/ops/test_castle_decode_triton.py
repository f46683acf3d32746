"""The fused CASTLE decode step (Triton, interpreter on CPU) against the torch reference
and against a float64 recompute of the full-sequence CASTLE at the last token.

Each sequence of a ragged batch is written into a cache of spare capacity: ``u`` holds
``U^{t-1}`` (the lookahead keys before the new token, float32) and every slot the step
must not read holds NaN (slots at or past the length, ``u_t``, and ``q^U`` outside the
SWL window); the kernel's outputs and split workspace start as NaN. After the step the
unused capacity must still be NaN, and under SWL the rows before ``t - W`` unchanged bit
for bit.

Tolerances (STYLE principle 3): the kernel runs the reference's math (float32
arithmetic on the cache's dtype), so against the float64 oracle its error may be at most
2x the reference's plus a floor of 1e-7 (float32) / 1e-5 (float16) (measured: within
1.3x, at 2e-7 in float32 and 2e-4 in float16, the rounding of o); against the reference
itself, float32 agrees to ~1e-7 (only the order of sums differs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from castle_cases import rel

from lapse.ops.castle import castle_decode_step, castle_lookahead_keys, naive_castle_parallel
from lapse.ops.castle.decode_triton import _PIPELINE_SMEM, _launch_options, launch_castle_decode

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU tensors need TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.usefixtures("one_thread"),
]

NAN = float("nan")
SCALE = 0.3


@dataclass(frozen=True)
class Case:
    h: int = 4  # query heads (of q_c, q_u and u)
    hc: int = 2  # heads of k_c, v_c
    hu: int = 1  # heads of k_u, v_u
    d: int = 24
    lens: tuple[int, ...] = (1, 7, 37)  # held slots per sequence, the new token included
    capacity: int = 40
    window: int | None = None
    num_splits: int | None = None

    @property
    def id(self) -> str:
        lens = "_".join(map(str, self.lens))
        return (f"L{lens}-S{self.capacity}-H{self.h}-HC{self.hc}-HU{self.hu}-D{self.d}"
                f"-W{self.window}-splits{self.num_splits}")


CASES = [
    Case(),
    Case(window=1),
    Case(window=3, num_splits=4),
    Case(window=64),
    Case(h=3, hc=3, hu=3, d=48, lens=(5, 33), capacity=33, num_splits=3),
    Case(h=8, hc=2, hu=4, d=64, lens=(70,), capacity=100, window=5, num_splits=4),
    Case(h=2, hc=1, hu=2, d=16, lens=(2, 1), capacity=2, num_splits=1),
    Case(h=2, hc=2, hu=1, d=96, lens=(300, 129, 17), capacity=301, window=128),
]


def make_step(case: Case, dtype: torch.dtype, seed: int = 0):
    """The clean sequences (float32) and a cache ready for the step of each sequence's
    last token, in ``dtype`` (``u`` float32), NaN wherever the step must not read."""
    g = torch.Generator().manual_seed(seed)
    b, s, d = len(case.lens), case.capacity, case.d
    heads = dict(q_c=case.h, k_c=case.hc, v_c=case.hc, q_u=case.h, k_u=case.hu, v_u=case.hu)
    # rounded to dtype first, so the cache and the oracle hold the same numbers
    seq = {name: torch.randn(b, s, hh, d, generator=g).to(dtype).float() for name, hh in heads.items()}
    lens = torch.tensor(case.lens, dtype=torch.int32)
    u = torch.full((b, s, case.h, d), NAN)
    for i, n in enumerate(case.lens):
        if n > 1:  # U^{t-1}: the prefill of the tokens before the new one
            u[i, :n - 1] = castle_lookahead_keys(*(seq[x][i:i + 1, :n - 1] for x in ("q_u", "k_u", "v_u")),
                                                 scale=SCALE, window=case.window)[0].float()
    pos = torch.arange(s)
    unused = (pos[None, :] >= lens[:, None].long())[:, :, None, None]  # [B, S, 1, 1]
    qu_unread = unused
    if case.window is not None:  # q^U is read only where u changes
        qu_unread = unused | (pos[None, :] < lens[:, None].long() - 1 - case.window)[:, :, None, None]
    rows = torch.arange(b)
    last = lens.long() - 1
    cache = dict(
        u_cache=u,
        qu_cache=torch.where(qu_unread, NAN, seq["q_u"]).to(dtype),
        k_c_cache=torch.where(unused, NAN, seq["k_c"]).to(dtype),
        v_c_cache=torch.where(unused, NAN, seq["v_c"]).to(dtype),
    )
    cache["qu_cache"][rows, last] = NAN  # q^U_t is not needed by the step
    new = dict(q_c=seq["q_c"][rows, last].to(dtype), k_u=seq["k_u"][rows, last].to(dtype),
               v_u=seq["v_u"][rows, last].to(dtype))
    return seq, new, cache, lens


def run_step(new, cache, lens, case: Case, backend: str):
    """``(o, lse, u after)`` of one step on a copy of ``cache``."""
    u = cache["u_cache"].clone()
    o, lse = castle_decode_step(new["q_c"], new["k_u"], new["v_u"], u, cache["qu_cache"],
                                cache["k_c_cache"], cache["v_c_cache"], lens, scale=SCALE,
                                window=case.window, return_lse=True, num_splits=case.num_splits,
                                backend=backend)
    return o, lse, u


def oracle(seq, case: Case):
    """The float64 full-sequence CASTLE of each sequence at its last token: ``(o, lse)``."""
    os_, lses = [], []
    for i, n in enumerate(case.lens):
        six = [seq[x][i:i + 1, :n].double() for x in ("q_c", "k_c", "v_c", "q_u", "k_u", "v_u")]
        o, lse = naive_castle_parallel(*six, SCALE, case.window)
        os_.append(o[0, -1])
        lses.append(lse[0, :, -1])
    return torch.stack(os_), torch.stack(lses)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_equals_reference(case):
    seq, new, cache, lens = make_step(case, torch.float32)
    o_ref, lse_ref, u_ref = run_step(new, cache, lens, case, "torch")
    o, lse, u = run_step(new, cache, lens, case, "triton")
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert rel(o, o_ref) < 2e-6 and rel(lse, lse_ref) < 2e-6
    before = cache["u_cache"]
    for i, n in enumerate(case.lens):
        assert rel(u[i, :n], u_ref[i, :n]) < 2e-7
        assert torch.isnan(u[i, n:]).all(), "a slot past the length was written"
        assert torch.equal(u[i, n - 1], torch.zeros_like(u[i, n - 1]))  # u_t = 0
        if case.window is not None:  # rows before t - W are final: read, never written
            lo = max(0, n - 1 - case.window)
            assert torch.equal(u[i, :lo], before[i, :lo])
    # the cache after the step is the prefill of the whole sequence
    for i, n in enumerate(case.lens):
        full = castle_lookahead_keys(*(seq[x][i:i + 1, :n].double() for x in ("q_u", "k_u", "v_u")),
                                     scale=SCALE, window=case.window)[0]
        torch.testing.assert_close(u[i, :n].double(), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, floor", [(torch.float32, 1e-7), (torch.float16, 1e-5)],
                         ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_against_float64_full_sequence(case, dtype, floor):
    seq, new, cache, lens = make_step(case, dtype, seed=1)
    o64, lse64 = oracle(seq, case)
    o_ref, lse_ref, _ = run_step(new, cache, lens, case, "torch")
    o, lse, _ = run_step(new, cache, lens, case, "triton")
    for name, got, ref, want in (("o", o, o_ref, o64), ("lse", lse, lse_ref, lse64)):
        err, err_ref = rel(got, want), rel(ref, want)
        assert err <= 2 * err_ref + floor, f"{name}: {err:.2e} > 2 x {err_ref:.2e} + {floor:.0e}"


@pytest.mark.parametrize("num_splits, config", [(1, None), (3, None), (2, {"BN": 16, "num_warps": 2})],
                         ids=["splits1", "splits3", "splits2-BN16"])
def test_launch_writes_every_output(num_splits, config):
    """Outputs and split workspace poisoned with NaN: every element must be written (also
    with a tuning override of the tile)."""
    case = Case(window=3)
    _, new, cache, lens = make_step(case, torch.float32, seed=2)
    o_ref, lse_ref, _ = run_step(new, cache, lens, case, "torch")
    b, h, d = new["q_c"].shape
    o, lse = torch.full((b, h, d), NAN), torch.full((b, h), NAN)
    workspace = (torch.full((b, h, num_splits, d), NAN), torch.full((b, h, num_splits), NAN),
                 torch.full((b, h, num_splits), NAN))
    launch_castle_decode(new["q_c"], new["k_u"], new["v_u"], cache["u_cache"].clone(),
                         cache["qu_cache"], cache["k_c_cache"], cache["v_c_cache"], lens, SCALE,
                         case.window, o, lse, num_splits, workspace, config)
    assert rel(o, o_ref) < 2e-6 and rel(lse, lse_ref) < 2e-6


@pytest.mark.parametrize("b, group, d, window, want, dtype", [
    (8, 1, 64, None, dict(BN=64, num_warps=8, LOOP_STAGES=3), torch.bfloat16),  # measured best, full CASTLE
    (8, 1, 64, 512, dict(BN=32, num_warps=4, LOOP_STAGES=3), torch.bfloat16),  # SWL: the defaults
    (1, 1, 64, None, dict(BN=128, num_warps=8, LOOP_STAGES=1), torch.bfloat16),  # batch 1: no pipeline
    (4, 8, 128, None, dict(BN=16, num_warps=8, LOOP_STAGES=1), torch.bfloat16),  # 104 KiB: one fits
    (4, 4, 128, 64, dict(BN=16, num_warps=8, LOOP_STAGES=2), torch.bfloat16),  # 56 KiB: two
    (8, 1, 64, None, dict(BN=64, num_warps=8, LOOP_STAGES=2), torch.float32),  # 64 KiB: two
])
def test_launch_options_fit_shared_memory(b, group, d, window, want, dtype):
    """The launch options by shape (the measured choices, ``ops/castle/README.md``), and never
    more pipelined tiles than fit in shared
    memory: an H100 gives a program 227 KiB, and a GQA tile at D 128 takes 104 KiB; float32
    caches double the tile (the measured rule's 3 stages become 2)."""
    hc = 2
    q_c = torch.empty(b, hc * group, d)
    u = torch.empty(b, 64, hc * group, d)
    qu = torch.empty(b, 64, hc * group, d, dtype=dtype)
    kc = torch.empty(b, 64, hc, d, dtype=dtype)
    _, options = _launch_options(q_c, u, kc, qu, group, window, 1, None)
    assert {k: options[k] for k in want} == want
    size = dtype.itemsize
    tile = options["BN"] * options["BD"] * (options["BG"] * (4 + size) + 2 * size)
    assert options["LOOP_STAGES"] == 1 or options["LOOP_STAGES"] * tile <= _PIPELINE_SMEM


def test_step_compiles_with_the_kernel():
    """The custom op traces into one graph (fullgraph, no host reads) and mutates ``u``."""
    case = Case(window=None)
    _, new, cache, lens = make_step(case, torch.float32, seed=3)
    o_ref, _, u_ref = run_step(new, cache, lens, case, "torch")

    def step(q_c, k_u, v_u, u, qu, kc, vc, n):
        return castle_decode_step(q_c, k_u, v_u, u, qu, kc, vc, n, scale=SCALE, check_values=False,
                                  backend="triton")

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    u = cache["u_cache"].clone()
    o = compiled(new["q_c"], new["k_u"], new["v_u"], u, cache["qu_cache"], cache["k_c_cache"],
                 cache["v_c_cache"], lens)
    assert rel(o, o_ref) < 2e-6
    for i, n in enumerate(case.lens):
        assert rel(u[i, :n], u_ref[i, :n]) < 2e-7


@pytest.mark.parametrize("call, error, match", [
    (lambda a: castle_decode_step(*a, num_splits=0, backend="triton"), ValueError, "num_splits"),
    (lambda a: castle_decode_step(*a[:3], a[3].double(), *a[4:], backend="triton"), TypeError,
     "u_cache"),
    (lambda a: castle_decode_step(*a[:3], a[3].transpose(2, 3), *a[4:], backend="triton"),
     ValueError, "u_cache"),
    (lambda a: castle_decode_step(*a, window=0), ValueError, "window must be >= 1"),
], ids=["splits0", "u-float64", "u-strided", "window0"])
def test_step_errors(call, error, match):
    b, s, h, d = 2, 8, 2, 8
    a = (torch.zeros(b, h, d), torch.zeros(b, 1, d), torch.zeros(b, 1, d), torch.zeros(b, s, h, d),
         torch.zeros(b, s, h, d), torch.zeros(b, s, 1, d), torch.zeros(b, s, 1, d),
         torch.tensor([1, 4], dtype=torch.int32))
    with pytest.raises(error, match=match):
        call(a)
