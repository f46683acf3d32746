"""``SinkWindow``: attention sinks plus a recent window (StreamingLLM)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lapse.kv import LayerSnapshot

from .base import Policy, recent_or_sink


@dataclass(frozen=True, kw_only=True)
class SinkWindow(Policy):
    """Keeps the first ``sinks`` positions and the last ``window`` of each sequence."""

    sinks: int = 4
    """Positions at the start always kept (the attention sinks)."""
    window: int = 1024
    """The most recent held positions kept at each eviction (a step then attends to them
    and its own new token)."""

    every: int = 64
    """Evict every this many steps: a kept suffix or window only grows by ``every`` tokens
    meanwhile, and an eviction pass costs ~50 ms at 125M shapes (BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be a positive integer, got {self.window!r}")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be a non-negative integer, got {self.sinks!r}")

    def max_tokens(self, prompt_len: int) -> int:
        return self.sinks + self.window

    def keep(self, snap: LayerSnapshot) -> Tensor:
        # a row-slot store gives each row its own window (snap.budgets, set at its admission)
        window = self.window if snap.budgets is None else snap.budgets[:, None, None]  # [B, 1, 1]
        return recent_or_sink(snap, window, self.sinks)
