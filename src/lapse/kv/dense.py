"""The dense KV store: every key kept, buffers allocated once per batch and capacity.

SPEC section 1 (Decoding). Per layer, ``k`` and ``v`` ``[B, S, K, D]`` and any per-slot
extras (FoX's ``c`` ``[B, S, H]`` float64) are written by index at each sequence's length;
one int32 ``seqlens`` ``[B]`` counts the held tokens and is advanced once per forward.
The decode step therefore has fixed shapes and can be compiled and captured in a CUDA
graph: inside compiled code the store neither checks nor grows anything.

Outside compiled code (prefill, chunks, an eager step) :meth:`DenseStore.begin` makes
room: a store made without enough ``capacity`` reallocates at twice the size (a copy),
so it works without a capacity, at a cost; give ``capacity`` (prompt + new tokens) to
allocate once. Sequences may hold different lengths: a ragged prefill (``begin(...,
lengths)``) writes each prompt's padding into slots past its length, which count as free.

Legend: B batch, S capacity, T new tokens, K key/value heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import StoreBase
from .extras import static_zeros
from .protocol import KVView


class DenseStore(StoreBase):
    """The decoding state of a model of ``n_layers`` attention layers (the
    :class:`~lapse.kv.KVCache` protocol). Make one per batch of sequences and pass it to
    every call of the model: ``model(prompt, cache=store)``, then ``model(token, cache=store)``.

    Attributes:
        n_layers: attention layers it serves (``layer_idx`` in ``[0, n_layers)``).
        capacity: slots per sequence (grows outside compiled code when needed).
        seqlens: ``[B]`` int32 tokens held per sequence; ``None`` before the first call.
    """

    def __init__(self, n_layers: int, capacity: int = 0):
        super().__init__(n_layers)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative integer, got {capacity!r}")
        self.capacity = capacity
        self.k: list[Tensor | None] = [None] * n_layers
        self.v: list[Tensor | None] = [None] * n_layers
        self.extras: list[dict[str, Tensor]] = [{} for _ in range(n_layers)]

    def append(self, layer_idx: int, k: Tensor, v: Tensor, **extras: Tensor) -> None:
        if not torch.compiler.is_compiling():
            self._allocate(layer_idx, k, v, extras)
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        pos = self._positions  # [B, T]
        self.k[layer_idx][rows, pos] = k
        self.v[layer_idx][rows, pos] = v
        for name, value in extras.items():
            self.extras[layer_idx][name][rows, pos] = value

    def view(self, layer_idx: int) -> KVView:
        return KVView(self.k[layer_idx], self.v[layer_idx], self.extras[layer_idx], self._after)

    def write_targets(
        self, layer_idx: int, k: Tensor, v: Tensor, **extras: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], Tensor]:
        """Where :meth:`append` of one new token per sequence (``k, v`` ``[B, 1, K, D]``,
        ``extras`` ``[B, 1, ...]``, here only their shapes and dtypes count) would write:
        the layer's ``k`` and ``v`` buffers ``[B, S, K, D]``, its extras by name, and each
        sequence's slot ``[B]`` (int64). For a fused kernel that computes the new token's
        keys and writes them itself (:func:`lapse.ops.forgetting.forgetting_decode_input`);
        it must write every buffer, as :meth:`append` would. Checks and allocates as
        :meth:`append` does (outside compiled code)."""
        if not torch.compiler.is_compiling():
            if k.shape[1] != 1:
                raise ValueError(f"write_targets serves one new token per sequence, got {k.shape[1]}")
            self._allocate(layer_idx, k, v, extras)
        return self.k[layer_idx], self.v[layer_idx], self.extras[layer_idx], self._positions[:, 0]

    def reorder(self, index: Tensor) -> None:
        def moved(x: Tensor) -> Tensor:
            y = x.index_select(0, index.to(x.device))
            torch._dynamo.mark_static_address(y)
            return y

        if self.seqlens is None:
            return
        self.seqlens = moved(self.seqlens)
        for i in range(self.n_layers):
            if self.k[i] is not None:
                self.k[i], self.v[i] = moved(self.k[i]), moved(self.v[i])
            self.extras[i] = {name: moved(x) for name, x in self.extras[i].items()}
            for state in self.states[i].values():
                state.reorder(index)

    def _make_room(self, t: int) -> None:
        """Grows every buffer (x2, keeping the held slots) when ``t`` more tokens do not fit."""
        needed = self.length + t
        if needed <= self.capacity:
            return
        size = max(needed, 2 * self.capacity)
        n = self.length

        def grown(x: Tensor | None) -> Tensor | None:
            if x is None:
                return None
            y = static_zeros(x.shape[0], size, *x.shape[2:], dtype=x.dtype, device=x.device)
            y[:, :n] = x[:, :n]
            return y

        for i in range(self.n_layers):
            self.k[i], self.v[i] = grown(self.k[i]), grown(self.v[i])
            self.extras[i] = {name: grown(x) for name, x in self.extras[i].items()}
        self.capacity = size

    def _allocate(self, layer_idx: int, k: Tensor, v: Tensor, extras: dict[str, Tensor]) -> None:
        """Allocates the layer's buffers like the first tensors it is given; afterwards
        checks that later tensors match them."""
        b, _, kh, d = k.shape
        if self.k[layer_idx] is None:
            s = self.capacity
            self.k[layer_idx] = static_zeros(b, s, kh, d, dtype=k.dtype, device=k.device)
            self.v[layer_idx] = static_zeros(b, s, kh, v.shape[-1], dtype=v.dtype, device=v.device)
            self.extras[layer_idx] = {
                name: static_zeros(b, s, *x.shape[2:], dtype=x.dtype, device=x.device)
                for name, x in extras.items()
            }
            return
        held = self.k[layer_idx]
        if (held.shape[2:], held.dtype, held.device) != ((kh, d), k.dtype, k.device):
            raise ValueError(
                f"layer {layer_idx} of the cache holds keys of shape {tuple(held.shape[2:])}, "
                f"{held.dtype} on {held.device}; the new keys are {(kh, d)}, {k.dtype} on {k.device}: "
                "use a fresh cache for a new model"
            )
        if set(extras) != set(self.extras[layer_idx]):
            raise ValueError(
                f"layer {layer_idx} of the cache holds {sorted(self.extras[layer_idx])} beside the keys, "
                f"the new tokens bring {sorted(extras)}: the cache was filled by a model of another "
                "architecture"
            )

    def bytes_held(self) -> int:
        """Bytes of the buffers (keys, values, per-slot extras), every slot of the capacity."""
        buffers = [x for i in range(self.n_layers) for x in (self.k[i], self.v[i], *self.extras[i].values())]
        return sum(x.numel() * x.element_size() for x in buffers if x is not None)

    def bytes_if_dense(self) -> int:
        """The same as :meth:`bytes_held`: this is the dense cache (the paged store's
        comparison, for reports that show both)."""
        return self.bytes_held()

    def __repr__(self) -> str:
        shape = None if self.k[0] is None else tuple(self.k[0].shape)
        return f"DenseStore(layers={self.n_layers}, length={self.length}, k_buffer={shape})"
