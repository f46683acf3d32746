"""The decoding state of the decoder models: a dense KV cache, one state per layer.

SPEC section 1 (Decoding) and section 2 (KV-shift keeps the previous pre-shift
projection). A :class:`DenseCache` is passed to ``Decoder.forward(..., cache=cache)``;
each call writes its tokens' keys and values after the ones already cached and attends
to all of them. Buffers are preallocated with a capacity and written by index (the FoX
decode step reads the whole buffer with ``cache_seqlens``, a static shape); a call that
needs more room reallocates at twice the size, so a cache made without a capacity works
too, at the cost of a copy now and then.

The cache keeps every key for good ("dense"): ACP eviction (SPEC section 3) is not done
here. Every sequence of the batch has the same length: left padding is not supported.

Legend: B batch, S capacity, T new tokens, K key/value heads, H query heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(eq=False)
class LayerCache:
    """The decoding state of one attention layer.

    Slots ``[0, length)`` of the buffers are valid; the rest is room for later tokens.
    The attention layer fills it (:meth:`append`, and ``k_prev``/``v_prev`` directly);
    buffers are allocated by the first :meth:`append`, with the batch, dtype and device
    of the tensors it is given.

    Attributes:
        capacity: slots to allocate on the first append (at least the tokens appended).
        length: positions cached so far; also the position of the next token, which is
            the RoPE offset of the Transformer layers.
        k, v: ``[B, S, K, D]`` keys and values as attention reads them: after KV-shift
            and QK-norm (Pro) and after RoPE (Transformer), in the model's dtype.
        c: ``[B, S, H]`` FoX only: the cumulative log gate ``c_j`` of every cached key
            for every query head, so that a step adds one gate, ``c_t = c_{t-1} +
            log f_t``, and the bias is ``c_t - c_j`` (SPEC section 1, Decoding). Float64:
            ``c`` grows large and negative and a float32 difference cancels digits; it
            costs 8 bytes per head and token beside the keys' and values' ``4 D``.
        c_last: ``[B, H]`` FoX only: ``c`` of the last cached position (float64), what
            the next token's log gate is added to.
        k_prev, v_prev: ``[B, 1, K, D]`` Pro only: the pre-shift key and value
            projections of the last cached position, the ``x_{t-1}`` of the next token's
            KV-shift.
    """

    capacity: int = 0
    length: int = 0
    k: Tensor | None = None
    v: Tensor | None = None
    c: Tensor | None = None
    c_last: Tensor | None = None
    k_prev: Tensor | None = None
    v_prev: Tensor | None = None

    def append(self, k: Tensor, v: Tensor, c: Tensor | None = None) -> None:
        """Writes ``T`` new positions into slots ``[length, length + T)``.

        Args:
            k, v: ``[B, T, K, D]`` the new keys and values, in the form attention reads.
            c: ``[B, T, H]`` (FoX) the new positions' cumulative log gates, already
                continued from :attr:`c_last`; ``None`` for the Transformer.
        """
        b, t = k.shape[:2]
        start, end = self.length, self.length + t
        self._reserve(k, v, c, end)
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        if c is not None:
            self.c[:, start:end] = c
            self.c_last = self.c[:, end - 1]  # [B, H]
        self.length = end

    def seqlens(self) -> Tensor:
        """``[B]`` int32 filled with :attr:`length`, the ``cache_seqlens`` of the decode op."""
        return torch.full((self.k.shape[0],), self.length, dtype=torch.int32, device=self.k.device)

    def reorder(self, index: Tensor) -> None:
        """Keeps batch rows ``index`` (beam search: each beam continues from its parent)."""
        for name in ("k", "v", "c", "c_last", "k_prev", "v_prev"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, index.to(value.device)))

    def _reserve(self, k: Tensor, v: Tensor, c: Tensor | None, needed: int) -> None:
        """Allocates the buffers on first use; reallocates (x2, keeping the valid slots)
        when ``needed`` slots do not fit. Raises on a batch, shape or dtype mismatch."""
        b, _, kh, d = k.shape
        if self.k is not None:
            cached = (self.k.shape[0], *self.k.shape[2:], self.k.dtype, self.k.device)
            if cached != (b, kh, d, k.dtype, k.device):
                raise ValueError(
                    f"the cache holds keys of batch {self.k.shape[0]}, shape {tuple(self.k.shape[2:])}, "
                    f"{self.k.dtype} on {self.k.device}; the new keys are batch {b}, shape {(kh, d)}, "
                    f"{k.dtype} on {k.device}: use a fresh cache for a new batch or model"
                )
            if (c is None) != (self.c is None):
                raise ValueError("the cache was filled by a model of another architecture")
            if needed <= self.k.shape[1]:
                return
        old = self.k
        size = max(needed, self.capacity) if old is None else max(needed, 2 * old.shape[1])
        new_k = k.new_zeros(b, size, kh, d)  # [B, S, K, D]
        new_v = v.new_zeros(b, size, kh, d)  # [B, S, K, D]
        new_c = None if c is None else c.new_zeros(b, size, c.shape[2])  # [B, S, H]
        if old is not None:
            n = self.length
            new_k[:, :n], new_v[:, :n] = self.k[:, :n], self.v[:, :n]
            if new_c is not None:
                new_c[:, :n] = self.c[:, :n]
        self.k, self.v, self.c = new_k, new_v, new_c


class DenseCache:
    """The decoding state of a whole :class:`lapse.models.Decoder`: one
    :class:`LayerCache` per block, in order.

    Make one per batch of sequences, pass it to every call of the model
    (``model(prompt, cache=cache)``, then ``model(next_token, cache=cache)``); each call
    appends. ``capacity`` preallocates that many positions per layer (the prompt plus
    the tokens to generate) so that no call reallocates.

    It also answers the few questions Hugging Face's ``generate`` asks of a cache
    (:meth:`get_seq_length`, :meth:`reorder_cache`, ``is_compileable``,
    ``is_croppable``), so it can travel as ``past_key_values`` (``lapse.models.hf``).
    """

    is_compileable = False  # generate() must not compile the forward around it
    is_croppable = False  # the Pro KV-shift state of an earlier position is not kept

    def __init__(self, n_layers: int, capacity: int = 0):
        if not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative integer, got {capacity!r}")
        self.layers = [LayerCache(capacity=capacity) for _ in range(n_layers)]

    @property
    def length(self) -> int:
        """Positions cached so far (the same in every layer after a model call)."""
        return self.layers[0].length

    @property
    def batch_size(self) -> int | None:
        """Sequences held (``None`` before the first call)."""
        k = self.layers[0].k
        return None if k is None else k.shape[0]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """:attr:`length`, under the name Hugging Face's ``generate`` uses."""
        return self.layers[layer_idx].length

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Keeps batch rows ``beam_idx`` in every layer (Hugging Face's beam search)."""
        for layer in self.layers:
            layer.reorder(beam_idx)

    def __repr__(self) -> str:
        layer = self.layers[0]
        shape = None if layer.k is None else tuple(layer.k.shape)
        return f"DenseCache(layers={len(self.layers)}, length={self.length}, k_buffer={shape})"
