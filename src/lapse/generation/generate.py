"""Token generation with a :class:`~lapse.generation.DenseCache`.

The structure of gpt-fast's ``generate.py``: :func:`prefill` runs the prompt and fills
the cache, :func:`decode_one_token` runs one new token per sequence against it, and
:func:`sample` picks the next token without reading anything back to the host (greedy,
or temperature / top-k sampling by the exponential-race form of the Gumbel-max trick).

Legend: B batch, T prompt length, N new tokens, V vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .cache import DenseCache

if TYPE_CHECKING:  # lapse.models imports this package: no import cycle at run time
    from lapse.models import Decoder


@torch.no_grad()
def prefill(model: Decoder, input_ids: Tensor, cache: DenseCache) -> Tensor:
    """Runs the prompt ``[B, T]`` into ``cache``; returns the last position's logits ``[B, V]``."""
    logits, _ = model(input_ids, cache=cache)  # [B, T, V]
    return logits[:, -1]


@torch.no_grad()
def decode_one_token(model: Decoder, token: Tensor, cache: DenseCache) -> Tensor:
    """Runs one token per sequence ``[B, 1]`` against ``cache``; returns its logits ``[B, V]``."""
    logits, _ = model(token, cache=cache)  # [B, 1, V]
    return logits[:, -1]


def sample(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The next token ``[B, 1]`` (int64) from logits ``[B, V]``.

    ``temperature == 0``: the argmax. Otherwise a draw from ``softmax(logits / temperature)``
    restricted to the ``top_k`` largest logits (all when ``None``): ``argmax_v p_v / E_v``
    with ``E_v ~ Exp(1)`` is distributed as ``p`` (the Gumbel-max trick), and unlike
    ``torch.multinomial`` it never synchronises with the host.
    """
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature  # [B, V]
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    race = torch.empty_like(probs).exponential_(1, generator=generator)  # [B, V]
    return (probs / race).argmax(dim=-1, keepdim=True)


@torch.no_grad()
def generate(
    model: Decoder,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    cache: DenseCache | None = None,
    return_logits: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Continues every prompt by ``max_new_tokens`` tokens (no stop token: all run to the end).

    Args:
        model: a :class:`lapse.models.Decoder`.
        input_ids: ``[B, T]`` the prompts, all of the same length (no padding).
        max_new_tokens: how many tokens to append, at least 1.
        temperature, top_k, generator: see :func:`sample`; greedy by default.
        cache: a cache to continue (its sequences go on with ``input_ids``); a fresh one
            with room for ``T + max_new_tokens`` positions by default.
        return_logits: also return the logits each new token was drawn from.

    Returns:
        ``[B, T + N]`` the prompts followed by the new tokens, and with ``return_logits``
        the logits ``[B, N, V]`` (float32 or the model's dtype if wider).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if cache is None:
        cache = DenseCache(model.config.n_layers, capacity=input_ids.shape[1] + max_new_tokens)
    logits = prefill(model, input_ids, cache)  # [B, V]
    steps = [logits]
    tokens = [sample(logits, temperature, top_k, generator)]  # [B, 1] each
    for _ in range(max_new_tokens - 1):
        logits = decode_one_token(model, tokens[-1], cache)
        steps.append(logits)
        tokens.append(sample(logits, temperature, top_k, generator))
    out = torch.cat([input_ids, *tokens], dim=1)  # [B, T + N]
    if not return_logits:
        return out
    return out, torch.stack(steps, dim=1).to(torch.promote_types(logits.dtype, torch.float32))  # [B, N, V]
