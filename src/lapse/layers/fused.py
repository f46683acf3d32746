"""Weights concatenated for one-token steps: the decode step's small GEMMs are bound by
kernel latency, so products of one input with several weights run as one."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def fuse_weights(existing: Tensor | None, weights: list[Tensor]) -> Tensor:
    """``cat(weights)`` along the output dim, written into ``existing`` when its shape,
    dtype and device agree (its memory stays put for a captured CUDA graph), else fresh.

    The layers keep the result in a plain attribute and expose it as a buffer only while
    :meth:`lapse.models.Decoder.fused_projections` is active: a snapshot of the weights,
    taken at entry, that a later change of the weights cannot leave stale outside it."""
    rows = sum(w.shape[0] for w in weights)
    w0 = weights[0]
    if (
        existing is not None
        and existing.shape == (rows, w0.shape[1])
        and existing.dtype == w0.dtype
        and existing.device == w0.device
        and existing.is_inference() == torch.is_inference_mode_enabled()
    ):
        return torch.cat(weights, out=existing)
    return torch.cat(weights)
