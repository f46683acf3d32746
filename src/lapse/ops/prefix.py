"""Counting scans that ``torch.compile`` calls rather than fuses (:func:`prefix_count`).

On CUDA, Inductor lowers a scan along a long dimension (or one of symbolic length, as a
recompilation with dynamic shapes makes it) to its split-scan kernel, whose code generation
fails (torch 2.11: ``TypeError: list indices must be integers or slices, not NoneType``)
when the scanned values are computed from a tensor broadcast along the scan: a per-head
length compared with slot indices (an eviction pass), or a causal mask over a batch (DCP's
step mask). Behind a custom op the scan reads a realised tensor, whatever produced it.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("lapse::prefix_count", mutates_args=())
def prefix_count(flags: Tensor) -> Tensor:
    """The inclusive count of true ``flags`` along the last dimension, int64 (``cumsum``),
    as one op the compiler calls (module docstring)."""
    return flags.long().cumsum(-1)


@prefix_count.register_fake
def _(flags: Tensor) -> Tensor:
    return flags.new_empty(flags.shape, dtype=torch.long)
