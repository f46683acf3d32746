"""``Dense``: keep every token (the reference every other policy is held to)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass(frozen=True, kw_only=True)
class Dense(Policy):
    """Keeps every token; the paged store then holds what a dense cache holds."""

    every: int = 1 << 30
