"""The inputs of the forward and the backward on FlashAttention-4's kernels (fa4_fwd.py,
fa4_bwd.py), one Triton launch each: the gate's column terms and the lse shift, and ACP's block
sparsity. The torch versions there (``column_terms``, ``permute_columns``, ``acp_blocks``,
``acp_key_tiles``) are their references (tests hold them equal bit for bit); these exist because
the references' dozen small launches and indexing cost a backward 0.4-0.7 ms of host time each
(H200, the benchmark's shapes)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_T = 1024  # positions a program (column terms)
BLOCK_M = 256  # query tiles a step (block sparsity)


@triton.jit
def _column_terms_kernel(CHI, CLO, D, SHIFT, T, TC, T_PAD, TILE_N: tl.constexpr, TILE_M: tl.constexpr,
                         BLOCK: tl.constexpr, PERMUTE: tl.constexpr):
    i_bh = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = j < T
    kref = tl.minimum(j // TILE_N * TILE_N + TILE_N - 1, T - 1)
    qref = tl.minimum(j // TILE_M * TILE_M + TILE_M - 1, T - 1)
    row = i_bh * TC
    hi = tl.load(CHI + row + j, mask=inside, other=0.0)
    lo = tl.load(CLO + row + j, mask=inside, other=0.0)
    hi_k = tl.load(CHI + row + kref, mask=inside, other=0.0)
    lo_k = tl.load(CLO + row + kref, mask=inside, other=0.0)
    hi_q = tl.load(CHI + row + qref, mask=inside, other=0.0)
    lo_q = tl.load(CLO + row + qref, mask=inside, other=0.0)
    d = tl.where(inside, (hi_k - hi) + (lo_k - lo), 0.0)
    at = j
    if PERMUTE == 1:  # fa4_fwd.permute_columns: column 8 i + 2 q + e of a tile at q * TILE_N / 4 + 2 i + e
        local = j % TILE_N
        at = j - local + (local % 8) // 2 * (TILE_N // 4) + local // 8 * 2 + local % 2
    if PERMUTE == 2:  # fa4_bwd.permute_keys: key g + 8 r of a 16-key slab at 2 g + r
        local = j % 16
        at = j - local + local % 8 * 2 + local // 8
    tl.store(D + i_bh * T_PAD + at, d, mask=j < T_PAD)
    tl.store(SHIFT + i_bh * T + j, (hi - hi_q) + (lo - lo_q), mask=inside)


def column_terms(c_hi: Tensor, c_lo: Tensor, t: int, tile_n: int, tile_m: int, permute: str | None = None
                 ) -> tuple[Tensor, Tensor]:
    """As fa4_bwd.column_terms (its docstring), in one launch; ``permute``: ``d`` laid out as
    fa4_fwd.permute_columns ("columns", the forward's) or fa4_bwd.permute_keys ("keys", the
    backward's) lay it out."""
    b, h, tc = c_hi.shape
    t_pad = -(-t // tile_n) * tile_n
    d = torch.empty(b, h, t_pad, dtype=torch.float32, device=c_hi.device)
    shift = torch.empty(b, h, t, dtype=torch.float32, device=c_hi.device)
    grid = (triton.cdiv(t_pad, BLOCK_T), b * h)
    _column_terms_kernel[grid](c_hi, c_lo, d, shift, t, tc, t_pad, TILE_N=tile_n, TILE_M=tile_m,
                               BLOCK=BLOCK_T, PERMUTE={None: 0, "columns": 1, "keys": 2}[permute])
    return d, shift


@triton.jit
def _first_kept(BS, i_bh, m, NB, SUB: tl.constexpr, ACP: tl.constexpr):
    """The first kept key of query tile ``m``: the least over its ACP blocks (past the last one,
    the last block's)."""
    first = tl.load(BS + i_bh * NB + tl.minimum(m * SUB, NB - 1))
    for s in tl.static_range(1, SUB):
        first = tl.minimum(first, tl.load(BS + i_bh * NB + tl.minimum(m * SUB + s, NB - 1)))
    return first * ACP


@triton.jit
def _acp_blocks_kernel(BS, COUNT, INDEX, NB, T, M_TILES, N_TILES, SUB: tl.constexpr, ACP: tl.constexpr,
                       TILE_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    first_key = n * TILE_N
    last_key = first_key + TILE_N - 1
    # pass 1: how many query tiles the key tile visits
    total = 0
    for m0 in range(0, M_TILES, BLOCK):
        m = m0 + tl.arange(0, BLOCK)
        last_row = tl.minimum(m * TILE_M + TILE_M - 1, T - 1)
        visit = (m < M_TILES) & (_first_kept(BS, i_bh, m, NB, SUB, ACP) <= last_key) & (last_row >= first_key)
        total += tl.sum(visit.to(tl.int32), 0)
    tl.store(COUNT + i_bh * N_TILES + n, total)
    # pass 2: the visited ones packed left in order, then the others (a stable sort's order)
    seen = 0
    unseen = 0
    row = INDEX + (i_bh * N_TILES + n) * M_TILES
    for m0 in range(0, M_TILES, BLOCK):
        m = m0 + tl.arange(0, BLOCK)
        inside = m < M_TILES
        last_row = tl.minimum(m * TILE_M + TILE_M - 1, T - 1)
        visit = inside & (_first_kept(BS, i_bh, m, NB, SUB, ACP) <= last_key) & (last_row >= first_key)
        v = visit.to(tl.int32)
        u = (inside & ~visit).to(tl.int32)
        pos = tl.where(visit, seen + tl.cumsum(v, 0) - 1, total + unseen + tl.cumsum(u, 0) - 1)
        tl.store(row + pos, m, mask=inside)
        seen += tl.sum(v, 0)
        unseen += tl.sum(u, 0)


def acp_blocks(block_start: Tensor, t: int, tile_m: int, tile_n: int, acp_block: int
               ) -> tuple[Tensor, Tensor]:
    """As fa4_bwd.acp_blocks (its docstring), in one launch; ``block_start`` int32, contiguous."""
    b, h, nb = block_start.shape
    m_tiles, n_tiles = -(-t // tile_m), -(-t // tile_n)
    bs = block_start
    count = torch.empty(b, h, n_tiles, dtype=torch.int32, device=bs.device)
    index = torch.empty(b, h, n_tiles, m_tiles, dtype=torch.int32, device=bs.device)
    _acp_blocks_kernel[(n_tiles, b * h)](bs, count, index, nb, t, m_tiles, n_tiles, SUB=tile_m // acp_block,
                                         ACP=acp_block, TILE_M=tile_m, TILE_N=tile_n,
                                         BLOCK=min(BLOCK_M, triton.next_power_of_2(m_tiles)))
    return count, index


@triton.jit
def _acp_key_tiles_kernel(BS, COUNT, INDEX, NB, T, M_TILES, N_TILES, SUB: tl.constexpr, ACP: tl.constexpr,
                          TILE_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    first = _first_kept(BS, i_bh, m, NB, SUB, ACP) // TILE_N
    last = tl.minimum(m * TILE_M + TILE_M - 1, T - 1) // TILE_N
    count = tl.maximum(last - first + 1, 0)
    tl.store(COUNT + i_bh * M_TILES + m, count)
    row = INDEX + (i_bh * M_TILES + m) * N_TILES
    for n0 in range(0, N_TILES, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        tl.store(row + n, tl.where(n < count, first + n, 0), mask=n < N_TILES)


def acp_key_tiles(block_start: Tensor, t: int, tile_m: int, tile_n: int, acp_block: int
                  ) -> tuple[Tensor, Tensor]:
    """As fa4_fwd.acp_key_tiles (its docstring), in one launch; ``block_start`` int32, contiguous."""
    b, h, nb = block_start.shape
    m_tiles, n_tiles = -(-t // tile_m), -(-t // tile_n)
    count = torch.empty(b, h, m_tiles, dtype=torch.int32, device=block_start.device)
    index = torch.empty(b, h, m_tiles, n_tiles, dtype=torch.int32, device=block_start.device)
    block = min(BLOCK_M, triton.next_power_of_2(n_tiles))
    _acp_key_tiles_kernel[(m_tiles, b * h)](block_start, count, index, nb, t, m_tiles, n_tiles,
                                            SUB=tile_m // acp_block, ACP=acp_block, TILE_M=tile_m,
                                            TILE_N=tile_n, BLOCK=block)
    return count, index
