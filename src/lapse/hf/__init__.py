"""Hugging Face ``transformers`` adapters: the only package of lapse that imports it.

:class:`LapseConfig` and :class:`LapseForCausalLM` wrap a lapse decoder as a
``transformers`` causal LM (``save_pretrained``, ``from_pretrained``, the Auto classes,
``generate``); :class:`LapseCache` is its cache. Importing this package registers model
type ``"lapse"`` with the Auto classes.

:data:`CACHE_ARG` is the keyword under which the installed ``transformers`` takes a cache
(``cache`` since 5.24, ``past_key_values`` before) and :func:`output_cache` reads it back
from an output (:mod:`lapse.hf.compat`): ``model.generate(ids, **{CACHE_ARG: cache})``.

:class:`EvictingCache` is a ``transformers`` cache backed by a lapse paged store under an
eviction policy, for LLaMA-family Hugging Face models (through the ``"lapse_paged"``
attention function it registers) and the lapse adapter alike; :func:`load_pretrained`
loads a Hugging Face folder or a GGUF file (the optional ``lapse[hf]`` extra);
:func:`add_dcp` puts Dynamic Context Pruning on such a model's attention layers;
:func:`decoder_from_hf` turns one into a lapse decoder (``lapse import``), and
:func:`generate` prefills such a model through an :class:`EvictingCache` and decodes from
that store with lapse's own (compiled) loop on the converted decoder.
"""

from .cache import LapseCache
from .compat import CACHE_ARG, output_cache
from .convert import NotRepresentable, decoder_from_hf, lapse_config, lapse_state_dict, load_for_import
from .dcp import DCPProjections, add_dcp, dcp_modules
from .decode import generate
from .evicting import ATTENTION, EvictingCache, register_attention, use_lapse_attention
from .loading import load_pretrained, resolve_model_path
from .model import LapseConfig, LapseForCausalLM, register

register()
register_attention()

__all__ = [
    "ATTENTION",
    "CACHE_ARG",
    "DCPProjections",
    "EvictingCache",
    "LapseCache",
    "LapseConfig",
    "LapseForCausalLM",
    "NotRepresentable",
    "add_dcp",
    "dcp_modules",
    "decoder_from_hf",
    "generate",
    "lapse_config",
    "lapse_state_dict",
    "load_for_import",
    "load_pretrained",
    "output_cache",
    "register",
    "register_attention",
    "resolve_model_path",
    "use_lapse_attention",
]
