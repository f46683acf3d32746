"""Training DCP models (SPEC section 6): the alpha schedule, the sparsity term, what it drops.

    loss  = LM cross-entropy + gamma * mean over DCP layers of mean_{j < k} I[k, j]
    alpha = a cosine from alpha_start (first step) to alpha_end (last step)

:class:`DCPTraining` drives the model's :class:`~lapse.layers.DCPAttention` layers: it
sets their ``alpha`` from the step (a resumed run continues the schedule), has them keep
each full forward's ``log I``, turns those into the penalty after the forward, and counts
the share of context dropped per layer (under the training mask in training, under the
step mask of inference in validation).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lapse.layers import DCPAttention
from lapse.layers.dcp import take_log_masks
from lapse.ops.dcp import dcp_sparsity_loss

from .config import DCPTrainConfig


def alpha_at(step: int, steps: int, cfg: DCPTrainConfig) -> float:
    """alpha of optimizer step ``step`` (0-based) of ``steps``: ``alpha_start`` at the first
    step, ``alpha_end`` at the last, a half cosine between."""
    progress = min(step / max(steps - 1, 1), 1.0)
    return cfg.alpha_end + 0.5 * (cfg.alpha_start - cfg.alpha_end) * (1 + math.cos(math.pi * progress))


def dcp_layers(model: nn.Module) -> list[DCPAttention]:
    """The model's DCP attention layers, in order."""
    return [m for m in model.modules() if isinstance(m, DCPAttention)]


class DCPTraining:
    """The DCP part of a training run over ``layers`` (see the module doc).

    Call :meth:`set_step` before each optimizer step and the instance itself after each
    training forward (it returns the penalty to add to the loss); :meth:`observe` after a
    forward whose mask only counts (validation).
    """

    def __init__(self, layers: list[DCPAttention], cfg: DCPTrainConfig, steps: int, device: torch.device):
        if not layers:
            raise ValueError("DCP training needs a model with DCP attention (model.attention='dcp')")
        self.layers, self.cfg, self.steps = layers, cfg, steps
        self.alpha = cfg.alpha_start
        for layer in layers:
            layer.keep_log_mask = True
        self._dropped = torch.zeros(len(layers), device=device)  # [L] summed over forwards
        self._term = torch.zeros((), device=device)  # the unweighted sparsity term, summed
        self._forwards = 0

    def set_step(self, step: int) -> None:
        self.alpha = alpha_at(step, self.steps, self.cfg)
        for layer in self.layers:
            layer.alpha = self.alpha

    def observe(self) -> tuple[list[Tensor], Tensor]:
        """The ``log I`` of each layer's last forward (taken from the layers) and the share
        of context each dropped ``[L]`` (mean over positions ``k >= 1`` of dropped / k)."""
        return take_log_masks(self.layers)

    def __call__(self) -> Tensor:
        """The penalty ``gamma * mean over layers of dcp_sparsity_loss`` of the forward just
        run (differentiable; a zero constant when ``gamma`` is 0), counted for :meth:`take`."""
        masks, dropped = self.observe()
        self._dropped += dropped.to(self._dropped.device)
        self._forwards += 1
        if self.cfg.gamma == 0:
            return torch.zeros((), device=self._term.device)
        term = torch.stack([dcp_sparsity_loss(m) for m in masks]).mean()
        self._term += term.detach().float()
        return self.cfg.gamma * term

    def take(self) -> tuple[Tensor, Tensor]:
        """Mean dropped share per layer ``[L]`` and mean sparsity term over the forwards
        since the last call (device tensors), and start counting anew."""
        n = max(self._forwards, 1)
        out = self._dropped / n, self._term / n
        self._dropped, self._term = torch.zeros_like(self._dropped), torch.zeros_like(self._term)
        self._forwards = 0
        return out
