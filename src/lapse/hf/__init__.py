"""Hugging Face ``transformers`` adapters: the only package of lapse that imports it.

:class:`LapseConfig` and :class:`LapseForCausalLM` wrap a lapse decoder as a
``transformers`` causal LM (``save_pretrained``, ``from_pretrained``, the Auto classes,
``generate``); :class:`LapseCache` is its ``past_key_values``. Importing this package
registers model type ``"lapse"`` with the Auto classes.
"""

from .cache import LapseCache
from .model import LapseConfig, LapseForCausalLM, register

register()

__all__ = ["LapseCache", "LapseConfig", "LapseForCausalLM", "register"]
