"""Softmax attention with RoPE (the Transformer baselines, SPEC section 2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from lapse.kv import KVCache, PagedView
from lapse.ops.forgetting import forgetting_attention_cached

from .attention import Attention
from .rotary import RotaryEmbedding, rope_limit


class SoftmaxAttention(Attention):
    """Causal ``softmax(scale q k^T) v`` with RoPE on q and k, by PyTorch's SDPA.

    With a cache: the first call (prefill) runs causal SDPA on its own tokens; later calls
    attend over the held keys: on CUDA one token by the decode op without a forget gate
    (:func:`~lapse.ops.forgetting.forgetting_attention_cached` with no ``c``: the split-K
    kernel, which reads only each row's held slots), otherwise by SDPA with a mask
    ``key position <= query position`` over the whole buffer (one token: a fixed shape for
    compiled decoding); over a paged store by the paged decode op (no bias).

    Args: those of :class:`~lapse.layers.Attention`, and ``rope_base`` (theta).
    """

    needs_even_head_dim = True
    context_modes = ("head", "gather")

    def __init__(self, *args, rope_base: float = 500000.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.rotary = RotaryEmbedding(self.head_dim, rope_base)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, positions: Tensor, cache: KVCache | None
    ) -> Tensor:
        t = q.shape[1]
        q, k = self._rotate(q, k, positions, cache)
        if cache is None:
            if self.context is not None:
                return self.context.attend(lambda q, k, v: self._sdpa(q, k, v, None), q, k, v)
            return self._sdpa(q, k, v, None)
        first = t > 1 and cache.length == 0  # prefill: its own tokens, causal
        cache.append(self.layer_idx, k, v)
        view = cache.view(self.layer_idx)
        if first:
            if isinstance(view, PagedView) and view.tracks_scores:
                self._record_prefill_scores(q, k, cache)
            return self._sdpa(q, k, v, None)
        if isinstance(view, PagedView):
            return self._paged_decode(q, view, cache, "auto")
        keys, values = view.k, view.v  # [B, S, K, D]
        fast = q.is_cuda and q.dtype != torch.float64 and q.shape[-1] <= 256
        if t == 1 and fast and not (torch.is_grad_enabled() and q.requires_grad):
            # the split-K kernel (an inference op): 5-45% faster than cuDNN SDPA here
            return forgetting_attention_cached(
                q, keys, values, None, view.seqlens, scale=self.scale, check_values=False
            )  # [B, 1, H, D]
        if t > 1:  # a chunk after a prefix (eager): only the held slots
            n = cache.length + t
            keys, values = keys[:, :n], values[:, :n]
        slots = torch.arange(keys.shape[1], device=q.device)  # [S]
        mask = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
        return self._sdpa(q, keys, values, mask[:, None])

    def _rotate(
        self, q: Tensor, k: Tensor, positions: Tensor, cache: KVCache | None
    ) -> tuple[Tensor, Tensor]:
        """RoPE on q and k at ``positions``, its table sized for the cache's capacity."""
        limit = rope_limit(q.shape[1], cache, self.context)
        return self.rotary(q, positions, limit), self.rotary(k, positions, limit)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """SDPA in ``[B, T, H, D]`` layout; causal when no mask is given, the queries at the
        end of the keys when there are fewer of them."""
        b, t, h, d = q.shape
        if mask is None and t != k.shape[1]:
            mask = causal_lower_right(t, k.shape[1])
        # One query: [B, H, 1, D] as a view of [B, H, D], so its stride over the query dim is
        # D. Inductor may otherwise give that size-1 dim stride 1, which the memory-efficient
        # kernel rejects ("query is not correctly aligned", torch 2.11, head dim 16).
        q = q.reshape(b, h, d).unsqueeze(2) if t == 1 else q.transpose(1, 2)
        return F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
            enable_gqa=self.n_heads != self.n_kv_heads,
        ).transpose(1, 2)  # [B, T, H, D]
