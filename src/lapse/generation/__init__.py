"""Token generation: prefill, a compilable one-token decode step, sampling, generate.

The decoding state is a :mod:`lapse.kv` store (``DenseStore``); ``Decoder.forward(...,
cache=store)`` appends to it. The Hugging Face adapter is :mod:`lapse.hf`.
"""

from .generate import compiled_decode_one_token, decode_one_token, generate, prefill, sample

__all__ = ["compiled_decode_one_token", "decode_one_token", "generate", "prefill", "sample"]
