"""Per-method decoding state of a layer, one small type per method.

A layer asks its store for its state (``cache.state(layer_idx, GateState)``); the store
makes one empty on first use and reorders it with the batch. Tensors are allocated once,
at the first (eager) call, and then updated in place, so a compiled or CUDA-graph decode
step keeps reading and writing the same memory. A new method adds a type here, not
fields to a shared one.

Legend: B batch, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor


def static_zeros(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeros that a compiled decode step may update in place: their address is marked
    static, so CUDA graphs capture the buffer itself instead of copying it in."""
    t = torch.zeros(*shape, dtype=dtype, device=device)
    torch._dynamo.mark_static_address(t)
    return t


def static_clone(x: Tensor) -> Tensor:
    """A copy of ``x`` marked static as :func:`static_zeros` marks its zeros."""
    t = x.clone()
    torch._dynamo.mark_static_address(t)
    return t


class LayerState:
    """Base of the per-method states: its tensor fields are batch-first and reordered
    together (beam search)."""

    def reorder(self, index: Tensor) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                moved = value.index_select(0, index.to(value.device))
                torch._dynamo.mark_static_address(moved)
                setattr(self, f.name, moved)

    # row slots (a PagedStore with ``rows``): a fixed batch whose rows take sequences in turn

    @classmethod
    def alloc_rows(cls, src: LayerState, rows: int) -> LayerState:
        """A state of ``rows`` rows shaped like ``src``'s (any batch), reset, its tensors
        static: a compiled step reads them in place while rows change hands."""
        state = cls()
        for f in fields(src):
            value = getattr(src, f.name)
            if isinstance(value, Tensor):
                setattr(state, f.name, static_zeros(rows, *value.shape[1:], dtype=value.dtype,
                                                    device=value.device))
        state.reset_rows(list(range(rows)))
        return state

    def copy_row(self, row: int, src: LayerState, src_row: int) -> None:
        """Row ``row`` of every tensor set to ``src``'s row ``src_row`` (in place)."""
        for f in fields(self):
            value, given = getattr(self, f.name), getattr(src, f.name)
            if isinstance(value, Tensor) and isinstance(given, Tensor):
                value[row].copy_(given[src_row])

    def reset_rows(self, rows: list[int]) -> None:
        """The ``rows`` back to the state before a sequence's first token (zeros; in place)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value[rows] = 0


@dataclass(eq=False)
class GateState(LayerState):
    """FoX: the cumulative log gate of the last held position, ``c_{t-1}`` ``[B, H]``,
    float64 (SPEC section 1, Decoding: a step adds one gate, ``c_t = c_{t-1} + log f_t``;
    float64 because ``c`` grows large and negative and a float32 difference cancels
    digits). Zero before the first token."""

    c_last: Tensor | None = None

    def ensure(self, batch: int, heads: int, device: torch.device) -> Tensor:
        if self.c_last is None:
            self.c_last = static_zeros(batch, heads, dtype=torch.float64, device=device)
        return self.c_last


@dataclass(eq=False)
class ShiftState(LayerState):
    """Pro KV-shift: the pre-shift key and value projections of the last held position,
    ``[B, 1, K, D]``, the ``x_{t-1}`` of the next token's shift (SPEC section 2). Zero
    before the first token (``x_0 = 0``)."""

    k_prev: Tensor | None = None
    v_prev: Tensor | None = None

    def ensure(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The buffers, allocated like ``k[:, :1]`` and ``v[:, :1]`` on first use."""
        if self.k_prev is None:
            b, _, kh, d = k.shape
            self.k_prev = static_zeros(b, 1, kh, d, dtype=k.dtype, device=k.device)
            self.v_prev = static_zeros(b, 1, kh, v.shape[-1], dtype=v.dtype, device=v.device)
        return self.k_prev, self.v_prev


@dataclass(eq=False)
class LookaheadRing(LayerState):
    """CASTLE's deferred lookahead update: the last up to ``M`` tokens' lookahead keys
    and values ``[B, M, K, D]`` not yet added into the per-slot ``u``, and the slot each
    came from, ``pos`` ``[B, M]`` int32 (``-1``: empty). Written by the decode op itself
    (:func:`lapse.ops.castle.castle_decode_step`, ``pending``); emptied at a prefill."""

    k: Tensor | None = None
    v: Tensor | None = None
    pos: Tensor | None = None

    def ensure(self, k_u: Tensor, m: int) -> tuple[Tensor, Tensor, Tensor]:
        """The buffers, allocated like ``k_u[:, :1]`` ``[B, 1, K, D]`` with ``m`` entries
        on first use."""
        if self.k is None:
            b, _, kh, d = k_u.shape
            self.k = static_zeros(b, m, kh, d, dtype=k_u.dtype, device=k_u.device)
            self.v = static_zeros(b, m, kh, d, dtype=k_u.dtype, device=k_u.device)
            self.pos = static_zeros(b, m, dtype=torch.int32, device=k_u.device)
            self.pos.fill_(-1)
        return self.k, self.v, self.pos

    def reset_rows(self, rows: list[int]) -> None:
        super().reset_rows(rows)
        if self.pos is not None:
            self.pos[rows] = -1  # empty
