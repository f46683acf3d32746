"""``ACPBoundary``: evict, for good, the keys a FoX head has decayed below ACP's threshold."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from lapse.kv import LayerSnapshot

from .base import Policy


@dataclass(frozen=True, kw_only=True)
class ACPBoundary(Policy):
    """SPEC section 3, Decoding: with ``delta = -2U - log L + log eps`` per query head, a key
    whose bias ``c_t - c_j`` has fallen below ``delta`` carries less than ``eps / L`` of any
    later row's attention, and the bias only falls as ``t`` grows: evict it for good. A kv
    head keeps a key while any of its query heads does; the kept keys are a suffix.

    ``U`` must hold for every later query, so it comes from the layer's QK-norm gains
    (:meth:`lapse.layers.Attention.logit_bound`): forgetting attention in a Pro block.
    """

    eps: float = math.exp(-10)
    """The attention mass a row may lose, summed over the evicted keys."""
    max_context: int | None = None
    """``L``: the most keys a row attends to; ``None``: the store's ``max_context``."""

    whole_pages = True  # a suffix; tokens kept past the boundary only lower the dropped mass

    every: int = 64
    """Evict every this many steps: a kept suffix or window only grows by ``every`` tokens
    meanwhile, and an eviction pass costs ~50 ms at 125M shapes (BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.eps < 1:
            raise ValueError(f"eps must be in (0, 1), got {self.eps!r}")
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context < 1):
            raise ValueError(f"max_context must be a positive integer or None, got {self.max_context!r}")

    @property
    def uniform_heads(self) -> bool:
        return False  # each head its own boundary

    def check(self, model: nn.Module) -> None:
        for i, block in enumerate(model.blocks):
            attn = block.attn
            if not getattr(attn, "supports_acp", False) or attn.logit_bound() is None:
                raise ValueError(
                    "ACPBoundary needs forgetting attention with QK-norm (fox-pro) in every layer, so "
                    f"that the bound U holds for every later query; layer {i} of this "
                    f"{model.config.name} model has "
                    f"{'no forget gate' if not getattr(attn, 'supports_acp', False) else 'no QK-norm'}"
                )

    def keep(self, snap: LayerSnapshot) -> Tensor:
        if snap.c is None or snap.c_now is None or snap.bound is None:
            raise ValueError("ACPBoundary needs the FoX gates c and the layer's bound U in the snapshot")
        if self.max_context is not None and self.max_context < snap.max_context:
            raise ValueError(
                f"ACPBoundary(max_context={self.max_context}) is below the store's max_context "
                f"({snap.max_context}): the eps guarantee needs L >= every row's length"
            )
        length = self.max_context or snap.max_context
        delta = -2 * snap.bound.double() - math.log(length) + math.log(self.eps)  # [H, G]
        bias = snap.c_now[:, :, None, :] - snap.c  # [B, H, W, G] float64
        return snap.valid & (bias >= delta[None, :, None, :]).any(-1)
