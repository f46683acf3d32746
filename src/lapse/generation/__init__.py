"""Incremental decoding of the decoder models: the dense KV cache.

:class:`DenseCache` holds one :class:`LayerCache` per decoder block (keys, values, the
FoX cumulative log gates ``c_j``, the Pro KV-shift state); ``Decoder.forward(...,
cache=cache)`` appends to it.
"""

from .cache import DenseCache, LayerCache

__all__ = ["DenseCache", "LayerCache"]
