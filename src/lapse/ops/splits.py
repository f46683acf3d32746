"""Index math shared by the split-K (flash-decoding) kernels of the decode ops.

A decode kernel runs a grid ``(num_splits, B * H)``: program ``(split, b * H + h)`` owns
key head ``h`` of sequence ``b``, the ``GROUP`` query heads that read it, and one of
``num_splits`` contiguous shares of the held keys; a combine kernel merges the splits'
partial softmax states. The number of
splits is a host number chosen from the capacity (no sync, a fixed launch), while the
real length ``n`` is read on the device: each split then takes an equal share of whole
tiles of ``[lo, n)``, so no program reads a slot at or past ``n`` and the unused capacity
costs nothing but empty programs.
"""

from __future__ import annotations

from .backend import tl, triton_jit


@triton_jit
def split_program(H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BG: tl.constexpr,
                  BD: tl.constexpr):
    """``(i_s, i_b, i_h, o_hq, o_d, m_g, m_d)`` of this program: its split, sequence and
    key head (int64, for address math), its query heads ``o_hq`` [BG] and head-dim
    offsets ``o_d`` [BD], and their masks (``BG``, ``BD`` pad ``GROUP``, ``D``)."""
    i_s = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_h = i_bh % H
    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    return i_s, i_bh // H, i_h, i_h * GROUP + o_g, o_d, o_g < GROUP, o_d < D


@triton_jit
def split_range(lo, n, i_s, num_splits, BN: tl.constexpr):
    """Keys ``[start, end)`` of split ``i_s`` of ``[lo, n)``: shares of whole ``BN`` tiles,
    the last ones possibly short or empty (``start >= end``)."""
    chunk = tl.cdiv(tl.cdiv(n - lo, num_splits), BN) * BN
    start = lo + i_s * chunk
    return start, tl.minimum(start + chunk, n)
