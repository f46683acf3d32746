"""``lapse.ops.paging.move_rows`` (a compaction's row copies): the Triton kernel (under
``TRITON_INTERPRET=1`` on CPU) against the torch path and against the copies written out
one row at a time, for pools of several dtypes and row widths (1, 3, 64 elements, one
not a power of two), with random disjoint moves of which only some are flagged: the
moving rows land, nothing else of any pool changes (the pools hold NaN in rows nobody
reads, to catch a copy that reads them)."""

from __future__ import annotations

import pytest
import torch

from lapse.ops.paging import move_rows

BACKENDS = ["torch", "triton"]


def pools_and_moves(pages=40, s=16, m=100, moving_share=0.3, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    rows = pages * s
    pools = [
        torch.randn(pages, s, 64, generator=gen).to(torch.bfloat16),
        torch.randint(-1000, 1000, (pages, s), generator=gen, dtype=torch.int32),
        torch.randn(pages, s, 3, generator=gen, dtype=torch.float64),
        torch.randn(pages, s, 1, generator=gen),
    ]
    perm = torch.randperm(rows, generator=gen)
    src, dst = perm[:m], perm[m : 2 * m]  # disjoint
    moving = (torch.rand(m, generator=gen) < moving_share).long()
    # rows that are neither a source nor a destination hold NaN where the dtype can
    untouched = perm[2 * m :]
    for pool in pools:
        if pool.is_floating_point():
            pool.view(rows, -1)[untouched] = float("nan")
    moves = torch.stack([src, dst, moving]).to(device)
    return [p.to(device) for p in pools], moves


def expected(pools, moves):
    out = [p.clone() for p in pools]
    for src, dst, moving in moves.t().tolist():
        if moving:
            for p, q in zip(out, pools, strict=True):
                p.view(-1, *p.shape[2:])[dst] = q.view(-1, *q.shape[2:])[src]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("m", "share"), [(1, 1.0), (100, 0.3), (300, 0.0), (257, 1.0)])
def test_moves_the_flagged_rows_and_nothing_else(backend, m, share):
    pools, moves = pools_and_moves(m=m, moving_share=share, seed=m)
    want = expected(pools, moves)
    move_rows(pools, moves, backend=backend)
    for got, ref in zip(pools, want, strict=True):
        assert torch.equal(got.isnan(), ref.isnan()) if got.is_floating_point() else True
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wide_and_empty_rows(backend):
    """Rows of 448 elements (CASTLE's ``u`` at G 7, D 64: fewer rows per program) and of
    none (nothing to copy)."""
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(12, 16, 7, 64, generator=gen)
    empty = torch.zeros(12, 16, 0)
    perm = torch.randperm(12 * 16, generator=gen)
    moves = torch.stack([perm[:40], perm[40:80], (torch.rand(40, generator=gen) < 0.5).long()])
    want = expected([wide], moves)[0]
    move_rows([wide, empty], moves, backend=backend)
    torch.testing.assert_close(wide, want, rtol=0, atol=0)


def test_no_moves_is_a_no_op():
    pools, moves = pools_and_moves()
    before = [p.clone() for p in pools]
    move_rows(pools, moves[:, :0].contiguous(), backend="triton")
    for got, ref in zip(pools, before, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


def test_bad_input():
    pools, moves = pools_and_moves()
    with pytest.raises(ValueError, match="int64"):
        move_rows(pools, moves.int())
    with pytest.raises(ValueError, match=r"\[3, M\]"):
        move_rows(pools, moves[:2])
    with pytest.raises(ValueError, match="contiguous in M"):
        move_rows(pools, moves.t().contiguous().t())
    with pytest.raises(ValueError, match="pools\\[0\\] must be contiguous"):
        move_rows([pools[0].transpose(0, 1)], moves)
    with pytest.raises(ValueError, match="pools\\[0\\] must be \\[P, S"):
        move_rows([torch.zeros(5)], moves)
    with pytest.raises(ValueError, match="backend"):
        move_rows(pools, moves, backend="naive")


@pytest.mark.gpu
def test_kernel_on_the_gpu_equals_the_reference():
    pools, moves = pools_and_moves(pages=4000, m=20000, device="cuda")
    want = [p.clone() for p in pools]
    move_rows(want, moves, backend="torch")
    move_rows(pools, moves, backend="triton")
    torch.cuda.synchronize()
    for got, ref in zip(pools, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
