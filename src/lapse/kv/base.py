"""What every store shares: the sequences' lengths, the per-method states, and the
begin/advance bookkeeping of a forward (the parts of :class:`~lapse.kv.KVCache` that do
not depend on how keys and values are laid out)."""

from __future__ import annotations

import torch
from torch import Tensor

from .extras import static_zeros
from .protocol import S


class StoreBase:
    """Lengths and states of a batch of sequences for ``n_layers`` attention layers.

    Attributes:
        n_layers: attention layers served (``layer_idx`` in ``[0, n_layers)``).
        seqlens: ``[B]`` int32 tokens of each sequence so far; ``None`` before the first call.
        states: per layer, the per-method states by type name.
    """

    def __init__(self, n_layers: int):
        if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
            raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
        self.n_layers = n_layers
        self.seqlens: Tensor | None = None
        self.states: list[dict[str, object]] = [{} for _ in range(n_layers)]
        self._length: int | None = 0  # host copy of seqlens (None: unknown after compiled steps)
        self._t = 0  # new tokens of the forward in progress
        self._positions: Tensor | None = None  # [B, T] their positions
        self._after: Tensor | None = None  # [B] int32 seqlens + T
        self._new: Tensor | None = None  # [B] int64 new tokens per sequence in a ragged forward
        self.new_lengths: list[int] | None = None
        """Host copy of the ragged forward's ``lengths`` (``None``: every sequence brings ``T``)."""
        self.step_rows: Tensor | None = None
        """``[B]`` int64 0/1, row-slot stores (``PagedStore(rows=...)``): the rows a
        one-token step advances (1) or leaves as they are (0, a free row); ``None``: all."""

    @property
    def batch_size(self) -> int | None:
        """Sequences held (``None`` before the first call)."""
        return None if self.seqlens is None else self.seqlens.shape[0]

    @property
    def length(self) -> int:
        """Tokens of each sequence so far; reads ``seqlens`` back once after compiled steps."""
        if self._length is None:
            self._length = 0 if self.seqlens is None else int(self.seqlens.max())
        return self._length

    def begin(self, batch_size: int, t: int, device: torch.device, lengths: Tensor | None = None) -> Tensor:
        self._new, self.new_lengths = None, None
        if lengths is not None:
            if self.length > 0:
                raise ValueError("lengths (a ragged batch) are taken by the first forward only (the prefill)")
            self._new, self.new_lengths = check_lengths(lengths, batch_size, t, device)
        elif self.step_rows is not None:  # a step of the occupied rows: the ragged bookkeeping, 0 or 1 each
            self._new = self.step_rows
        if not torch.compiler.is_compiling():
            if self.seqlens is None:
                self.seqlens = static_zeros(batch_size, dtype=torch.int32, device=device)
            elif batch_size != self.seqlens.shape[0]:
                raise ValueError(
                    f"the cache holds {self.seqlens.shape[0]} sequences but input_ids has {batch_size}: "
                    "use a fresh cache for a new batch"
                )
            self._make_room(t)
        self._t = t
        self._positions = self.seqlens[:, None].long() + torch.arange(t, device=device)  # [B, T]
        self._after = self.seqlens + (t if self._new is None else self._new.int())  # [B] int32
        return self._positions

    def last(self, x: Tensor) -> Tensor:
        if self._new is None:
            return x[:, -1]
        return x[torch.arange(x.shape[0], device=x.device), self._new.to(x.device) - 1]

    def write_targets(self, layer_idx: int, k: Tensor, v: Tensor, **extras: Tensor):
        """The buffers and slots a fused one-token kernel may write the new token into
        itself (:meth:`lapse.kv.DenseStore.write_targets`), or ``None``: this store has
        none (pages are found through a table), and the layer appends as usual."""
        return None

    def _make_room(self, t: int) -> None:
        """Outside compiled code, before ``t`` new tokens: checks and allocation of the store."""

    def claim(self, t: int) -> None:
        """On the host, before a compiled step of ``t`` tokens per sequence (which cannot
        run :meth:`_make_room`): raises ``ValueError`` when the store has no room for them
        that it knows of without reading the device. Nothing to check by default."""

    def state(self, layer_idx: int, kind: type[S]) -> S:
        states = self.states[layer_idx]
        name = kind.__name__
        if name not in states:
            states[name] = kind()
        return states[name]

    def advance(self) -> None:
        if self._new is not None:
            self.seqlens.add_(self._new.int())
            self._length = None  # the longest sequence: read back when asked
            return
        self.seqlens.add_(self._t)
        if torch.compiler.is_compiling():
            self._length = None
        elif self._length is not None:
            self._length += self._t


def check_lengths(lengths, batch_size: int, t: int, device: torch.device) -> tuple[Tensor, list[int]]:
    """A ragged forward's new tokens per sequence: ``[B]`` int64 on ``device`` and the
    host list; each in ``[1, t]``."""
    host = lengths.tolist() if isinstance(lengths, Tensor) else list(lengths)
    if len(host) != batch_size or not all(isinstance(n, int) and 1 <= n <= t for n in host):
        raise ValueError(
            f"lengths must be {batch_size} integers in [1, {t}] (tokens per sequence), got {host}"
        )
    return torch.tensor(host, dtype=torch.long, device=device), host
