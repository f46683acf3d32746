"""CASTLE: causal attention with lookahead keys, and CASTLE-SWL (SPEC section 5).

Per head, the base layer's projections give the causal ``Q^C, K^C, V^C`` and three more
give the lookahead ``Q^U, K^U, V^U``; RoPE rotates ``Q^C, K^C`` and ``Q^U, K^U`` (the
paper does not say which tensors get it; SPEC section 5 picks these four)::

    u^t_s = sum_{s < j <= t (, j <= s + W)} sigmoid(q^U_s . k^U_j * scale) v^U_j
    o_t   = softmax_s(q^C_t . k^C_s * scale - SiLU(q^C_t . u^t_s * scale)) V^C,   s <= t

``window=None`` is CASTLE, an int ``W`` CASTLE-SWL. A full forward is
:func:`lapse.ops.castle.castle_attention`. With grouped-query attention the lookahead keys
and values have the layer's ``n_kv_heads`` heads like ``K^C, V^C`` (query head ``h``
reads kv head ``h // (H / K)``); the lookahead vectors ``U`` are per query head.

Decoding over a :class:`~lapse.kv.DenseStore` (the UQ-KV cache): beside each slot's
``k^C, v^C`` the layer appends two per-slot extras, ``u`` ``[B, S, H, D]`` float32 (the
slot's lookahead vector as of the sequence's latest token, a running sum, so kept in
float32 whatever the model's dtype) and ``q_u`` ``[B, S, H, D]`` (its rotated lookahead
query, in the model's dtype); ``k^U, v^U`` of a token are used once and not kept.

- The prefill (``T > 1`` tokens into an empty cache) runs the full forward and stores
  ``U`` at the prompt's end (:func:`~lapse.ops.castle.castle_lookahead_keys`); in a
  ragged prefill each prompt's ``U`` is computed from its own tokens alone (the padding
  after a prompt would otherwise add its lookahead contributions), one call per prompt.
- One token per sequence (the decode step) appends ``u = 0`` and ``q^U``, adds the token's
  lookahead contribution to every held ``u_s`` in place (under SWL only the last ``W``
  slots) and attends over the held slots: :func:`~lapse.ops.castle.castle_decode_step`,
  on CUDA one fused Triton kernel that reads each held slot once and nothing past a
  sequence's length, elsewhere the torch reference. Fixed shapes, no host reads: the
  step compiles (the kernel is the custom op ``lapse::castle_decode``).
- A chunk of ``T > 1`` tokens after a prefix (a prompt continued, eager only) appends all
  ``T`` slots at once and then runs the two decode ops once per token, in order: the
  ``i``-th pass sees the first ``i + 1`` new slots as held, the later ones masked, so it
  equals ``T`` single-token steps (their ``u`` start at 0 and only the slots before a
  token change by it).

- ``fold_every=M`` (opt-in; ``None``, the default, is the update above): the deferred
  update of :func:`~lapse.ops.castle.castle_decode_step` (``pending``). The layer keeps
  a :class:`~lapse.kv.LookaheadRing` in the store (``[B, M, K, D]`` lookahead keys and
  values and their slots, reordered with the batch like every layer state; emptied at a
  prefill); the step attends with the stored ``u`` plus the pending tokens' terms and
  writes ``u`` back once every ``M`` tokens, so the store's ``u`` is ``U^t`` only after a
  fold (:func:`~lapse.ops.castle.castle_decode_fold`). The fold is decided inside the op
  from ``cache_seqlens`` (a sequence folds at ``t mod M = M - 1``), not by the caller:
  the compiled step then has one graph whatever the step, needs no host read or step
  counter, and the generation loop (``lapse.generation``) needs no CASTLE case; the ring
  is allocated at the first, eager call (the prefill) and updated in place after.

Decoding over a :class:`~lapse.kv.PagedStore` (eviction policies): the same two extras,
per slot of each kv head's pages for the ``G`` query heads of its group (``u``
``[P, PS, G * D]`` float32, ``q_u`` ``[P, PS, G * D]``), viewed as ``[P, PS, G, D]`` by
:func:`~lapse.ops.castle.castle_paged_decode_step`, which updates the held slots' ``u``
in place in their pages (under SWL those whose stored position is within ``W`` of the
new token's) and attends over them. The prefill stores the prompt's ``U`` as above; when
the store tracks scores (H2O, A2SF) it also records the prompt's key scores
(:func:`~lapse.ops.castle.castle_key_scores`) and each step's probabilities. Eviction
moves ``u`` and ``q_u`` with the keys (the store compacts every per-slot pool); an
evicted slot takes no further updates, while a kept one was held at every step since its
own and so holds the full ``u^t_s``: under a policy the outputs are full CASTLE's with
the evicted keys masked out of the attention (``ops/castle/README.md``). ``fold_every``
does not apply there: the paged step always runs the immediate update (the same outputs
up to float32 summation order).

Shapes: a trailing comment on each line that makes a new shape. Legend: B batch, T new
tokens, C d_model, H query heads, K key/value heads, D head dim, S cache slots.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lapse.kv import KVCache, LookaheadRing, PagedView
from lapse.ops.castle import (
    castle_attention,
    castle_decode_step,
    castle_key_scores,
    castle_lookahead_keys,
    castle_paged_decode_step,
)
from lapse.ops.castle.common import check_window

from .attention import Attention
from .rotary import RotaryEmbedding, rope_limit


class CastleAttention(Attention):
    """CASTLE attention with RoPE (see the module doc).

    Args: those of :class:`~lapse.layers.Attention` (its ``q_proj, k_proj, v_proj`` are
        ``W^C_Q, W^C_K, W^C_V``), and
        window: ``None`` (CASTLE) or the lookahead window ``W >= 1`` of CASTLE-SWL.
        rope_base: RoPE theta of the causal and the lookahead queries and keys.
        backend: of :func:`~lapse.ops.castle.castle_attention` in full forwards (``auto``:
            Triton on CUDA, the blocked PyTorch path otherwise) and of
            :func:`~lapse.ops.castle.castle_decode_step` when decoding (``naive``: its
            torch reference).
        fold_every: ``None`` (each decode step adds the token into every held ``u_s``) or
            ``M >= 1``: the deferred update, ``u`` written back every ``M`` steps (module
            doc), over a DenseStore only (a PagedStore runs the immediate update). The same
            outputs up to float32 summation order.
    """

    needs_even_head_dim = True
    matrices_per_head = 7
    """``d_model x D`` weight matrices per query head: ``W^U_Q, W^U_K, W^U_V, W^C_Q,
    W^C_K, W^C_V`` and the head's rows of ``W_O`` (4 for softmax attention), so a
    parameter-matched model has 4/7 as many heads (SPEC section 5)."""

    def __init__(self, *args, window: int | None = None, rope_base: float = 500000.0,
                 backend: str = "auto", fold_every: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = check_window(window)
        self.backend = backend
        if fold_every is not None and (not isinstance(fold_every, int) or isinstance(fold_every, bool)
                                       or fold_every < 1):
            raise ValueError(f"fold_every must be None or a positive integer, got {fold_every!r}")
        self.fold_every = fold_every
        c = self.q_proj.in_features
        h, k, d = self.n_heads, self.n_kv_heads, self.head_dim
        self.qu_proj = nn.Linear(c, h * d, bias=False)  # W^U_Q
        self.ku_proj = nn.Linear(c, k * d, bias=False)  # W^U_K
        self.vu_proj = nn.Linear(c, k * d, bias=False)  # W^U_V
        self.rotary = RotaryEmbedding(d, rope_base)

    def extra_repr(self) -> str:
        fold = "" if self.fold_every is None else f", fold_every={self.fold_every}"
        return f"window={self.window}{fold}"

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, positions: Tensor, cache: KVCache | None
    ) -> Tensor:
        b, t, _ = x.shape
        h, kh, d = self.n_heads, self.n_kv_heads, self.head_dim
        q_u = self.qu_proj(x).view(b, t, h, d)  # [B, T, H, D]
        k_u = self.ku_proj(x).view(b, t, kh, d)  # [B, T, K, D]
        v_u = self.vu_proj(x).view(b, t, kh, d)  # [B, T, K, D]
        limit = rope_limit(t, cache, self.context)
        q, k = self.rotary(q, positions, limit), self.rotary(k, positions, limit)
        q_u, k_u = self.rotary(q_u, positions, limit), self.rotary(k_u, positions, limit)
        if cache is None:
            return self._full(q, k, v, q_u, k_u, v_u)
        if isinstance(cache.view(self.layer_idx), PagedView):
            return self._attend_paged(q, k, v, q_u, k_u, v_u, cache)
        ring = None
        if self.fold_every is not None:
            ring = cache.state(self.layer_idx, LookaheadRing).ensure(k_u, self.fold_every)
        if t > 1 and cache.length == 0:  # prefill (t == 1 goes the step's way: no host read)
            cache.append(self.layer_idx, k, v, u=self._prompt_lookahead(q_u, k_u, v_u, cache), q_u=q_u)
            if ring is not None:
                ring[2].fill_(-1)  # U is complete at the prompt's end: nothing pending
            return self._full(q, k, v, q_u, k_u, v_u)
        acc = torch.float64 if q_u.dtype == torch.float64 else torch.float32
        cache.append(self.layer_idx, k, v, u=q_u.new_zeros(q_u.shape, dtype=acc), q_u=q_u)
        view = cache.view(self.layer_idx)
        u_cache, qu_cache = view.extras["u"], view.extras["q_u"]  # [B, S, H, D] each
        backend = "torch" if self.backend == "naive" else self.backend
        out = []
        for i in range(t):  # one pass per new token; t == 1 in the decode step
            seqlens = view.seqlens - (t - 1 - i)  # [B] int32: held slots up to token i
            out.append(castle_decode_step(
                q[:, i], k_u[:, i], v_u[:, i], u_cache, qu_cache, view.k, view.v, seqlens,
                scale=self.scale, window=self.window, check_values=False, backend=backend, pending=ring,
            ))  # [B, H, D]
        return torch.stack(out, dim=1)  # [B, T, H, D]

    def _attend_paged(self, q: Tensor, k: Tensor, v: Tensor, q_u: Tensor, k_u: Tensor, v_u: Tensor,
                      cache: KVCache) -> Tensor:
        """The prefill or one decode step over a :class:`~lapse.kv.PagedStore` (module doc);
        the store refuses more than one token after the prompt."""
        b, t, h, d = q_u.shape
        if t > 1 and cache.length == 0:  # prefill
            u = self._prompt_lookahead(q_u, k_u, v_u, cache)  # [B, T, H, D]
            cache.append(self.layer_idx, k, v, u=u.flatten(2), q_u=q_u.flatten(2))
            if cache.view(self.layer_idx).tracks_scores:
                self._record_prompt_scores(q, k, q_u, k_u, v_u, cache)
            return self._full(q, k, v, q_u, k_u, v_u)
        acc = torch.float64 if q_u.dtype == torch.float64 else torch.float32
        cache.append(self.layer_idx, k, v, u=q_u.new_zeros(b, t, h * d, dtype=acc), q_u=q_u.flatten(2))
        view = cache.view(self.layer_idx)
        pages, page_size = view.k.shape[:2]
        group = (pages, page_size, h // self.n_kv_heads, d)  # [P, PS, G, D]: the pools as the op reads them
        out = castle_paged_decode_step(
            q[:, 0], k_u[:, 0], v_u[:, 0], view.k, view.v, view.extras["u"].view(group),
            view.extras["q_u"].view(group), view.page_table, view.lengths, pos_pages=view.extras["pos"],
            scale=self.scale, window=self.window, return_key_probs=view.tracks_scores, check_values=False,
            backend="naive" if self.backend == "naive" else "auto",
        )
        if not view.tracks_scores:
            return out[:, None]  # [B, 1, H, D]
        o, probs = out
        cache.record_scores(self.layer_idx, probs)  # [B, K, W]
        return o[:, None]

    def _record_prompt_scores(self, q: Tensor, k: Tensor, q_u: Tensor, k_u: Tensor, v_u: Tensor,
                              cache: KVCache) -> None:
        """The prompt's accumulated attention per key ``[B, T, K]`` (H2O, A2SF); in a ragged
        prefill each prompt on its own (the padding after it adds no queries)."""
        def scores_of(rows: slice, n: int | None) -> Tensor:
            return castle_key_scores(*(x[rows, :n].detach() for x in (q, k, q_u, k_u, v_u)),
                                     scale=self.scale, window=self.window, alpha=cache.score_decay)

        self._record_per_prompt(cache, k, scores_of)

    # torch.compile leaves the op eager (a graph break): its Triton path is a Python loop of
    # launches (the wavefront) that Inductor should not trace. Forgetting attention's op is a
    # custom op inside the graph instead (lapse.ops.forgetting.library); CASTLE's could be too.
    @torch.compiler.disable
    def _full(self, q: Tensor, k: Tensor, v: Tensor, q_u: Tensor, k_u: Tensor, v_u: Tensor) -> Tensor:
        def attend(q, k, v, q_u, k_u, v_u):
            return castle_attention(q, k, v, q_u, k_u, v_u, scale=self.scale, window=self.window,
                                    backend=self.backend)

        if self.context is not None:  # head mode: every input is per head
            return self.context.attend(attend, q, k, v, q_u, k_u, v_u)
        return attend(q, k, v, q_u, k_u, v_u)

    def _prompt_lookahead(self, q_u: Tensor, k_u: Tensor, v_u: Tensor, cache: KVCache) -> Tensor:
        """``U`` at the end of each prompt ``[B, T, H, D]`` (float32, float64 for float64):
        in a ragged prefill each from its own tokens, zero over the padding."""
        def keys(q_u, k_u, v_u):
            return castle_lookahead_keys(q_u.detach(), k_u.detach(), v_u.detach(),
                                         scale=self.scale, window=self.window)

        if cache.new_lengths is None:
            return keys(q_u, k_u, v_u)
        acc = torch.float64 if q_u.dtype == torch.float64 else torch.float32
        u = q_u.new_zeros(q_u.shape, dtype=acc)  # [B, T, H, D]
        for b, n in enumerate(cache.new_lengths):
            u[b, :n] = keys(q_u[b : b + 1, :n], k_u[b : b + 1, :n], v_u[b : b + 1, :n])[0]
        return u
