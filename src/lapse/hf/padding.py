"""Left (or right) padding of a prompt as a ragged batch: where each row's tokens start,
how many there are, and rows moved so that their tokens come first (both the lapse adapter
and :class:`~lapse.hf.EvictingCache` run a padded prompt this way)."""

from __future__ import annotations

import torch
from torch import Tensor


def padding_runs(mask: Tensor | None, t: int, fresh: bool) -> tuple[Tensor | None, Tensor | None]:
    """Where each row's tokens start ``[B]`` and how many there are ``[B]``, for an
    ``attention_mask`` with zeros; ``(None, None)`` without padding. One line of error
    for a mask that is not one contiguous run of ones per row."""
    if mask is None or bool((mask == 1).all()):
        return None, None
    if not fresh:
        if bool((mask[:, -t:] != 1).any()):
            raise ValueError(
                "attention_mask marks new tokens as padding after a prefix: lapse pads only the first "
                "call (the prompt); later calls bring one real token per sequence"
            )
        return None, None  # the cache holds no padding; the earlier zeros were the prompt's
    mask = mask[:, -t:].long()  # [B, T]
    lengths = mask.sum(1)  # [B]
    start = mask.argmax(1)  # [B] the first 1
    pos = torch.arange(t, device=mask.device)
    run = (pos >= start[:, None]) & (pos < (start + lengths)[:, None])  # [B, T]
    if bool((lengths == 0).any()) or not torch.equal(run, mask.bool()):
        raise ValueError(
            "attention_mask must mark one contiguous run of tokens per row (left or right padding), "
            "with at least one token"
        )
    return start, lengths


def roll_rows(x: Tensor, shift: Tensor) -> Tensor:
    """Row ``b`` of ``x`` ``[B, T, ...]`` moved ``shift[b]`` places to the left, cyclically."""
    t = x.shape[1]
    index = (torch.arange(t, device=x.device) + shift[:, None].to(x.device)) % t  # [B, T]
    return x.gather(1, index.view(*index.shape, *(1,) * (x.dim() - 2)).expand_as(x))
