"""Rotary position embedding (RoPE), the rotate-half convention (LLaMA in Hugging Face, fla)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .norm import compute_dtype


class RotaryEmbedding(nn.Module):
    """Rotates channel pairs ``(i, i + D/2)`` by ``position * base^(-2i/D)``.

    The cos/sin tables are computed once, in float64, for every position up to the largest
    asked for (:meth:`forward`'s ``max_positions``), grown when a longer sequence comes, and
    shared by every layer of the same head dim, base and device (one table per model, not
    per layer). They are not buffers, so ``model.to(dtype)`` does not round them and
    checkpoints do not hold them.
    """

    _tables_by_key: dict[tuple[int, float, str], tuple[Tensor, Tensor]] = {}  # [P, D/2] float64 each

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
        self.head_dim, self.base = head_dim, base

    def _tables(self, max_positions: int, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (self.head_dim, self.base, str(device))
        tables = self._tables_by_key.get(key)
        if tables is None or tables[0].shape[0] < max_positions:
            d = self.head_dim
            inv_freq = self.base ** (-torch.arange(0, d, 2, device=device, dtype=torch.float64) / d)  # [D/2]
            angles = torch.arange(max_positions, device=device, dtype=torch.float64)[:, None] * inv_freq
            tables = angles.cos(), angles.sin()  # [P, D/2] each
            self._tables_by_key[key] = tables
        return tables

    def forward(self, x: Tensor, positions: Tensor, max_positions: int) -> Tensor:
        """x ``[B, T, H, D]``; positions ``[B, T]`` or ``[1, T]`` (int), all below ``max_positions``."""
        dtype = compute_dtype(x)
        cos_table, sin_table = self._tables(max_positions, x.device)
        cos = cos_table[positions].to(dtype)[:, :, None, :]  # [B, T, 1, D/2]
        sin = sin_table[positions].to(dtype)[:, :, None, :]
        x1, x2 = x.to(dtype).chunk(2, dim=-1)  # [B, T, H, D/2] each
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_limit(t: int, cache=None, context=None) -> int:
    """The positions a layer's RoPE table must cover: the cache's capacity, the whole
    sequence under context parallelism (``t`` local tokens), else the ``t`` tokens."""
    if cache is not None:
        return cache.capacity
    return t if context is None else context.global_length(t)
