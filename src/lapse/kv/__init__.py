"""Decoding state: the protocol attention layers call, the dense store, per-method extras.

Below ``layers/`` and above ``ops/``: layers call a :class:`KVCache` (``append``,
``view``, ``state``), models call ``begin`` and ``advance`` once per forward, and nothing
above imports a concrete store except whoever makes one (``generation/``, ``hf/``, a user).
:class:`DenseStore` keeps every token in buffers allocated once; :class:`PagedStore` keeps
pages per (sequence, kv head) from a shared pool, so eviction policies free real memory.
"""

from .base import check_lengths
from .dense import DenseStore
from .extras import GateState, LayerState, LookaheadRing, ShiftState, static_zeros
from .paged import LayerSnapshot, PagedStore, PagedView
from .protocol import KVCache, KVView

__all__ = [
    "DenseStore", "GateState", "KVCache", "KVView", "LayerSnapshot", "LayerState", "LookaheadRing",
    "PagedStore", "PagedView", "ShiftState", "check_lengths", "static_zeros",
]
