"""``A2SF``: keep a budget of tokens by accumulated attention with a forgetting factor."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lapse.kv import LayerSnapshot

from .base import Policy, check_budget, recent_or_sink, resolve_budget


@dataclass(frozen=True, kw_only=True)
class A2SF(Policy):
    """SPEC section 7. Each key's score is ``A_n(j) = alpha A_{n-1}(j) + a_{n,j}`` (its
    attention from every query, older queries faded by ``alpha``; the prompt's come from the
    prefill without an L x L matrix). A head keeps its ``recent`` last positions and ``sinks``
    first ones, and fills the rest of ``budget`` with the highest scores.

    Variants, as fields: ``every=1`` evicts before every step (a step attends to the budget
    plus the new token; in a store that frees memory an evicted token cannot return, so re-selecting the top-k
    each step and evicting the lowest each step choose the same tokens), larger ``every``
    evicts in batches; ``per="layer"`` sums the scores over a layer's heads so all its heads
    keep the same tokens; ``sinks`` keeps attention sinks.
    """

    budget: int | float = 0.2
    """Tokens kept per head: an int, or a float in (0, 1] as a share of the prompt; at least
    ``recent + sinks``."""
    recent: int = 32
    """The most recent positions always kept (inside the budget)."""
    alpha: float = 0.9
    """Forgetting factor in [0, 1]; 1 is H2O."""
    sinks: int = 0
    """Positions at the start always kept (inside the budget)."""
    per: Literal["head", "layer"] = "head"
    """Select per kv head, or one set for the whole layer."""
    every: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_budget(self.budget)
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")
        for name in ("recent", "sinks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.per not in ("head", "layer"):
            raise ValueError(f"per must be 'head' or 'layer', got {self.per!r}")
        if isinstance(self.budget, int) and self.recent + self.sinks > self.budget:
            raise ValueError(
                f"recent + sinks ({self.recent} + {self.sinks}) must fit in the budget ({self.budget})"
            )

    @property
    def score_decay(self) -> float:
        return self.alpha

    @property
    def uniform_heads(self) -> bool:
        return self.per == "layer"

    def tokens(self, prompt_len: int) -> int:
        """The budget in tokens for a prompt of ``prompt_len``: at least ``recent + sinks``,
        which are always kept."""
        return max(resolve_budget(self.budget, prompt_len), self.recent + self.sinks)

    def max_tokens(self, prompt_len: int) -> int:
        return self.tokens(prompt_len)

    def check_context(self, prompt_len: int, max_context: int) -> None:
        share = resolve_budget(self.budget, prompt_len)
        if isinstance(self.budget, float) and share < self.recent + self.sinks:  # refused for an int budget
            warnings.warn(
                f"budget {self.budget:g} of a {prompt_len}-token prompt is {share} tokens, below recent + "
                f"sinks ({self.recent} + {self.sinks}): a head keeps {self.recent + self.sinks}",
                stacklevel=2,
            )
        if isinstance(self.budget, int) and self.budget > max_context:
            raise ValueError(
                f"budget ({self.budget} tokens) is larger than the context ({max_context}): nothing would "
                "ever be evicted; give a smaller budget or a share of the prompt"
            )

    def keep(self, snap: LayerSnapshot) -> Tensor:
        budget = self.tokens(snap.prompt_len)
        if snap.prompt_lens is not None and isinstance(
            self.budget, float
        ):  # a ragged batch: each its own share
            budget = torch.round(snap.prompt_lens.double() * self.budget).long().clamp_min(1)
            budget = budget.clamp_min(self.recent + self.sinks)[:, None, None]  # [B, 1, 1]
        if snap.budgets is not None:  # a row-slot store: each row's own, set at its admission
            budget = snap.budgets[:, None, None]  # [B, 1, 1]
        fixed = recent_or_sink(snap, self.recent, self.sinks)  # [B, H, W]
        scores = snap.scores
        if self.per == "layer":  # every head of the layer holds the same positions in the same order
            scores = scores.sum(1, keepdim=True).expand_as(scores)
        room = (budget - fixed.sum(-1, keepdim=True)).clamp_min(0)  # [B, H, 1]
        candidate = snap.valid & ~fixed
        ranked = torch.where(candidate, scores, float("-inf"))
        order = torch.argsort(ranked, dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
        )
        return fixed | (candidate & (rank < room))
