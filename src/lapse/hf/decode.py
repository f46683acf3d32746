"""Generation from a Hugging Face model under an eviction policy with lapse's own decode loop.

``model.generate(..., cache=EvictingCache(policy))`` keeps Hugging Face's decode loop,
eager and bound by the host (tens of ms per step at SmolLM2-135M on an H100).
:func:`generate` runs the prompt through the model itself, as that call does (Hugging
Face's forward and SDPA, each layer's prompt cut to the budget as it ends: the
:class:`~lapse.hf.EvictingCache` prefill), then decodes from the same paged store with
the model converted to a lapse :class:`~lapse.models.Decoder` (:func:`lapse.hf.decoder_from_hf`,
the same function): :func:`lapse.generation.generate` with ``prefilled`` logits, its
steps compiled and replayed as CUDA graphs with ``compile=True``, the policy's passes on
the same schedule as the cache's (every ``policy.every`` steps after the prompt's cut)::

    decoder = lapse.hf.decoder_from_hf(model, share=True)   # once per model: its own weights
    out = lapse.hf.generate(model, ids, 64, H2O(budget=0.1), attention_mask=mask,
                            decoder=decoder, compile=True)

LLaMA-family models that lapse can hold (``llama``, ``mistral``: see
:mod:`lapse.hf.convert`); a left-padded batch as ``model.generate`` takes it.

Legend: B batch, T prompt tokens, N new tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lapse.generation import Policy
from lapse.generation import generate as lapse_generate
from lapse.models import Decoder

from .compat import CACHE_ARG
from .convert import decoder_from_hf
from .evicting import EvictingCache


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    policy: Policy,
    *,
    attention_mask: Tensor | None = None,
    decoder: Decoder | None = None,
    cache: EvictingCache | None = None,
    compile: bool = False,
    max_context: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_tokens: Sequence[int] = (),
    on_token=None,
) -> Tensor:
    """``[B, T + N]``: each prompt of ``input_ids`` ``[B, T]`` (left-padded with
    ``attention_mask``) followed by up to ``max_new_tokens`` tokens (module doc).

    Args:
        model: a Hugging Face LLaMA-family causal LM.
        policy: an eviction policy (:mod:`lapse.generation.policies`; ``Dense`` keeps all).
        decoder: ``model`` as a lapse decoder (:func:`lapse.hf.decoder_from_hf`, on the
            model's device and dtype); made here when not given, sharing the model's
            weights (``share=True``: no copy).
        cache: a fresh :class:`~lapse.hf.EvictingCache` for ``policy`` (to read its store
            after, e.g. ``cache.store.bytes_held()``); made here when not given.
        compile: compiled decode steps (CUDA graphs on a GPU; the first call compiles).
        max_context: positions a row may reach (default prompt + ``max_new_tokens``).
        temperature, top_k, top_p, generator, stop_tokens, on_token: as for
            :func:`lapse.generation.generate`.
    """
    t = input_ids.shape[-1]
    if decoder is None:
        decoder = decoder_from_hf(model, share=True)
    if cache is None:
        cache = EvictingCache(policy, model=model, max_context=max_context or t + max_new_tokens)
    elif cache.policy != policy or cache.is_initialized:
        raise ValueError("cache must be a fresh EvictingCache made for the same policy")
    positions = None  # a left-padded row's tokens from position 0, as model.generate numbers them
    if attention_mask is not None:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
    return lapse_generate(
        decoder,
        input_ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
        stop_tokens=stop_tokens,
        cache=cache.store,
        compile=compile,
        policy=policy,
        on_token=on_token,
        prefilled=out.logits[:, -1],
    )


__all__ = ["generate"]
