"""``H2O``: heavy hitters, A2SF without forgetting."""

from __future__ import annotations

from dataclasses import dataclass

from .a2sf import A2SF


@dataclass(frozen=True, kw_only=True)
class H2O(A2SF):
    """Heavy-Hitter Oracle: A2SF with ``alpha = 1`` (every query's attention counts alike)."""

    alpha: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.alpha != 1.0:
            raise ValueError(f"H2O is A2SF with alpha = 1; got alpha = {self.alpha!r} (use A2SF)")
