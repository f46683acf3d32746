"""Token generation: prefill, a compilable one-token decode step, sampling, generate.

The decoding state is a :mod:`lapse.kv` store (``DenseStore``, or ``PagedStore`` under an
eviction policy of :mod:`.policies`); ``Decoder.forward(..., cache=store)`` appends to it.
The Hugging Face adapter is :mod:`lapse.hf`. Each name loads with its submodule on first
use: ``lapse generate``'s settings (:mod:`.config`) and the policy flags import no torch.
"""

from lapse.lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    ".batching": ("RowBatcher", "RowRequest"),
    ".generate": ("check_policy_fits", "compiled_decode_one_token", "decode_one_token", "evict", "generate",
                  "logit_bounds", "paged_store_for", "prefill", "records_scores", "sample", "sample_rows",
                  "supports_paged"),
    ".policies": ("A2SF", "H2O", "POLICIES", "ACPBoundary", "DCPDrop", "Dense", "Policy", "PolicyName",
                  "PolicyOptions", "SinkWindow"),
})
