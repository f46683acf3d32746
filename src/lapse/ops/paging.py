"""Page-table helpers that the paged store (``lapse.kv.PagedStore``) and the paged ops'
torch paths share: where each logical slot of a table lives (:func:`slot_index`), and the
row copies a compaction makes (:func:`move_rows`: each kept slot past a head's new length
fills a dropped slot below it).

A compaction proposes one candidate move per slot of the table (``[B * H * W]``: source
row, destination row, whether it moves) and only a few move. The torch path selects the
moving ones first (``nonzero``: one wait for the device) and copies them with
``index_select`` + ``index_copy_``; the Triton kernel reads the flags itself and copies
the moving rows only, so the host never waits for the device (H100, a DCP pass over 5
layers at 64 x 1536: the per-layer wait and the 10 small copies were most of the pass's
~10 ms of host time against ~0.7 ms of device work).

Sources and destinations must be disjoint (no row both read and written), as a
compaction's are: the kernel copies all rows at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .backend import check_backend, resolve_backend, tl, triton, triton_jit

BLOCK = 128  # candidate moves per program (rows of up to ROW_ELEMENTS / BLOCK elements)
ROW_ELEMENTS = 16384  # elements one program moves at most


def slot_index(
    table: Tensor, lengths: Tensor, n_pages: int, width: int, page_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Page and offset of the first ``width`` logical slots of every head ``[B, H, W]`` (the
    scratch page, the pool's last of ``n_pages``, where the head owns none: writes through
    it hit no other head's slot), and whether each is below the head's length."""
    slots = torch.arange(width, device=lengths.device)  # [W]
    table = table.long()
    table = torch.where(table < 0, n_pages - 1, table)  # [B, H, W/S]: unowned -> scratch
    pages = table[:, :, slots // page_size]  # [B, H, W]
    valid = slots < lengths[..., None].long()
    return pages, (slots % page_size).expand_as(pages), valid


def _check(pools: Sequence[Tensor], moves: Tensor) -> None:
    if moves.dim() != 2 or moves.shape[0] != 3 or moves.dtype != torch.int64 or moves.stride(1) != 1:
        raise ValueError(
            f"moves must be int64 [3, M] (source, destination, moving), contiguous in M, got {moves.dtype} "
            f"{tuple(moves.shape)}"
        )
    for i, pool in enumerate(pools):
        if pool.dim() < 2:
            raise ValueError(f"pools[{i}] must be [P, S, ...] (pages, slots), got shape {tuple(pool.shape)}")
        if not pool.is_contiguous():
            raise ValueError(f"pools[{i}] must be contiguous")
        if pool.device != moves.device:
            raise ValueError(f"pools[{i}] is on {pool.device} but moves are on {moves.device}")


def _move_torch(pools: Sequence[Tensor], moves: Tensor) -> None:
    src, dst, moving = moves
    chosen = moving.nonzero().squeeze(1)  # the host waits for the device here
    if not len(chosen):
        return
    src, dst = src[chosen], dst[chosen]
    for pool in pools:
        flat = pool.view(pool.shape[0] * pool.shape[1], *pool.shape[2:])
        flat.index_copy_(0, dst, flat.index_select(0, src))


@triton_jit
def _move_kernel(pool_ptr, moves_ptr, stride_m, m, X: tl.constexpr, BX: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: 2 * stride_m + o below
    in_range = o < m
    moving = tl.load(moves_ptr + 2 * stride_m + o, mask=in_range, other=0) != 0
    src = tl.load(moves_ptr + o, mask=moving, other=0)
    dst = tl.load(moves_ptr + stride_m + o, mask=moving, other=0)
    ox = tl.arange(0, BX)
    mask = moving[:, None] & (ox < X)[None, :]
    rows = tl.load(pool_ptr + src[:, None] * X + ox[None, :], mask=mask)
    tl.store(pool_ptr + dst[:, None] * X + ox[None, :], rows, mask=mask)


def move_rows(pools: Sequence[Tensor], moves: Tensor, *, backend: str = "auto") -> None:
    """Copies, in place, row ``moves[0, i]`` of each pool seen as ``[P * S, ...]`` to row
    ``moves[1, i]`` wherever ``moves[2, i]`` is nonzero.

    Args:
        pools: tensors ``[P, S, ...]``, contiguous, any dtype, on the device of ``moves``.
        moves: ``[3, M]`` int64, contiguous in M: source rows, destination rows, moving (0
            or 1). The moving sources and destinations are disjoint sets.
        backend: ``"auto"`` (Triton on CUDA), ``"triton"`` (one kernel per pool, no wait
            for the device) or ``"torch"`` (the reference: ``nonzero``, then one
            ``index_select`` + ``index_copy_`` per pool).
    """
    pools = list(pools)
    _check(pools, moves)
    check_backend(backend, ("auto", "triton", "torch"))
    if backend == "auto":
        backend = "triton" if moves.is_cuda else "torch"
    if backend == "torch":
        return _move_torch(pools, moves)
    resolve_backend(backend, moves, ("auto", "triton", "torch"), products=False)
    m = moves.shape[1]
    if m == 0:
        return
    for pool in pools:
        x = pool[0, 0].numel()
        if x == 0:
            continue
        bx = triton.next_power_of_2(x)
        block = max(16, min(BLOCK, ROW_ELEMENTS // bx))  # wide rows (CASTLE's u): fewer per program
        _move_kernel[(triton.cdiv(m, block),)](pool, moves, moves.stride(0), m, X=x, BX=bx, BLOCK=block)
