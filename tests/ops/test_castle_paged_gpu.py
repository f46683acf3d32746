"""CASTLE's paged decode step on a GPU (``pytest -m gpu``): the Triton kernel against the
torch path and a float64 reference at 125M-like shapes (7 heads of 64, a few thousand
slots per head, bf16 pools, float32 ``u``), and the step under
``torch.compile(mode="reduce-overhead")`` against eager. Skipped without CUDA.

The store is built as ``test_castle_paged.py``'s: ragged lengths per (sequence, kv head)
(1 and page multiples among them), pages scattered through the pool, table entries past
a head's pages -1 or a free page's id, NaN in every slot no head holds, positions with
gaps (eviction). Tolerances: against float64, at most 2x the torch path's own bf16 error
plus a floor (``o`` is rounded to bf16); ``u`` is float32 arithmetic on the same inputs
in both paths (only the order of the dot products' sums differs).
"""

from __future__ import annotations

import copy

import pytest
import torch
from castle_cases import rel, time_ms

from lapse.ops.castle import castle_paged_decode_step

pytestmark = pytest.mark.gpu

D, PS = 64, 16
NAN = float("nan")


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _store(hq: int, h: int, hu: int, lens: list[list[int]], seed: int = 0) -> dict:
    """bf16 pools (``u`` float32) holding each (b, h)'s ``lens`` slots on scattered pages,
    NaN elsewhere, and the new token's ``q_c, k_u, v_u``."""
    g = torch.Generator().manual_seed(seed)
    b, grp = len(lens), hq // h
    n = torch.tensor(lens, dtype=torch.int32)  # [B, H]
    owned = (n.long() + PS - 1) // PS  # [B, H]
    max_pages = int(owned.max()) + 1
    total, free = int(owned.sum()), 24
    perm = torch.randperm(total + free, generator=g)
    table = torch.full((b, h, max_pages), -1, dtype=torch.int32)
    table[torch.arange(max_pages) < owned[..., None]] = perm[:total].to(torch.int32)
    stale = perm[total + torch.randint(free, (b, h), generator=g)].to(torch.int32)
    use_stale = torch.rand(b, h, generator=g) < 0.5
    table.scatter_(2, owned[..., None], torch.where(use_stale, stale, -1)[..., None])
    pool = total + free
    held = torch.zeros(pool * PS, dtype=torch.bool)
    pos = torch.full((pool * PS,), -7, dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            j = torch.arange(int(n[bi, hi]))
            rows = table[bi, hi].long()[j // PS] * PS + j % PS
            held[rows] = True
            pos[rows] = (torch.randint(1, 4, (len(j),), generator=g).cumsum(0) - 1).to(torch.int32)

    def pages(*shape, scale=1.0, dtype=torch.bfloat16):
        x = scale * torch.randn(pool * PS, *shape, generator=g)
        return torch.where(held.view(-1, *([1] * len(shape))), x, NAN).to(dtype).view(pool, PS, *shape)

    s = dict(k_pages=pages(D), v_pages=pages(D), u_pages=pages(grp, D, scale=0.5, dtype=torch.float32),
             qu_pages=pages(grp, D), page_table=table, lengths=n, pos_pages=pos.view(pool, PS),
             held=held.view(pool, PS), q_c=torch.randn(b, hq, D, generator=g).bfloat16(),
             k_u=torch.randn(b, hu, D, generator=g).bfloat16(),
             v_u=torch.randn(b, hu, D, generator=g).bfloat16())
    return {k: v.cuda() for k, v in s.items()}


def _step(s: dict, u: torch.Tensor, window, backend: str, dtype=None):
    cast = (lambda x: x.to(dtype)) if dtype is not None else (lambda x: x)
    return castle_paged_decode_step(
        cast(s["q_c"]), cast(s["k_u"]), cast(s["v_u"]), cast(s["k_pages"]), cast(s["v_pages"]), u,
        cast(s["qu_pages"]), s["page_table"], s["lengths"], pos_pages=s["pos_pages"], window=window,
        return_key_probs=True, check_values=False, backend=backend)


LENS = [[4096, 1, 3000, 4160, 129, 4095, 2048], [16, 3500, 4097, 64, 2000, 4100, 17]]
GQA_LENS = [[4096, 1], [3001, 4160]]


@pytest.mark.parametrize("window", [None, 256], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("heads", [(7, 7, 7), (8, 2, 4)], ids=["HQ7-H7-HU7", "HQ8-H2-HU4"])
def test_kernel_against_torch_and_float64_at_125m_shapes(heads, window):
    hq, h, hu = heads
    s = _store(hq, h, hu, LENS if h == 7 else GQA_LENS)
    u0 = s["u_pages"]
    o, p = _step(s, u := u0.clone(), window, "triton")
    o_auto, p_auto = _step(s, u_auto := u0.clone(), window, "auto")  # auto is the kernel on CUDA
    assert torch.equal(o_auto, o) and torch.equal(p_auto, p)
    torch.testing.assert_close(u_auto, u, rtol=0, atol=0, equal_nan=True)
    o_t, p_t = _step(s, u_t := u0.clone(), window, "torch")
    o_64, p_64 = _step(s, u_64 := u0.double(), window, "torch", torch.float64)
    held = s["held"]
    assert torch.isfinite(o).all() and torch.isfinite(p).all()
    assert torch.isnan(u[~held]).all(), "a slot no head holds was written"
    assert rel(o, o_t) < 4e-3 and rel(p, p_t) < 1e-4 and rel(u[held], u_t[held]) < 1e-5
    assert rel(o, o_64) <= 2 * rel(o_t, o_64) + 1e-3
    assert rel(p, p_64) <= 2 * rel(p_t, p_64) + 1e-5
    assert rel(u[held], u_64[held]) <= 2 * rel(u_t[held], u_64[held]) + 1e-6
    ms = {b: time_ms(lambda b=b: _step(s, u0.clone(), window, b)) for b in ("triton", "torch")}
    print(f"\ncastle paged step {heads} W{window}: triton {ms['triton']:.3f} ms, torch {ms['torch']:.3f} ms"
          " (both with a u clone)")


class _PagedStep(torch.nn.Module):
    """One layer's pools as buffers (static addresses for CUDA graphs), the step as forward."""

    def __init__(self, s: dict, window):
        super().__init__()
        for name in ("k_pages", "v_pages", "u_pages", "qu_pages", "pos_pages", "page_table"):
            self.register_buffer(name, s[name].clone())
        self.window = window

    def forward(self, q_c, k_u, v_u, lengths):
        return castle_paged_decode_step(
            q_c, k_u, v_u, self.k_pages, self.v_pages, self.u_pages, self.qu_pages, self.page_table, lengths,
            pos_pages=self.pos_pages, window=self.window, return_key_probs=True, check_values=False)


@pytest.mark.parametrize("window", [None, 256], ids=lambda w: f"W{w}")
def test_reduce_overhead_compiled_step_equals_eager(window):
    """The step (``auto``: the kernel) under torch.compile(mode="reduce-overhead",
    fullgraph=True) equals eager bit for bit, step after step: outputs, key probabilities
    and the ``u`` left in the pool (the same kernel on the same inputs, splits from shapes)."""
    torch._dynamo.reset()
    s = _store(7, 7, 7, LENS, seed=1)
    eager = _PagedStep(s, window)
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(2)
    lengths = s["lengths"].clone()
    for step in range(4):  # warm-up, recording, then replays with new tokens and lengths
        new = [torch.randn(x.shape, device="cuda", generator=g, dtype=torch.bfloat16)
               for x in (s["q_c"], s["k_u"], s["v_u"])]
        got = [t.clone() for t in compiled(*new, lengths)]  # the graph's outputs are reused
        expected = eager(*new, lengths)
        for g_, e in zip(got, expected, strict=True):
            assert torch.isfinite(g_).all(), step
            torch.testing.assert_close(g_, e, rtol=0, atol=0)
        torch.testing.assert_close(compiled_module.u_pages, eager.u_pages, rtol=0, atol=0, equal_nan=True)
        lengths = (lengths - 3).clamp_min(1)  # fewer slots: the pages in use stay valid
