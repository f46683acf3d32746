"""The name under which the installed ``transformers`` passes a model's cache around.

``transformers`` 5.24 renamed ``past_key_values`` to ``cache``: the keyword of
``generate``, ``prepare_inputs_for_generation`` and the model forwards, and the field of
their outputs (``CausalLMOutputWithPast.cache``). The old keyword still works there for a
while, with a ``FutureWarning``; before 5.24 only the old one does. lapse supports both
sides of the rename (``transformers>=5.4,<6``), so this module decides once, from the
fields of the installed ``CausalLMOutputWithPast`` (not from the version string), which
name to use:

- :data:`CACHE_ARG`: ``"cache"`` or ``"past_key_values"``, the keyword that hands a cache
  to ``generate`` or to a forward: ``model.generate(ids, **{CACHE_ARG: cache})``;
- :func:`output_cache`: the cache that a forward (or ``generate`` with
  ``return_dict_in_generate``) returned;
- :func:`either_cache`: the one cache of a function that takes it under both names (as
  :class:`~lapse.hf.LapseForCausalLM` does);
- :data:`CACHE_NAMES`: both names, for the lists of keys that ``transformers`` reads
  (``keys_to_ignore_at_inference``, ``_skip_keys_device_placement``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE_NAMES = ("cache", "past_key_values")  # the name since transformers 5.24, the name before


def _installed_cache_arg() -> str:
    """``"cache"`` when the installed ``transformers``' outputs hold the cache under that
    field (5.24 and later), else ``"past_key_values"``."""
    names = {field.name for field in fields(CausalLMOutputWithPast)}
    return "cache" if "cache" in names else "past_key_values"


CACHE_ARG: str = _installed_cache_arg()


def output_cache(out: Any) -> Any:
    """The cache held by ``out``, a model output (a ``ModelOutput`` or a dict), under the
    installed ``transformers``' name (reading the other name would warn on 5.24 and later);
    ``None`` when it holds none."""
    if isinstance(out, Mapping):
        return out.get(CACHE_ARG)
    return getattr(out, CACHE_ARG, None)


def either_cache(cache: Any = None, past_key_values: Any = None) -> Any:
    """The cache given as ``cache`` or as ``past_key_values`` (``None`` when neither is);
    raises ``ValueError`` when the two are two different objects."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError(
            "got two different caches, as cache= and as past_key_values= (two names of one argument: "
            "transformers >= 5.24 calls it cache, earlier versions past_key_values); pass one"
        )
    return cache if cache is not None else past_key_values
