"""What an attention layer sees of the decoding state: the :class:`KVCache` protocol.

A model never imports a store class. It calls, once per forward, :meth:`KVCache.begin`
(which returns the new tokens' positions) and :meth:`KVCache.advance`; each attention
layer, knowing its ``layer_idx``, calls :meth:`KVCache.append` with its new keys and
values (and the per-slot values its method needs, such as FoX's ``c``), :meth:`KVCache.view`
for what attention reads, and :meth:`KVCache.state` for its method's per-sequence state
(a small type per method, :mod:`lapse.kv.extras`). The dense store
(:class:`lapse.kv.DenseStore`) is one implementation; the paged store and eviction
policies plug in behind the same calls.

Legend: B batch, T new tokens, S capacity (slots), K key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor

S = TypeVar("S")


@dataclass(eq=False)
class KVView:
    """What attention reads of one layer after :meth:`KVCache.append`.

    Attributes:
        k, v: ``[B, S, K, D]`` every slot; slots at or past ``seqlens`` hold anything.
        extras: the per-slot values appended beside the keys, by name (``[B, S, ...]``).
        seqlens: ``[B]`` int32 valid slots, the new tokens included (they sit in the last
            ``T`` valid slots).
    """

    k: Tensor
    v: Tensor
    extras: dict[str, Tensor]
    seqlens: Tensor


@runtime_checkable
class KVCache(Protocol):
    """The decoding state of a whole model, as its layers call it (see the module doc)."""

    n_layers: int
    capacity: int
    """Slots per sequence that the buffers hold (a Python int: a static shape)."""
    new_lengths: list[int] | None
    """The ragged forward's ``lengths`` on the host (``None``: not ragged); see :meth:`begin`."""

    @property
    def length(self) -> int:
        """Tokens held per sequence, on the host (may wait for the device once)."""
        ...

    def begin(self, batch_size: int, t: int, device: torch.device, lengths: Tensor | None = None) -> Tensor:
        """Starts a forward of ``t`` new tokens per sequence; returns their positions ``[B, T]``
        (int64). Outside compiled code it also checks the batch and makes room.

        ``lengths`` ``[B]``: a ragged forward (prompts of different lengths, right-padded
        to ``t``): sequence ``b`` brings only its first ``lengths[b]`` tokens; the padding
        after them is written into slots that count as free and never seen (attention is
        causal), and :meth:`advance` adds ``lengths``."""
        ...

    def last(self, x: Tensor) -> Tensor:
        """``x`` ``[B, T, ...]`` at each sequence's last new token ``[B, ...]``: ``x[:, -1]``,
        or ``x[b, lengths[b] - 1]`` in a ragged forward (what the next token continues:
        a layer's recurrent state, the prefill's logits)."""
        ...

    def append(self, layer_idx: int, k: Tensor, v: Tensor, **extras: Tensor) -> None:
        """Writes the new tokens' ``k, v`` ``[B, T, K, D]`` and per-slot ``extras``
        ``[B, T, ...]`` into the slots after the ones held."""
        ...

    def view(self, layer_idx: int) -> KVView:
        """The layer's buffers and valid lengths, after its :meth:`append` of this forward."""
        ...

    def state(self, layer_idx: int, kind: type[S]) -> S:
        """The layer's per-sequence state of type ``kind`` (made empty on first use)."""
        ...

    def advance(self) -> None:
        """Ends the forward: the new tokens count as held (``seqlens += T``)."""
        ...

    def reorder(self, index: Tensor) -> None:
        """Keeps batch rows ``index`` (beam search: each beam continues its parent)."""
        ...
