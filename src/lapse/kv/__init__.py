"""Decoding state: the protocol attention layers call, the dense store, per-method extras.

Below ``layers/`` and above ``ops/``: layers call a :class:`KVCache` (``append``,
``view``, ``state``), models call ``begin`` and ``advance`` once per forward, and nothing
above imports a concrete store except whoever makes one (``generation/``, ``hf/``, a user).
"""

from .dense import DenseStore
from .extras import GateState, LayerState, ShiftState, static_zeros
from .protocol import KVCache, KVView

__all__ = ["DenseStore", "GateState", "KVCache", "KVView", "LayerState", "ShiftState", "static_zeros"]
