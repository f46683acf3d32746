"""The lapse store as the cache of Hugging Face's ``generate`` (its ``cache=``, transformers
>= 5.24; ``past_key_values=`` before)."""

from __future__ import annotations

from torch import Tensor

from lapse.kv import DenseStore


class LapseCache(DenseStore):
    """A :class:`~lapse.kv.DenseStore` that also answers the questions ``generate`` asks of
    a cache (:meth:`get_seq_length`, :meth:`reorder_cache`, ``is_compileable``,
    ``is_croppable``). It grows as ``generate`` appends (outside compiled code)."""

    is_compileable = False  # generate() must not compile the forward around it
    is_croppable = False  # the Pro KV-shift state of an earlier position is not kept

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held per sequence (:attr:`length`)."""
        return self.length

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Keeps batch rows ``beam_idx`` (beam search)."""
        self.reorder(beam_idx)
