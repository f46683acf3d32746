"""Token generation: prefill, a compilable one-token decode step, sampling, generate.

The decoding state is a :mod:`lapse.kv` store (``DenseStore``, or ``PagedStore`` under an
eviction policy of :mod:`.policies`); ``Decoder.forward(..., cache=store)`` appends to it.
The Hugging Face adapter is :mod:`lapse.hf`.
"""

from .generate import (
    check_policy_fits,
    compiled_decode_one_token,
    decode_one_token,
    evict,
    generate,
    logit_bounds,
    paged_store_for,
    prefill,
    records_scores,
    sample,
    supports_paged,
)
from .policies import (
    A2SF,
    H2O,
    POLICIES,
    ACPBoundary,
    DCPDrop,
    Dense,
    Policy,
    PolicyName,
    PolicyOptions,
    SinkWindow,
)

__all__ = [
    "A2SF",
    "H2O",
    "POLICIES",
    "ACPBoundary",
    "DCPDrop",
    "Dense",
    "Policy",
    "PolicyName",
    "PolicyOptions",
    "SinkWindow",
    "compiled_decode_one_token",
    "decode_one_token",
    "evict",
    "generate",
    "logit_bounds",
    "check_policy_fits",
    "paged_store_for",
    "prefill",
    "records_scores",
    "sample",
    "supports_paged",
]
