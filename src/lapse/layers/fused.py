"""Weights concatenated for one-token steps: the decode step's small GEMMs are bound by
kernel latency, so products of one input with several weights run as one."""

from __future__ import annotations

import torch
from torch import Tensor, nn

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # a build without torch.distributed meets no DTensor: isinstance(w, ()) is False
    DTensor = ()


@torch.no_grad()
def fuse_weights(existing: Tensor | None, weights: list[Tensor]) -> Tensor:
    """``cat(weights)`` along the output dim, written into ``existing`` when its shape,
    dtype and device agree (its memory stays put for a captured CUDA graph), else fresh."""
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


def _stamp(w: Tensor) -> tuple:
    """What tells, without reading the values, that ``w`` changed: its address, dtype and
    device (``.to()``, ``load_state_dict(assign=True)``) and its version counter, which every
    in-place write through it bumps (``mul_``, ``load_state_dict``, an optimizer step).
    Inference tensors keep no version counter."""
    return w.data_ptr(), w.dtype, w.device, None if w.is_inference() else w._version


def _weight(lin: nn.Linear) -> Tensor:
    """``lin.weight``; read from ``_parameters`` first, as a Module's ``__getattr__`` costs
    more than the stamp (a parametrized weight is computed, not held there)."""
    w = lin._parameters.get("weight")
    return lin.weight if w is None else w


class FusedWeights:
    """A layer's snapshot ``cat(weights)`` of some of its ``nn.Linear`` layers, and the
    stamps of the weights it was taken from.

    The layers keep it in a plain attribute and expose :attr:`weight` as a buffer only
    while :meth:`lapse.models.Decoder.fused_projections` is active. :meth:`current`
    compares the stamps before a use and takes the snapshot again (into the same memory
    where it can) when a weight changed since. Writes that bypass the version counter
    go unseen: through ``w.data``, in place to an inference tensor, and by the fused
    optimizers (``torch.optim.AdamW(fused=True)``: no bump, torch 2.13 on CPU); enter the
    context again after those (entering always copies the weights)."""

    def __init__(self) -> None:
        self.weight: Tensor | None = None
        self._linears: list[nn.Linear] = []
        self._stamps: list[tuple] = []

    def take(self, linears: list[nn.Linear]) -> Tensor | None:
        """Copies the weights of ``linears`` into :attr:`weight` and returns it; ``None``
        (nothing fused) for sharded weights."""
        weights = [lin.weight for lin in linears]
        # FSDP2 and tensor parallelism hold DTensor shards: their concatenation is no matrix
        # the layer's plain input can multiply with, so the separate projections run
        if any(isinstance(w, DTensor) for w in weights):
            self.free()
            return None
        self.weight = fuse_weights(self.weight, weights)
        self._linears, self._stamps = list(linears), [_stamp(w) for w in weights]
        return self.weight

    def current(self) -> Tensor | None:
        """:attr:`weight`, taken again first if a weight changed since the last
        :meth:`take`. Host work only (no read of the device), about a microsecond per weight."""
        if [_stamp(_weight(lin)) for lin in self._linears] != self._stamps:
            return self.take(self._linears)
        return self.weight

    def free(self) -> None:
        self.weight, self._linears, self._stamps = None, [], []

    def refresh(self, module: nn.Module, name: str) -> Tensor | None:
        """``module``'s buffer ``name`` that exposes :attr:`weight` (``None`` when not
        fusing), set to the snapshot taken again first if a source weight changed since
        (:meth:`current`); a module's ``__setattr__`` costs microseconds, so only then."""
        w = module._buffers[name]
        if w is not None and (fresh := self.current()) is not w:
            setattr(module, name, fresh)
            w = fresh
        return w
