"""forgetting_attention_paged_decode: one query over a paged per-head store, FoX and softmax.

Every backend is held to a float64 reference written here (each head's keys taken in
logical order from the sequences the store was filled with, a softmax with the bias,
einsum), within 2x the error of the same math run in the input's dtype plus a small
floor (STYLE.md principle 3). The stores are awkward on purpose: lengths differ per
(sequence, kv head), 1 and exact page multiples among them; a head's pages are scattered
through a pool shared with the other heads; table entries past a head's pages are -1 or
the id of a free page; every pool slot no length covers holds NaN, as do the kernel's
workspace and outputs before the call, so a read or a write that should not happen shows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from lapse.ops.forgetting import (
    cumulative_log_gates,
    forgetting_attention_decode,
    forgetting_attention_paged_decode,
)
from lapse.ops.forgetting.decode_triton import _choose_num_splits, _resident_programs
from lapse.ops.forgetting.paged import _paged_decode_torch
from lapse.ops.forgetting.paged_triton import launch_paged_decode

NAN = float("nan")

# the Triton cases use CPU tensors: they run under the interpreter (tests/conftest.py)
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need TRITON_INTERPRET=1"
)

# Triton's interpreter warns on its own scalar conversions; nothing to act on here.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
               torch.float64: "fp64"}


@dataclass(frozen=True)
class Case:
    hq: int = 8
    h: int = 2
    d: int = 48
    lens: tuple[tuple[int, ...], ...] = ((1, 37), (32, 100))  # [B][H]
    page_size: int = 16
    max_pages: int = 8
    fox: bool = True
    c_dtype: torch.dtype = torch.float64
    free_pages: int = 5  # NaN pages in the pool that no head uses

    @property
    def id(self) -> str:
        b, s = len(self.lens), self.max_pages * self.page_size
        kind = ("fox-" + ("c64" if self.c_dtype == torch.float64 else "c32")) if self.fox else "softmax"
        return f"B{b}-L{s}-PS{self.page_size}-HQ{self.hq}-H{self.h}-D{self.d}-{kind}"


def make_store(case: Case, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """Random sequences per (sequence, kv head) and a paged store holding their first
    ``lens[b][h]`` tokens, with NaN in every pool slot the op must not read.

    Returns the sequences (``k``, ``v`` ``[B, H, L, D]``, ``c`` ``[B, H, L, G]`` in
    ``c_dtype``), the store's tensors and the op's arguments.
    """
    g = torch.Generator().manual_seed(seed)
    b, h, hq, d, ps = len(case.lens), case.h, case.hq, case.d, case.page_size
    grp, n_slots = hq // h, case.max_pages * ps
    lens = torch.tensor(case.lens, dtype=torch.int32)  # [B, H]
    q = torch.randn(b, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, h, n_slots, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, h, n_slots, d, generator=g, dtype=torch.float64).to(dtype)
    # gates from nearly 1 to nearly 0: some heads keep long memory, some forget at once
    log_fgate = torch.nn.functional.logsigmoid(3 * torch.randn(b * h, n_slots, grp, generator=g) + 2)
    c = cumulative_log_gates(log_fgate).reshape(b, h, n_slots, grp).to(case.c_dtype)

    # pages: a random permutation of the pool, so each head's pages are scattered and
    # interleaved with the other heads'; the last free_pages ids stay free (NaN)
    n_pages = (lens.long() + ps - 1) // ps  # [B, H]
    total = int(n_pages.sum())
    pool = total + case.free_pages
    perm = torch.randperm(pool, generator=g)
    in_use = torch.arange(case.max_pages) < n_pages[..., None]  # [B, H, MP]
    page_table = torch.full((b, h, case.max_pages), -1, dtype=torch.int32)
    page_table[in_use] = perm[:total].to(torch.int32)
    if case.free_pages:
        # the first entry past each head's pages names a free page (a stale id)
        stale = in_use.sum(-1, keepdim=True).clamp_max(case.max_pages - 1)  # [B, H, 1]
        full = in_use.all(-1, keepdim=True)
        free = perm[total + torch.randint(case.free_pages, (b, h, 1), generator=g)].to(torch.int32)
        page_table.scatter_(2, stale, torch.where(full, page_table.gather(2, stale), free))

    j = torch.arange(n_slots).expand(b, h, n_slots)  # [B, H, L]
    valid = j < lens[..., None]
    page = page_table.long().gather(2, j // ps)[valid]  # [N] pages of the held slots
    off = (j % ps)[valid]
    k_pages = torch.full((pool, ps, d), NAN, dtype=dtype)
    v_pages = torch.full((pool, ps, d), NAN, dtype=dtype)
    c_pages = torch.full((pool, ps, grp), NAN, dtype=case.c_dtype)
    k_pages[page, off], v_pages[page, off], c_pages[page, off] = k[valid], v[valid], c[valid]
    last = (lens.long() - 1)[..., None, None].expand(b, h, 1, grp)
    c_query = c.gather(2, last).reshape(b, hq)  # [B, HQ] the new token's c (slot len - 1)
    args = dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, lengths=lens)
    if case.fox:
        args |= dict(c_pages=c_pages, c_query=c_query)
    x = dict(k=k, v=v, c=c, c_query=c_query, args=args)
    return {n: t.to(device) for n, t in x.items() if n != "args"} | dict(
        args={n: t.to(device) for n, t in args.items()})


def reference(x, fox: bool, scale: float, dtype: torch.dtype = torch.float64):
    """Per (sequence, kv head): the first ``n`` keys of its sequence, a softmax with the
    bias ``c_t - c_j`` (taken in the stored ``c``'s dtype, then cast to ``dtype``: SPEC
    section 1, Numerics), all math in ``dtype``. Returns ``o [B, HQ, D]`` and
    ``key_probs [B, H, L]``, both float64."""
    q, lens = x["args"]["q"], x["args"]["lengths"]
    b, hq, d = q.shape
    h, n_slots = x["k"].shape[1], x["k"].shape[2]
    grp = hq // h
    o = torch.zeros(b, hq, d, dtype=torch.float64, device=q.device)
    probs = torch.zeros(b, h, n_slots, dtype=torch.float64, device=q.device)
    for i in range(b):
        for kv in range(h):
            n, rows = int(lens[i, kv]), slice(kv * grp, (kv + 1) * grp)
            k, v = x["k"][i, kv, :n].to(dtype), x["v"][i, kv, :n].to(dtype)  # [n, D]
            logits = torch.einsum("gd,nd->gn", q[i, rows].to(dtype), k) * scale  # [G, n]
            if fox:
                bias = x["c_query"][i, rows][:, None] - x["c"][i, kv, :n].T  # c's dtype
                logits = logits + bias.to(dtype)
            p = torch.softmax(logits, dim=-1)  # [G, n]
            o[i, rows] = torch.einsum("gn,nd->gd", p, v).double()
            probs[i, kv, :n] = p.double().sum(0)
    return o, probs


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


TORCH_CASES = [
    Case(),
    Case(d=64, fox=False),
    Case(hq=4, h=4, lens=((1, 16, 48, 128), (77, 2, 128, 33))),  # MHA, full tables
    Case(hq=4, h=4, d=64, fox=False, lens=((5, 128, 1, 64),)),
    Case(c_dtype=torch.float32),
    Case(hq=6, h=2, d=64, lens=((16,) * 2, (3, 120), (128, 1)), page_size=32, max_pages=4),
]


@pytest.mark.parametrize("backend", ["torch", "naive"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: c.id)
def test_torch_backends_match_reference(case, dtype, backend):
    x = make_store(case, dtype)
    scale = case.d**-0.5
    o, probs = forgetting_attention_paged_decode(**x["args"], return_key_probs=True,
                                                 backend=backend)
    assert o.dtype == dtype and probs.dtype == torch.float32
    assert probs.shape == (len(case.lens), case.h, case.max_pages * case.page_size)
    o_ref, p_ref = reference(x, case.fox, scale)
    if dtype == torch.float64:
        o_tol, p_tol = 1e-12, 1e-7  # key_probs are float32
    else:
        # the same math in float32 against float64
        o_lo, p_lo = reference(x, case.fox, scale, torch.float32)
        o_tol, p_tol = 2 * max_err(o_lo, o_ref) + 1e-6, 2 * max_err(p_lo, p_ref) + 1e-6
    assert max_err(o, o_ref) <= o_tol, (max_err(o, o_ref), o_tol)
    assert max_err(probs, p_ref) <= p_tol, (max_err(probs, p_ref), p_tol)
    # without the probabilities: the same numbers to the bit (a Dense policy's logits
    # equal the dense run's whether or not another run tracks scores)
    o_only = forgetting_attention_paged_decode(**x["args"], backend=backend)
    assert torch.equal(o_only, o)


@pytest.mark.parametrize("fox", [True, False], ids=["fox", "softmax"])
def test_key_probs_sum_over_the_group(fox):
    """Each (b, h) row holds G softmax rows summed: totals G, zeros past the length, and
    equal to the sum of the per-query-head probabilities that MHA over the same keys
    (each kv head repeated G times) gives."""
    case = Case(fox=fox)
    x = make_store(case, torch.float64)
    _, probs = forgetting_attention_paged_decode(**x["args"], return_key_probs=True,
                                                 backend="torch")
    b, h, n_slots = probs.shape
    grp = case.hq // case.h
    lens = x["args"]["lengths"].long()
    beyond = torch.arange(n_slots) >= lens[..., None]
    assert torch.equal(probs[beyond], torch.zeros_like(probs[beyond]))
    assert (probs[~beyond] > 0).all()
    torch.testing.assert_close(probs.double().sum(-1), torch.full((b, h), float(grp),
                               dtype=torch.float64), rtol=0, atol=1e-5)
    # MHA over the same keys: kv head h repeated for its G query heads. Query head
    # h * G + g reads copy g of the pool, whose one c channel is channel g of the original.
    a = x["args"]
    n_pool = a["k_pages"].shape[0]
    shift = (torch.arange(case.hq) % grp * n_pool).to(torch.int32)  # [HQ]
    table = a["page_table"].repeat_interleave(grp, 1)  # [B, HQ, MP]
    mha = dict(a, k_pages=a["k_pages"].repeat(grp, 1, 1), v_pages=a["v_pages"].repeat(grp, 1, 1),
               page_table=torch.where(table >= 0, table + shift[None, :, None], -1),
               lengths=a["lengths"].repeat_interleave(grp, 1))
    if fox:
        mha["c_pages"] = torch.cat([a["c_pages"][..., i : i + 1] for i in range(grp)])  # [G * P, PS, 1]
    o_mha, p_mha = forgetting_attention_paged_decode(**mha, return_key_probs=True, backend="torch")
    o, _ = forgetting_attention_paged_decode(**a, return_key_probs=True, backend="torch")
    torch.testing.assert_close(o_mha, o, rtol=0, atol=1e-12)
    torch.testing.assert_close(p_mha.reshape(b, h, grp, n_slots).sum(2), probs,
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "backend, dtype",
    [("torch", torch.float64), ("naive", torch.float64),
     pytest.param("triton", torch.float32, marks=needs_interpreter)],
)
def test_matches_dense_decode(backend, dtype):
    """Pages holding, for every kv head, the tokens of a dense cache give the dense op's
    output (``forgetting_attention_decode``, lengths per sequence)."""
    g = torch.Generator().manual_seed(2)
    b, s, hq, h, d, ps = 3, 96, 8, 2, 64, 16
    seqlens = torch.tensor([1, 48, 90], dtype=torch.int32)
    q = torch.randn(b, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(dtype)
    c = cumulative_log_gates(torch.nn.functional.logsigmoid(torch.randn(b, s, hq, generator=g) + 1))
    o_dense = forgetting_attention_decode(q, k, v, c, seqlens,
                                          backend="torch" if backend == "naive" else backend)

    # page p of (b, h) is pool page perm[(b * h_count + h) * pages + p]: scattered, shared pool
    pages = s // ps
    perm = torch.randperm(b * h * pages, generator=g)
    page_table = perm.reshape(b, h, pages).to(torch.int32)
    k_pages = torch.empty(b * h * pages, ps, d, dtype=dtype)
    v_pages = torch.empty_like(k_pages)
    c_pages = torch.empty(b * h * pages, ps, hq // h, dtype=torch.float64)
    k_pages[perm] = k.permute(0, 2, 1, 3).reshape(b * h * pages, ps, d)
    v_pages[perm] = v.permute(0, 2, 1, 3).reshape(b * h * pages, ps, d)
    c_pages[perm] = c.reshape(b, s, h, hq // h).transpose(1, 2).reshape(b * h * pages, ps, -1)
    lengths = seqlens[:, None].expand(b, h).contiguous()
    c_query = c[torch.arange(b), seqlens.long() - 1]  # [B, HQ]
    o_paged = forgetting_attention_paged_decode(
        q, k_pages, v_pages, page_table, lengths, c_pages=c_pages, c_query=c_query,
        backend=backend,
    )
    tol = 1e-12 if dtype == torch.float64 else 1e-6  # same math, other summation order
    torch.testing.assert_close(o_paged, o_dense, rtol=0, atol=tol)


def test_auto_backend_on_cpu_is_torch():
    x = make_store(Case(), torch.float32)
    o_auto = forgetting_attention_paged_decode(**x["args"])
    o_torch = forgetting_attention_paged_decode(**x["args"], backend="torch")
    torch.testing.assert_close(o_auto, o_torch, rtol=0, atol=0)


@dataclass(frozen=True)
class KernelCase:
    case: Case
    dtype: torch.dtype
    num_splits: int | None  # None: the launcher's choice

    @property
    def id(self) -> str:
        return f"{self.case.id}-{DTYPE_NAMES[self.dtype]}-split{self.num_splits or 'auto'}"


KERNEL_CASES = [
    KernelCase(Case(), torch.float32, 1),
    KernelCase(Case(d=64, fox=False), torch.float32, 3),
    KernelCase(Case(c_dtype=torch.float32), torch.float16, 2),
    KernelCase(Case(hq=4, h=4, d=64, lens=((1, 16, 48, 128),)), torch.float16, 1),
    KernelCase(Case(hq=4, h=4, fox=False, lens=((77, 2, 128, 33),)), torch.float16, 4),
    # one query head per kv head with the FoX bias (its [BN] vector path), several splits
    KernelCase(Case(hq=3, h=3, lens=((1, 16, 128), (77, 2, 33))), torch.float32, 3),
    # the same in fp16 at D 64: the tuned launch options (BN 128) over several splits
    KernelCase(Case(hq=3, h=3, d=64, lens=((1, 16, 128), (77, 2, 128)), max_pages=16), torch.float16, 2),
    # pages larger than a key tile
    KernelCase(Case(hq=6, h=2, lens=((3, 256), (128, 1)), page_size=128, max_pages=2),
               torch.float32, 2),
    # a table long enough that the launcher splits by itself
    KernelCase(Case(hq=2, h=1, d=64, lens=((600,), (1,)), max_pages=40), torch.float16, None),
]


@pytest.mark.parametrize("kc", KERNEL_CASES, ids=lambda kc: kc.id)
@needs_interpreter
def test_triton_kernel_matches_reference(kc):
    case, dtype = kc.case, kc.dtype
    x = make_store(case, dtype)
    a = x["args"]
    b, hq, d = a["q"].shape
    h, n_slots, grp = case.h, case.max_pages * case.page_size, case.hq // case.h
    scale = d**-0.5
    num_splits = kc.num_splits
    if num_splits is None:  # what the launcher would choose, so the workspace fits
        tile_bytes = 2 * 64 * 64 * a["q"].element_size()
        num_splits = _choose_num_splits(n_slots, b * h, _resident_programs(a["q"].device, tile_bytes))
        assert num_splits > 1
    o = torch.full((b, hq, d), NAN, dtype=dtype)
    lse = torch.full((b, hq), NAN)
    probs = torch.full((b, h, n_slots), NAN)
    workspace = (
        torch.full((b, hq, num_splits, d), NAN),
        torch.full((b, hq, num_splits), NAN),
        torch.full((b, hq, num_splits), NAN),
        torch.full((b, h, grp, n_slots), NAN),
    )
    launch_paged_decode(a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["lengths"],
                        a.get("c_pages"), a.get("c_query"), scale, o, lse, probs, num_splits,
                        workspace)
    assert torch.isfinite(o).all() and torch.isfinite(probs).all()

    # Reference: float64 math on the same (rounded) inputs and the same stored c.
    o_ref, p_ref = reference(x, case.fox, scale)
    # Baselines, the stricter one counts: the same math in the kernel's dtype, and the
    # torch backend (float32 math, output rounded to the dtype) on the same store.
    o_lo, p_lo = reference(x, case.fox, scale, dtype)
    o_t, p_t = _paged_decode_torch(a["q"], a["k_pages"], a["v_pages"], a["page_table"],
                                   a["lengths"], a.get("c_pages"), a.get("c_query"), scale, True)
    floor = 1e-6 if dtype == torch.float32 else 1e-4
    o_tol = 2 * min(max_err(o_lo, o_ref), max_err(o_t, o_ref)) + floor
    p_tol = 2 * min(max_err(p_lo, p_ref), max_err(p_t, p_ref)) + 1e-6
    assert max_err(o, o_ref) <= o_tol, (max_err(o, o_ref), o_tol)
    assert max_err(probs, p_ref) <= p_tol, (max_err(probs, p_ref), p_tol)
    beyond = torch.arange(n_slots) >= a["lengths"][..., None]
    assert (probs[beyond] == 0).all()


@needs_interpreter
@pytest.mark.parametrize("fox", [True, False], ids=["fox", "softmax"])
def test_triton_public_function(fox):
    x = make_store(Case(hq=4, h=2, d=48, fox=fox), torch.float16)
    o, probs = forgetting_attention_paged_decode(**x["args"], return_key_probs=True,
                                                 num_splits=3, backend="triton")
    o_ref, p_ref = forgetting_attention_paged_decode(**x["args"], return_key_probs=True,
                                                     backend="torch")
    assert o.dtype == torch.float16 and probs.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, rtol=0, atol=2e-3)
    torch.testing.assert_close(probs, p_ref, rtol=0, atol=1e-5)
    o_only = forgetting_attention_paged_decode(**x["args"], num_splits=3, backend="triton")
    torch.testing.assert_close(o_only, o, rtol=0, atol=0)


def _step(args, backend, return_key_probs):
    # what a compiled decode step calls: no value checks, so no host sync
    return forgetting_attention_paged_decode(**args, return_key_probs=return_key_probs,
                                             check_values=False, backend=backend)


@pytest.mark.parametrize(
    "backend, fox, return_key_probs",
    [("torch", True, True), ("torch", False, False), ("naive", True, True),
     pytest.param("triton", True, True, marks=needs_interpreter)],
)
def test_compiles_without_graph_breaks(backend, fox, return_key_probs):
    """fullgraph=True: Dynamo traces the checks, the torch path and the custom op."""
    torch._dynamo.reset()
    x = make_store(Case(fox=fox, lens=((9, 37), (32, 100))), torch.float32)
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    for shrink in (0, 5):  # the second call, with other lengths, reuses the graph
        args = dict(x["args"], lengths=x["args"]["lengths"] - shrink)
        got, expected = compiled(args, backend, return_key_probs), _step(args, backend,
                                                                          return_key_probs)
        if not return_key_probs:
            got, expected = (got,), (expected,)
        for g_, e in zip(got, expected, strict=True):
            assert torch.isfinite(g_).all()
            torch.testing.assert_close(g_, e, rtol=0, atol=0)


def _good_args():
    p, ps, d, b, h, hq = 6, 16, 8, 2, 2, 4
    return dict(
        q=torch.randn(b, hq, d),
        k_pages=torch.randn(p, ps, d),
        v_pages=torch.randn(p, ps, d),
        page_table=torch.tensor([[[0, 1], [2, -1]], [[3, -1], [4, 5]]], dtype=torch.int32),
        lengths=torch.tensor([[17, 3], [16, 32]], dtype=torch.int32),
        c_pages=torch.zeros(p, ps, hq // h, dtype=torch.float64),
        c_query=torch.zeros(b, hq, dtype=torch.float64),
    )


BAD_INPUTS = [
    ("q-rank", dict(q=torch.randn(2, 1, 4, 8)), ValueError, r"q must be \[batch, query_heads"),
    ("q-dtype", dict(q=torch.zeros(2, 4, 8, dtype=torch.int32)), TypeError, "q must be float16"),
    ("k-rank", dict(k_pages=torch.randn(6, 16, 1, 8)), ValueError, r"k_pages must be \[pages"),
    ("v-shape", dict(v_pages=torch.randn(6, 32, 8)), ValueError, "same shape"),
    ("kv-dtype", dict(k_pages=torch.randn(6, 16, 8).half(), v_pages=torch.randn(6, 16, 8).half()),
     TypeError, "share a dtype"),
    ("head-dim", dict(q=torch.randn(2, 4, 7)), ValueError, "has head_dim 8 but q has head_dim 7"),
    ("page-size", dict(k_pages=torch.randn(6, 24, 8), v_pages=torch.randn(6, 24, 8)), ValueError,
     "page_size"),
    ("page-size-small", dict(k_pages=torch.randn(6, 8, 8), v_pages=torch.randn(6, 8, 8)),
     ValueError, "page_size"),
    ("table-dtype", dict(page_table=torch.zeros(2, 2, 2, dtype=torch.int64)), ValueError,
     "page_table must be int32"),
    ("table-batch", dict(page_table=torch.zeros(3, 2, 2, dtype=torch.int32)), ValueError,
     "page_table has batch 3"),
    ("gqa", dict(page_table=torch.zeros(2, 3, 2, dtype=torch.int32)), ValueError,
     "multiple of key/value heads"),
    ("lengths-shape", dict(lengths=torch.tensor([17, 16], dtype=torch.int32)), ValueError,
     r"lengths must be int32 \[batch, kv_heads\]"),
    ("lengths-dtype", dict(lengths=torch.tensor([[17, 3], [16, 32]])), ValueError,
     "lengths must be int32"),
    ("lengths-zero", dict(lengths=torch.tensor([[17, 0], [16, 32]], dtype=torch.int32)),
     ValueError, r"lengths must be in \[1, max_pages \* page_size = 32\]"),
    ("lengths-over", dict(lengths=torch.tensor([[17, 3], [16, 33]], dtype=torch.int32)),
     ValueError, r"lengths must be in \[1"),
    ("page-unset", dict(lengths=torch.tensor([[17, 17], [16, 32]], dtype=torch.int32)),
     ValueError, r"page_table must hold page ids in \[0, pages = 6\).*got -1 at \[0, 1, 1\]"),
    ("page-out-of-pool", dict(page_table=torch.tensor([[[0, 6], [2, -1]], [[3, -1], [4, 5]]],
                                                      dtype=torch.int32)),
     ValueError, r"got 6 at \[0, 0, 1\]"),
    ("c-alone", dict(c_query=None), ValueError, "c_pages and c_query must be given together"),
    ("c-dtype", dict(c_pages=torch.zeros(6, 16, 2, dtype=torch.float16)), TypeError,
     "c_pages must be float32 or float64"),
    ("c-dtypes-differ", dict(c_query=torch.zeros(2, 4)), TypeError, "c_query must have"),
    ("c-shape", dict(c_pages=torch.zeros(6, 16, 4, dtype=torch.float64)), ValueError,
     r"c_pages must be \[pages, page_size, query_heads // kv_heads\]"),
    ("c-query-shape", dict(c_query=torch.zeros(2, 2, dtype=torch.float64)), ValueError,
     r"c_query must be \[batch, query_heads\]"),
    ("not-tensor", dict(page_table=[[0]]), TypeError, "page_table must be a torch.Tensor"),
    ("device", dict(lengths=torch.tensor([[17, 3], [16, 32]], dtype=torch.int32, device="meta")),
     ValueError, "lengths is on meta"),
    ("scale", dict(scale=0.0), ValueError, "scale must be"),
    ("backend", dict(backend="cuda"), ValueError, "backend must be one of"),
    ("num-splits", dict(num_splits=0), ValueError, "num_splits"),
    ("triton-float64", dict(q=torch.randn(2, 4, 8, dtype=torch.float64),
                            k_pages=torch.randn(6, 16, 8, dtype=torch.float64),
                            v_pages=torch.randn(6, 16, 8, dtype=torch.float64),
                            backend="triton"), TypeError, "float64"),
]


@pytest.mark.parametrize(
    "changes, exc, match", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_inputs_raise(changes, exc, match):
    with pytest.raises(exc, match=match):
        forgetting_attention_paged_decode(**(_good_args() | changes))


def test_good_args_pass_and_unchecked_values_are_not_read():
    """The base of the table above runs; with check_values=False nothing reads lengths
    or the table back (a meta tensor would fail to)."""
    forgetting_attention_paged_decode(**_good_args())
    meta = {n: t.to("meta") for n, t in _good_args().items()}
    o = forgetting_attention_paged_decode(**meta, check_values=False, backend="torch")
    assert o.shape == (2, 4, 8) and o.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.parametrize("fox", [True, False], ids=["fox", "softmax"])
def test_paged_decode_gpu_cuda_graph(fox):
    """bf16 at ~5k tokens per head: the kernel against the float64 reference within 2x the
    torch path's own bf16 error plus a floor; then the step under
    torch.compile(mode="reduce-overhead", fullgraph=True), i.e. replayed as a CUDA graph,
    equals eager exactly (the same kernels on the same inputs, splits from shapes only)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    lens = ((5000, 4097), (4096, 1))
    case = Case(hq=16, h=2, d=128, lens=lens, max_pages=320, fox=fox, free_pages=40)
    x = make_store(case, torch.bfloat16, device="cuda")
    a = x["args"]
    o, probs = forgetting_attention_paged_decode(**a, return_key_probs=True, backend="triton")
    ref_args = dict(a, q=a["q"].double(), k_pages=a["k_pages"].double(),
                    v_pages=a["v_pages"].double())
    o_ref, p_ref = forgetting_attention_paged_decode(**ref_args, return_key_probs=True,
                                                     backend="torch")
    o_base, p_base = forgetting_attention_paged_decode(**a, return_key_probs=True, backend="torch")
    assert torch.isfinite(o).all() and torch.isfinite(probs).all()
    assert max_err(o, o_ref) <= 2 * max_err(o_base, o_ref) + 1e-3
    assert max_err(probs, p_ref) <= 2 * max_err(p_base, p_ref) + 1e-5

    compiled = torch.compile(_step, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    lengths = a["lengths"].clone()
    for step in range(4):  # warm-up, recording, then replays with new queries and lengths
        args = dict(a, q=torch.randn(a["q"].shape, device="cuda", generator=g,
                                     dtype=torch.bfloat16), lengths=lengths)
        got = [t.clone() for t in compiled(args, "auto", True)]  # the graph's outputs are reused
        expected = _step(args, "auto", True)
        for g_, e in zip(got, expected, strict=True):
            assert torch.isfinite(g_).all(), step
            torch.testing.assert_close(g_, e, rtol=0, atol=0)
        lengths = (lengths - 3).clamp_min(1)  # fewer tokens: the pages in use stay valid
