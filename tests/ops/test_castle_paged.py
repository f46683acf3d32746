"""castle_paged_decode_step: CASTLE's decode step over a paged per-kv-head UQ-KV store.

Every (sequence, kv head) is its own CASTLE problem (a group of ``G`` query heads, one
kv head), so the reference is the dense ``castle_decode_step`` run on each (b, h) alone
(B = 1, its own length), on the same tokens, for several consecutive steps: the outputs
of every step and the ``u`` held in the pages after it are compared. The store is
awkward on purpose: lengths differ per (b, kv head) (1 and page multiples among them);
a head's pages are scattered through a pool shared with the other heads; table entries
past a head's pages are -1 or a free page's id; every pool slot no length covers holds
NaN (``u`` of the new token too, which the step must set to 0), and must still hold it
after the step. With eviction a slot's index is not its position (``gaps``): the SWL
window then goes by the stored positions, and the reference is the update written out
here per slot, in float64, followed by the dense attention.

Tolerances: float64 to 1e-12 relative; in lower precision a backend's error against the
float64 reference may be at most 2x the dense step's error in the same dtype, plus a
floor of 1e-6. Measured (o, u): float64 3e-16, 1e-16; float32 1.3-1.6e-7 against the
dense step's 1.3-1.5e-7, u 7-8e-8 against 5-7e-8; bfloat16 inputs with a float32 ``u``
3.4-3.8e-3, the dense step's to 1e-8.

The Triton kernel (interpreter on CPU) runs the same steps, also with several splits
and without key probabilities: in float32 it equals the naive and torch backends up to
the order of sums (o, key_probs within 4e-7, u within 8e-8 after every step); against
float64 its error may be at most 2x the torch path's in the same dtype (u float32) plus
a floor (1e-7 float32, 1e-5 float16, 1e-4 bfloat16; u 1e-7). Measured (o; key_probs and
u equal the torch path's to two digits): float32 1.5-1.8e-7 against 1.3-3.3e-7, float16
4.4-4.7e-4 against the same, bfloat16 4.5-5.2e-3 against 3.4-4.0e-3 (1.3x: only the
rounding of o to bfloat16 differs, under the interpreter).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from lapse.ops.castle import (
    castle_attention_decode,
    castle_decode_step,
    castle_paged_decode_step,
    paged_triton,
)

pytestmark = pytest.mark.usefixtures("one_thread")
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="CPU tensors need TRITON_INTERPRET=1")

NAN = float("nan")
SCALE = 0.35


@dataclass(frozen=True)
class Case:
    hq: int = 4
    h: int = 2
    hu: int = 2  # lookahead kv heads (k_u, v_u)
    d: int = 24
    lens: tuple[tuple[int, ...], ...] = ((1, 30), (16, 45))  # held before the first step [B][H]
    steps: int = 4
    window: int | None = None
    gaps: bool = False  # positions with holes (tokens evicted between held ones)
    page_size: int = 16
    free_pages: int = 3

    @property
    def id(self) -> str:
        lens = "_".join("-".join(map(str, row)) for row in self.lens)
        return (f"L{lens}-HQ{self.hq}-H{self.h}-HU{self.hu}-D{self.d}-W{self.window}"
                + ("-gaps" if self.gaps else ""))


CASES = [
    Case(),
    Case(window=5),
    Case(hq=6, h=3, hu=1, d=17, lens=((15, 2, 32),), window=3),  # one lookahead head, odd D
    Case(hq=6, h=3, hu=3, lens=((3, 17, 1), (40, 8, 16)), window=64, gaps=True),
    Case(hq=4, h=1, hu=1, lens=((20,), (1,)), gaps=True),
    Case(window=4, gaps=True),
]


def make_problem(case: Case, seed: int = 0) -> dict:
    """Float64 tokens of every (b, kv head) for its held slots and the steps to come."""
    g = torch.Generator().manual_seed(seed)
    b, h, grp, d = len(case.lens), case.h, case.hq // case.h, case.d
    n_max = max(max(row) for row in case.lens) + case.steps

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    if case.gaps:  # increasing positions with holes of up to 3 evicted tokens
        pos = torch.randint(1, 5, (b, h, n_max), generator=g).cumsum(-1) - 1
    else:
        pos = torch.arange(n_max).expand(b, h, n_max)
    return dict(
        q_u=rnd(b, h, n_max, grp, d), k_c=rnd(b, h, n_max, d), v_c=rnd(b, h, n_max, d),
        u=0.5 * rnd(b, h, n_max, grp, d),  # the held slots' lookahead vectors before the first step
        pos=pos.contiguous(),
        q_c=rnd(case.steps, b, case.hq, d), k_u=rnd(case.steps, b, case.hu, d),
        v_u=rnd(case.steps, b, case.hu, d),
    )


def make_store(case: Case, x: dict, dtype: torch.dtype, u_dtype: torch.dtype, seed: int = 1) -> dict:
    """A pool holding each head's first ``lens`` slots, pages scattered, NaN elsewhere;
    each head owns pages for its final length, and its first table entry past them is
    stale (a free page) or -1."""
    g = torch.Generator().manual_seed(seed)
    b, h, grp, d, ps = len(case.lens), case.h, case.hq // case.h, case.d, case.page_size
    lens = torch.tensor(case.lens, dtype=torch.int32)  # [B, H]
    owned = (lens.long() + case.steps + ps - 1) // ps  # [B, H]
    max_pages = int(owned.max()) + 1
    total = int(owned.sum())
    pool = total + case.free_pages
    perm = torch.randperm(pool, generator=g)
    in_use = torch.arange(max_pages) < owned[..., None]  # [B, H, MP]
    table = torch.full((b, h, max_pages), -1, dtype=torch.int32)
    table[in_use] = perm[:total].to(torch.int32)
    stale = perm[total + torch.randint(case.free_pages, (b, h), generator=g)].to(torch.int32)
    use_stale = torch.rand(b, h, generator=g) < 0.7
    table.scatter_(2, owned[..., None], torch.where(use_stale, stale, -1)[..., None])
    store = dict(
        k_pages=torch.full((pool, ps, d), NAN, dtype=dtype),
        v_pages=torch.full((pool, ps, d), NAN, dtype=dtype),
        u_pages=torch.full((pool, ps, grp, d), NAN, dtype=u_dtype),
        qu_pages=torch.full((pool, ps, grp, d), NAN, dtype=dtype),
        pos_pages=torch.full((pool, ps), -12345, dtype=torch.int32), page_table=table, lengths=lens.clone(),
    )
    for bi in range(b):
        for hi in range(h):
            n = int(lens[bi, hi])
            write(store, x, bi, hi, slice(0, n), with_u=True)
    return store


def rows_of(store: dict, bi: int, hi: int, slots: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages and offsets of logical slots of (bi, hi)."""
    ps = store["k_pages"].shape[1]
    j = torch.arange(slots.start, slots.stop)
    return store["page_table"][bi, hi].long()[j // ps], j % ps


def write(store: dict, x: dict, bi: int, hi: int, slots: slice, with_u: bool) -> None:
    page, off = rows_of(store, bi, hi, slots)
    for pool, name in (("k_pages", "k_c"), ("v_pages", "v_c"), ("qu_pages", "q_u"), ("pos_pages", "pos")):
        store[pool][page, off] = x[name][bi, hi, slots].to(store[pool].dtype)
    store["u_pages"][page, off] = x["u"][bi, hi, slots].to(store["u_pages"].dtype) if with_u else NAN


def run_paged(case: Case, x: dict, dtype, u_dtype, backend: str, num_splits: int | None = None,
              key_probs: bool = True):
    """Outputs ``[steps, B, HQ, D]``, key probabilities ``[steps, B, H, L]`` (None without
    ``key_probs``) and each head's held ``u`` after every step (``[step][b][h]``, float64),
    checking after every step that no slot past a length was written."""
    store = make_store(case, x, dtype, u_dtype)
    outs, probs, u_steps = [], [], []
    for s in range(case.steps):
        for bi in range(len(case.lens)):
            for hi in range(case.h):
                n = int(store["lengths"][bi, hi])
                write(store, x, bi, hi, slice(n, n + 1), with_u=False)  # the new token, u = NaN
        store["lengths"] += 1
        out = castle_paged_decode_step(
            x["q_c"][s].to(dtype), x["k_u"][s].to(dtype), x["v_u"][s].to(dtype), store["k_pages"],
            store["v_pages"], store["u_pages"], store["qu_pages"], store["page_table"], store["lengths"],
            pos_pages=store["pos_pages"], scale=SCALE, window=case.window, return_key_probs=key_probs,
            num_splits=num_splits, backend=backend,
        )
        o, p = out if key_probs else (out, None)
        outs.append(o.double())
        if key_probs:
            probs.append(p.double())
        held = torch.zeros(store["k_pages"].shape[:2], dtype=torch.bool)
        for bi in range(len(case.lens)):
            for hi in range(case.h):
                held[rows_of(store, bi, hi, slice(0, int(store["lengths"][bi, hi])))] = True
        assert torch.isnan(store["u_pages"][~held]).all(), "a slot no head holds was written"
        u_steps.append([[store["u_pages"][rows_of(store, bi, hi, slice(0, int(store["lengths"][bi, hi])))]
                         .double() for hi in range(case.h)] for bi in range(len(case.lens))])
    return torch.stack(outs), (torch.stack(probs) if key_probs else None), u_steps


def run_reference(case: Case, x: dict, dtype, u_dtype):
    """Each (b, kv head) alone, with the dense step (or, with gaps, the update written out
    here over the stored positions, float64) over caches of its own slots; returns what
    :func:`run_paged` does, ``probs`` from the reference's own logits in float64."""
    b, h, grp, d = len(case.lens), case.h, case.hq // case.h, case.d
    n_max = x["k_c"].shape[2]
    width = max(-(-(n + case.steps) // case.page_size) for row in case.lens for n in row) + 1
    outs = torch.zeros(case.steps, b, case.hq, d, dtype=torch.float64)
    probs = torch.zeros(case.steps, b, h, width * case.page_size, dtype=torch.float64)
    u_steps = [[[None] * h for _ in range(b)] for _ in range(case.steps)]
    for bi in range(b):
        for hi in range(h):
            heads = slice(hi * grp, (hi + 1) * grp)
            n0 = case.lens[bi][hi]
            u = torch.full((1, n_max, grp, d), NAN, dtype=u_dtype)
            u[0, :n0] = x["u"][bi, hi, :n0].to(u_dtype)
            qu, kc, vc = (x[n][bi, hi][None].to(dtype) for n in ("q_u", "k_c", "v_c"))
            kc, vc = kc[:, :, None], vc[:, :, None]  # [1, S, 1, D]
            pos = x["pos"][bi, hi]
            for s in range(case.steps):
                n = n0 + s + 1
                u[0, n - 1] = NAN
                q_c = x["q_c"][s, bi, heads][None].to(dtype)  # [1, G, D]
                k_u = x["k_u"][s, bi].repeat_interleave(case.hq // case.hu, 0)[heads][None].to(dtype)
                v_u = x["v_u"][s, bi].repeat_interleave(case.hq // case.hu, 0)[heads][None].to(dtype)
                seqlens = torch.tensor([n], dtype=torch.int32)
                if not case.gaps:
                    outs[s, bi, heads] = castle_decode_step(
                        q_c, k_u, v_u, u, qu, kc, vc, seqlens, scale=SCALE, window=case.window,
                        backend="torch")[0].double()
                else:
                    w = torch.sigmoid(torch.einsum("ngd,gd->ng", qu[0, : n - 1].double(), k_u[0].double())
                                      * SCALE)  # [n - 1, G]
                    near = torch.ones(n - 1, dtype=torch.bool)
                    if case.window is not None:
                        near = pos[: n - 1] >= pos[n - 1] - case.window
                    inc = torch.where(near[:, None], w, 0.0)[..., None] * v_u[0].double()  # [n - 1, G, D]
                    new = u[0, : n - 1].double() + inc
                    u[0, : n - 1] = new.to(u_dtype)
                    u[0, n - 1] = 0.0
                    o = castle_attention_decode(q_c, kc, vc, u, seqlens, scale=SCALE)
                    outs[s, bi, heads] = o[0].double()
                qc = q_c[0].double()
                logits = (qc @ kc[0, :n, 0].double().T * SCALE
                          - F.silu(torch.einsum("gd,ngd->gn", qc, u[0, :n].double()) * SCALE))
                probs[s, bi, hi, :n] = torch.softmax(logits, -1).sum(0)
                u_steps[s][bi][hi] = u[0, :n].double().clone()  # u is updated in place
    return outs, probs, u_steps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _flat(u) -> torch.Tensor:
    """Every held ``u`` of nested ``[step][b][h]`` (or ``[b][h]``) lists, flattened."""
    return torch.cat([_flat(x) for x in u]) if isinstance(u, list) else u.flatten()


def u_rel(a, b) -> float:
    return rel(_flat(a), _flat(b))


@pytest.mark.parametrize("backend", ["naive", "torch"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_float64_equals_dense_step(case, backend):
    x = make_problem(case)
    o, p, u = run_paged(case, x, torch.float64, torch.float64, backend)
    o_ref, p_ref, u_ref = run_reference(case, x, torch.float64, torch.float64)
    assert rel(o, o_ref) < 1e-12
    assert rel(p, p_ref) < 1e-6  # key_probs are float32
    assert u_rel(u, u_ref) < 1e-12
    g = case.hq // case.h
    lens = torch.tensor(case.lens) + case.steps
    torch.testing.assert_close(p[-1].sum(-1), torch.full(lens.shape, float(g), dtype=torch.float64))


LOW = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("backend", ["naive", "torch"])
@pytest.mark.parametrize("dtypes", LOW, ids=["fp32", "bf16-u32"])
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: c.id)
def test_low_precision_within_twice_the_dense_error(case, dtypes, backend):
    x = make_problem(case)
    o64, p64, u64 = run_reference(case, x, torch.float64, torch.float64)
    o_base, _, u_base = run_reference(case, x, *dtypes)
    o, p, u = run_paged(case, x, *dtypes, backend)
    assert rel(o, o64) <= 2 * rel(o_base, o64) + 1e-6
    assert u_rel(u, u64) <= 2 * u_rel(u_base, u64) + 1e-6
    assert rel(p, p64) <= 2 * rel(o_base, o64) + 1e-5


def test_torch_path_equals_naive_bitwise_in_u():
    """The two backends add the same float32 increments into ``u``."""
    case = CASES[1]
    x = make_problem(case, seed=3)
    _, _, u_naive = run_paged(case, x, torch.float32, torch.float32, "naive")
    _, _, u_torch = run_paged(case, x, torch.float32, torch.float32, "torch")
    assert u_rel(u_torch, u_naive) < 1e-7


def _one_step_args(case: Case, dtype=torch.float32):
    x = make_problem(case)
    store = make_store(case, x, dtype, torch.float32)
    args = (x["q_c"][0].to(dtype), x["k_u"][0].to(dtype), x["v_u"][0].to(dtype), store["k_pages"],
            store["v_pages"], store["u_pages"], store["qu_pages"], store["page_table"], store["lengths"])
    return args, store


def test_compiles_fullgraph_and_matches_eager():
    """The torch path traces whole with fixed shapes (the whole table: no host read)."""
    case = CASES[3]
    args, store = _one_step_args(case)
    eager_u = store["u_pages"].clone()
    kw = dict(pos_pages=store["pos_pages"], scale=SCALE, window=case.window, return_key_probs=True,
              check_values=False, backend="torch")
    o, p = castle_paged_decode_step(*args[:5], eager_u, *args[6:], **kw)
    step = torch.compile(castle_paged_decode_step, backend="aot_eager", fullgraph=True)
    o_c, p_c = step(*args, **kw)
    torch.testing.assert_close(o_c, o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p_c, p, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(store["u_pages"], eager_u, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_errors():
    case = Case(window=3)
    args, store = _one_step_args(case)
    with pytest.raises(ValueError, match="pos_pages"):
        castle_paged_decode_step(*args, window=3)
    with pytest.raises(TypeError, match="u_pages must be float32 or float64"):
        castle_paged_decode_step(*args[:5], args[5].half(), *args[6:])
    with pytest.raises(ValueError, match="u_pages must be"):
        castle_paged_decode_step(*args[:5], args[5][..., :1, :], *args[6:])
    bad = args[8].clone()
    bad[0, 0] = 0
    with pytest.raises(ValueError, match="lengths must be in"):
        castle_paged_decode_step(*args[:8], bad)
    table = args[7].clone()
    table[0, 0, 0] = -1
    with pytest.raises(ValueError, match="page_table must hold page ids"):
        castle_paged_decode_step(*args[:7], table, args[8])
    with pytest.raises(ValueError, match="k_u"):
        castle_paged_decode_step(args[0], args[1][:, :1].expand(-1, 3, -1), *args[2:])


# The Triton kernel (interpreter on CPU). Beside CASES, a case whose heads are long enough
# for several non-empty splits (G = 4: tiles of 16 slots), with an SWL window over gaps.
LONG = Case(hq=8, h=2, hu=4, d=40, lens=((100, 1), (64, 130)), window=50, gaps=True, steps=3)
TRITON_CASES = [*CASES, LONG]


def _per_step_u_rel(a, b) -> float:
    """The largest relative error of the held ``u`` over the steps."""
    return max(u_rel(x, y) for x, y in zip(a, b, strict=True))


@needs_interpreter
@pytest.mark.parametrize("num_splits", [None, 3], ids=["splits-auto", "splits3"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: c.id)
def test_triton_equals_naive_and_torch(case, num_splits):
    """float32, step after step: ``o``, ``key_probs`` and the ``u`` left in the pages after
    every step agree with both other backends up to the order of sums (measured: o and
    key_probs within 3e-7, u within 1e-7)."""
    x = make_problem(case)
    f32 = torch.float32
    o, p, u = run_paged(case, x, f32, f32, "triton", num_splits)
    assert not torch.isnan(o).any() and not torch.isnan(p).any()
    for backend in ("naive", "torch"):
        o_ref, p_ref, u_ref = run_paged(case, x, f32, f32, backend)
        assert rel(o, o_ref) < 2e-6
        assert rel(p, p_ref) < 2e-6
        assert _per_step_u_rel(u, u_ref) < 5e-7
    lens = torch.tensor(case.lens) + case.steps
    torch.testing.assert_close(p[-1].sum(-1), torch.full(lens.shape, float(case.hq // case.h),
                                                         dtype=torch.float64), rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_without_key_probs(num_splits):
    """The same ``o`` and ``u`` without the probability pass (the logits not kept)."""
    x = make_problem(LONG)
    o, p, u = run_paged(LONG, x, torch.float32, torch.float32, "triton", num_splits)
    o_np, p_np, u_np = run_paged(LONG, x, torch.float32, torch.float32, "triton", num_splits,
                                 key_probs=False)
    assert p_np is None
    assert torch.equal(o_np, o)
    assert _per_step_u_rel(u_np, u) == 0.0


# floors where the baseline is itself at the rounding of the dtype: o is rounded to it
TRITON_LOW = [(torch.float32, 1e-7), (torch.float16, 1e-5), (torch.bfloat16, 1e-4)]


@needs_interpreter
@pytest.mark.parametrize("num_splits", [None, 3], ids=["splits-auto", "splits3"])
@pytest.mark.parametrize("dtype, floor", TRITON_LOW, ids=["fp32", "fp16-u32", "bf16-u32"])
@pytest.mark.parametrize("case", [CASES[0], CASES[3], LONG], ids=lambda c: c.id)
def test_triton_within_twice_the_torch_error(case, dtype, floor, num_splits):
    """Against the float64 reference, the kernel's error is at most 2x the torch path's in
    the same dtype (u float32) plus a floor: o, key_probs, and u after every step."""
    x = make_problem(case)
    o64, p64, u64 = run_reference(case, x, torch.float64, torch.float64)
    o_base, p_base, u_base = run_paged(case, x, dtype, torch.float32, "torch")
    o, p, u = run_paged(case, x, dtype, torch.float32, "triton", num_splits)
    assert rel(o, o64) <= 2 * rel(o_base, o64) + floor
    assert rel(p, p64[..., : p.shape[-1]]) <= 2 * rel(p_base, p64[..., : p.shape[-1]]) + floor
    for step in range(case.steps):
        err, err_base = u_rel(u[step], u64[step]), u_rel(u_base[step], u64[step])
        assert err <= 2 * err_base + 1e-7, f"step {step}: u {err:.2e} > 2 x {err_base:.2e}"


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_launch_writes_every_output(num_splits):
    """Outputs, split workspace and the logit scratch poisoned with NaN: every element of
    ``o``, ``lse`` and ``key_probs`` must be written, and nothing past a length read."""
    case = LONG
    args, store = _one_step_args(case)
    q_c, k_u, v_u, k_pages, v_pages, u_pages, qu_pages, table, lengths = args
    kw = dict(pos_pages=store["pos_pages"], scale=SCALE, window=case.window, return_key_probs=True)
    o_ref, p_ref = castle_paged_decode_step(*args[:5], u_pages.clone(), *args[6:], backend="torch", **kw)
    b, hq, d = q_c.shape
    h, n_slots = case.h, table.shape[-1] * case.page_size
    o, lse, probs = torch.full((b, hq, d), NAN), torch.full((b, hq), NAN), torch.full((b, h, n_slots), NAN)
    workspace = (torch.full((b, hq, num_splits, d), NAN), torch.full((b, hq, num_splits), NAN),
                 torch.full((b, hq, num_splits), NAN), torch.full((b, h, hq // h, n_slots), NAN))
    paged_triton.launch_castle_paged_decode(q_c, k_u, v_u, k_pages, v_pages, u_pages.clone(), qu_pages,
                                            store["pos_pages"], table, lengths, SCALE, case.window, o, lse,
                                            probs, num_splits, workspace)
    assert not torch.isnan(lse).any()
    assert rel(o, o_ref) < 2e-6 and rel(probs, p_ref) < 2e-6


@needs_interpreter
def test_triton_compiles_fullgraph_through_the_custom_op(monkeypatch):
    """One graph (aot_eager, fullgraph, no host read) that calls the kernel once through
    ``lapse::castle_paged_decode`` and mutates ``u_pages`` as the eager call does."""
    case = CASES[3]
    args, store = _one_step_args(case)
    kw = dict(pos_pages=store["pos_pages"], scale=SCALE, window=case.window, return_key_probs=True,
              check_values=False, num_splits=2, backend="triton")
    eager_u = store["u_pages"].clone()
    o, p = castle_paged_decode_step(*args[:5], eager_u, *args[6:], **kw)
    launches = []
    launch = paged_triton.launch_castle_paged_decode
    monkeypatch.setattr(paged_triton, "launch_castle_paged_decode",
                        lambda *a, **k: launches.append(1) or launch(*a, **k))
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(castle_paged_decode_step, backend=counter, fullgraph=True)
    o_c, p_c = step(*args, **kw)
    assert counter.frame_count == 1 and len(launches) == 1
    torch.testing.assert_close(o_c, o, rtol=0, atol=0)
    torch.testing.assert_close(p_c, p, rtol=0, atol=0)
    torch.testing.assert_close(store["u_pages"], eager_u, rtol=0, atol=0, equal_nan=True)


@needs_interpreter
def test_triton_errors():
    case = Case(window=3)
    args, store = _one_step_args(case)
    kw = dict(pos_pages=store["pos_pages"], window=3, backend="triton")
    with pytest.raises(TypeError, match="float32 u_pages"):
        castle_paged_decode_step(*args[:5], args[5].double(), *args[6:], **kw)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        castle_paged_decode_step(args[0].double(), *args[1:], **kw)
    with pytest.raises(TypeError, match="qu_pages float64"):
        castle_paged_decode_step(*args[:6], args[6].double(), *args[7:], **kw)
    for bad in (0, 129, 2.0, True):
        with pytest.raises(ValueError, match="num_splits"):
            castle_paged_decode_step(*args, num_splits=bad, **kw)
    b, d = args[0].shape[0], 264
    big = (torch.zeros(b, case.hq, d), torch.zeros(b, case.hu, d), torch.zeros(b, case.hu, d),
           torch.zeros(4, 16, d), torch.zeros(4, 16, d), torch.zeros(4, 16, case.hq // case.h, d),
           torch.zeros(4, 16, case.hq // case.h, d), args[7].clamp(0, 3), torch.ones_like(args[8]))
    with pytest.raises(ValueError, match="head_dim up to 256"):
        castle_paged_decode_step(*big, backend="triton")
