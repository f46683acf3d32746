"""Index math shared by the split-K (flash-decoding) kernels of the decode ops.

A decode kernel cuts each sequence's held keys into ``num_splits`` contiguous shares, one
program each, and a combine kernel merges their partial softmax states. The number of
splits is a host number chosen from the capacity (no sync, a fixed launch), while the
real length ``n`` is read on the device: each split then takes an equal share of whole
tiles of ``[lo, n)``, so no program reads a slot at or past ``n`` and the unused capacity
costs nothing but empty programs.
"""

from __future__ import annotations

from .backend import tl, triton_jit


@triton_jit
def split_range(lo, n, i_s, num_splits, BN: tl.constexpr):
    """Keys ``[start, end)`` of split ``i_s`` of ``[lo, n)``: shares of whole ``BN`` tiles,
    the last ones possibly short or empty (``start >= end``)."""
    chunk = tl.cdiv(tl.cdiv(n - lo, num_splits), BN) * BN
    start = lo + i_s * chunk
    return start, tl.minimum(start + chunk, n)
