"""``DCPDrop``: free, for good, the tokens a DCP model's interaction mask has dropped."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lapse.kv import LayerSnapshot

from .base import Policy


@dataclass(frozen=True, kw_only=True)
class DCPDrop(Policy):
    """SPEC section 6, inference: a DCP layer marks each held slot dropped (its ``drop``
    flag) as soon as one later token's step mask ``1[z > 0]`` says so, and from that step
    on attention ignores it; this policy then frees the slots so marked. The drop is a
    layer-wide decision, so every kv head keeps the same slots. ``every`` only sets how
    soon the memory comes back (a head holds at most ``every`` flagged tokens more than
    it keeps): the outputs are the same for any value. Its default, 128, because a pass
    costs milliseconds of host time (compaction, the host's page lists) against a decode
    step's fraction of one (H100, 5 layers, 64 x 1536).
    """

    every: int = 128
    snapshot_extras = ("drop",)

    def check(self, model: nn.Module) -> None:
        for i, block in enumerate(model.blocks):
            if not getattr(block.attn, "marks_dropped_slots", False):
                raise ValueError(
                    f"DCPDrop needs DCP attention (--model.attention dcp) in every layer; layer {i} of this "
                    f"{model.config.name} model has none: fine-tune one with lapse train --init-from"
                )

    def keep(self, snap: LayerSnapshot) -> Tensor:
        if snap.extras is None or "drop" not in snap.extras:
            raise ValueError("DCPDrop needs the layer's drop flags in the snapshot (DCP layers append them)")
        alive = snap.extras["drop"][..., 0] == 0  # [B, H, W]: one flag per slot, the same in the group
        return snap.valid & alive
