"""Incremental decoding of the decoder models: the dense KV cache and token generation.

:class:`DenseCache` holds one :class:`LayerCache` per decoder block (keys, values, the
FoX cumulative log gates ``c_j``, the Pro KV-shift state); ``Decoder.forward(...,
cache=cache)`` appends to it. :func:`generate` runs prefill and one-token steps with it.
The Hugging Face adapter is ``lapse.models.hf`` (imported on demand).
"""

from .cache import DenseCache, LayerCache
from .generate import decode_one_token, generate, prefill, sample

__all__ = ["DenseCache", "LayerCache", "decode_one_token", "generate", "prefill", "sample"]
