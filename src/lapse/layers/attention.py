"""The attention layer: projections and the Pro pieces around any attention kind.

SPEC section 2. :class:`Attention` projects ``q, k, v``, applies the features it was
built with (KV-shift, QK-norm: the Pro block's input side), hands them to the kind's
:meth:`Attention.attend` (softmax with RoPE, forgetting attention, ...), and applies the
output norm and gate (the Pro block's output side) and the output projection. A kind
is a subclass that implements ``attend``; the features are constructor arguments, so
nothing here knows an architecture name.

Shapes: a trailing comment on each line that makes a new shape. Legend: B batch, T time,
C d_model, H query heads, K key/value heads, D head dim, S cache capacity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lapse.kv import KVCache, PagedView, ShiftState
from lapse.ops import attention_key_scores
from lapse.ops.forgetting import forgetting_attention_paged_decode
from lapse.ops.forgetting.common import qk_norm_bound

from .fused import FusedWeights
from .norm import RMSNorm
from .shift import KVShift


class Attention(nn.Module):
    """One attention layer: ``W_o attend(q, k, v)``, optionally with the Pro pieces.

    Args:
        d_model: width of the residual stream.
        n_heads, n_kv_heads: query and key/value heads (``n_kv_heads`` divides ``n_heads``).
        head_dim: channels per head.
        layer_idx: the layer's index in its model, the key of its decoding state.
        kv_shift: KV-shift on keys and values (Pro).
        qk_norm: per-head RMSNorm of queries and shifted keys (Pro), eps ``qk_norm_eps``.
        output_gate: ``W_o [RMSNorm_head(o) * sigmoid(W_g x)]`` (Pro), eps ``norm_eps``.
    """

    supports_acp = False
    """The kind can prune with ACP (a forget gate to bound the dropped mass with)."""
    needs_even_head_dim = False
    """The kind rotates channel pairs (RoPE)."""
    supports_paged = True
    """The kind decodes over a :class:`~lapse.kv.PagedStore` (eviction policies); one whose
    per-slot state changes after it is written needs its own paged step for that (CASTLE's
    lookahead keys, DCP's aliveness have one) and decodes over a
    :class:`~lapse.kv.DenseStore` until it has it."""
    needs_uniform_heads = False
    """Over a paged store, every kv head of a layer must hold the same slots (the kind
    splits layer-wide per-slot state across the heads' pages)."""
    records_scores = True
    """Over a store that tracks scores, the kind records each key's attention (H2O, A2SF)."""
    context_modes: tuple[str, ...] = ("head",)
    """The modes of :class:`~lapse.layers.context.ContextParallel` the kind's full forward
    runs under (``head`` serves any kind whose attention inputs are per head)."""
    context = None
    """The :class:`~lapse.layers.context.ContextParallel` the layer's full forwards run
    under (:meth:`set_context`), ``None`` in one process."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        layer_idx: int,
        kv_shift: bool = False,
        qk_norm: bool = False,
        output_gate: bool = False,
        norm_eps: float = 1e-6,
        qk_norm_eps: float = 1e-5,
    ):
        super().__init__()
        c, h, k, d = d_model, n_heads, n_kv_heads, head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, k, d
        self.layer_idx = layer_idx
        self.scale = 1.0 / math.sqrt(d)
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, k * d, bias=False)
        self.v_proj = nn.Linear(c, k * d, bias=False)
        self.o_proj = nn.Linear(h * d, c, bias=False)
        self.k_shift = KVShift(c, k) if kv_shift else None
        self.v_shift = KVShift(c, k) if kv_shift else None
        self.q_norm = RMSNorm((h, d), qk_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm((k, d), qk_norm_eps) if qk_norm else None
        self.o_norm = RMSNorm((h, d), norm_eps) if output_gate else None
        self.o_gate = nn.Linear(c, h * d, bias=False) if output_gate else None  # W_g, full width
        # [q; k; v; o_gate] weights in one matrix for one-token steps (fuse_projections)
        self.register_buffer("fused_in_proj", None, persistent=False)
        self._fused = FusedWeights()
        # statistics of the last forward, kept when collect_stats is set (kinds that have any)
        self.collect_stats = False
        self.last_stats = None

    def set_context(self, context) -> None:
        """Run full forwards under ``context`` (a
        :class:`~lapse.layers.context.ContextParallel`, or ``None``: one process): ``x`` then
        holds this rank's tokens of each sequence. A one-line error where the kind or its
        head counts cannot."""
        if context is not None:
            name = type(self).__name__
            if context.mode not in self.context_modes:
                raise ValueError(
                    f"{name} has no {context.mode!r} context parallelism; it runs under "
                    + " or ".join(repr(m) for m in self.context_modes)
                )
            if context.mode == "head" and (self.n_heads % context.size or self.n_kv_heads % context.size):
                raise ValueError(
                    f"head-parallel attention over {context.size} ranks needs heads divisible by "
                    f"{context.size}; {name} has {self.n_heads} query and {self.n_kv_heads} key/value heads"
                )
        self.context = context

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache | None = None) -> Tensor:
        """x ``[B, T, C]`` (the normed block input); positions ``[B, T]`` or ``[1, T]``;
        with a cache the tokens continue the sequences it holds and are appended to it."""
        b, t, _ = x.shape
        if cache is not None and self.context is not None:
            raise ValueError("a layer under context parallelism runs full forwards only, without a cache")
        h, d = self.n_heads, self.head_dim
        q, key, val, gate = self._project(x)
        if cache is not None and t == 1:
            fused = self._fused_step(q, key, val, gate, x, cache)
            if fused is not None:
                return self.o_proj(fused.reshape(b, t, h * d))  # [B, 1, C]
        if self.k_shift is not None:
            key, val = self._shift(key, val, x, cache)
        if self.q_norm is not None:
            q, key = self.q_norm(q), self.k_norm(key)  # QK-norm on q and the shifted k
        o = self.attend(q, key, val, x, positions, cache)  # [B, T, H, D]
        if gate is not None:
            return self.o_proj(self.o_norm(o).reshape(b, t, h * d) * torch.sigmoid(gate))
        return self.o_proj(o.reshape(b, t, h * d))  # [B, T, C]

    def _fused_step(
        self, q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None, x: Tensor, cache: KVCache
    ) -> Tensor | None:
        """A kind's one-token step from the raw projections (``q`` ``[B, 1, H, D]``, ``k``,
        ``v`` ``[B, 1, K, D]``, the output gate's logits ``[B, 1, H * D]`` or ``None``) to
        the input of ``o_proj`` ``[B, 1, H, D]`` (output norm and gate applied), in fewer
        kernels than the separate steps; ``None`` where the kind has no such step or cannot
        take it here (the separate steps run)."""
        return None

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """q ``[B, T, H, D]``, k, v ``[B, T, K, D]`` and the output gate's logits
        ``[B, T, H * D]`` (``None`` without one) of ``x`` ``[B, T, C]``: one product with
        the fused weights in a one-token step without autograd when
        :meth:`fuse_projections` made them, else one per projection."""
        b, t, _ = x.shape
        h, k, d = self.n_heads, self.n_kv_heads, self.head_dim
        w = self.fused_in_proj if t == 1 and not torch.is_grad_enabled() else None
        if w is not None and not torch.compiler.is_compiling():  # compiled: checked before the call
            w = self.refresh_fused()
        if w is not None:
            parts = F.linear(x, w).split([h * d, k * d, k * d, w.shape[0] - (h + 2 * k) * d], dim=-1)
            q, key, val, gate = parts
            gate = gate if self.o_gate is not None else None
        else:
            q, key, val = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            gate = self.o_gate(x) if self.o_gate is not None else None
        return q.view(b, t, h, d), key.view(b, t, k, d), val.view(b, t, k, d), gate

    @torch.no_grad()
    def fuse_projections(self, enabled: bool = True, keep: bool = True) -> None:
        """Copies the q, k, v (and output gate) weights into one matrix that one-token
        steps without autograd multiply with once; ``enabled=False`` stops using it (and
        frees it unless ``keep``).
        Use :meth:`lapse.models.Decoder.fused_projections`, which does both.

        The decode step's small GEMMs are bound by kernel latency: on an H100 four
        ``[8, 768] x [768, 768]`` products take 12.7 us and their fused ``768 -> 3072``
        one 3.3 us (bf16). A copy, not a view, written into the
        matrix made before when the shapes agree, so a captured CUDA graph keeps reading
        the same memory. Skipped (the separate projections run) for sharded weights
        (DTensors: FSDP2, tensor parallelism)."""
        if not enabled:
            self.fused_in_proj = None
            if not keep:  # else the next snapshot is written into the same memory
                self._fused.free()
            return
        self.fused_in_proj = self._fused.take(self._fused_linears())

    def refresh_fused(self) -> Tensor | None:
        """The fused weights (``None`` when not fusing), taken again first if a source
        weight changed since (in place, converted, moved or reloaded: ``FusedWeights``).
        ``_project`` calls it in eager steps; a compiled step cannot (reading a weight's
        address breaks the graph), so :func:`lapse.generation.compiled_decode_one_token`
        calls it through :meth:`lapse.models.Decoder.refresh_fused_projections` first."""
        return self._fused.refresh(self, "fused_in_proj")

    def _fused_linears(self) -> list[nn.Linear]:
        linears = [self.q_proj, self.k_proj, self.v_proj]
        return linears if self.o_gate is None else [*linears, self.o_gate]

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, positions: Tensor, cache: KVCache | None
    ) -> Tensor:
        """The kind's attention: q ``[B, T, H, D]``, k, v ``[B, T, K, D]`` -> ``[B, T, H, D]``.

        ``x`` is the layer input (for gates computed from it); with a cache, the kind
        appends its keys and values (and its extras) and attends to everything held."""
        raise NotImplementedError

    def _shift(self, key: Tensor, val: Tensor, x: Tensor, cache: KVCache | None) -> tuple[Tensor, Tensor]:
        """KV-shift, continued from the cached last pre-shift projections (``x_0 = 0``)."""
        if cache is None:
            ctx = self.context
            return self.k_shift.shift(key, x, context=ctx), self.v_shift.shift(val, x, context=ctx)
        state = cache.state(self.layer_idx, ShiftState)
        k_prev, v_prev = state.ensure(key, val)  # [B, 1, K, D]
        shifted = self.k_shift.shift(key, x, k_prev), self.v_shift.shift(val, x, v_prev)
        k_prev.copy_(cache.last(key)[:, None])
        v_prev.copy_(cache.last(val)[:, None])
        return shifted

    def _paged_decode(self, q: Tensor, view: PagedView, cache: KVCache, backend: str,
                      c_query: Tensor | None = None) -> Tensor:
        """One new token per sequence over a paged store (its key already appended):
        ``[B, 1, H, D]`` (the store refuses more tokens after a prefix); records the step's
        attention per slot where the store tracks scores."""
        out = forgetting_attention_paged_decode(
            q[:, 0], view.k, view.v, view.page_table, view.lengths,
            c_pages=view.extras.get("c"), c_query=c_query, scale=self.scale,
            return_key_probs=view.tracks_scores, check_values=False, backend=backend,
        )
        if not view.tracks_scores:
            return out[:, None]
        o, probs = out
        cache.record_scores(self.layer_idx, probs)  # [B, K, W]
        return o[:, None]  # [B, 1, H, D]

    def _record_prefill_scores(
        self,
        q: Tensor,
        k: Tensor,
        cache: KVCache,
        log_fgate: Tensor | None = None,
        lse: Tensor | None = None,
    ) -> None:
        """The prompt's accumulated attention per key (H2O, A2SF), without an L x L matrix;
        ``lse`` ``[B, H, T]``: the forward's row log-sum-exp when it has one (else a pass
        computes it). In a ragged prefill each prompt is scored on its own (the padding
        after it must not add its queries' attention, and A2SF's weights count from
        each prompt's last token)."""
        def scores_of(rows: slice, n: int | None) -> Tensor:
            return attention_key_scores(
                q[rows, :n], k[rows, :n],
                log_fgate=None if log_fgate is None else log_fgate[rows, :n],
                lse=None if lse is None else lse[rows, :, :n],
                scale=self.scale, alpha=cache.score_decay,
            )

        self._record_per_prompt(cache, k, scores_of)

    def _record_per_prompt(self, cache: KVCache, k: Tensor, scores_of) -> None:
        """Records ``scores_of(rows, n)`` (the key scores ``[b, n, K]`` of the batch rows
        ``rows`` over their first ``n`` tokens; ``n`` ``None``: all) as the prompt's: of the
        whole batch at once, or, in a ragged prefill, of each prompt on its own tokens."""
        if cache.new_lengths is None:
            scores = scores_of(slice(None), None)  # [B, T, K]
        else:
            scores = torch.zeros(*k.shape[:3], dtype=torch.float32, device=k.device)  # [B, T, K]
            for b, n in enumerate(cache.new_lengths):
                scores[b, :n] = scores_of(slice(b, b + 1), n)[0]
        cache.record_prefill_scores(self.layer_idx, scores)

    @torch.no_grad()
    def logit_bound(self) -> Tensor | None:
        """A bound ``U_h >= max |scale q.k|`` per query head ``[H]`` that holds for any
        input, or ``None`` when the layer has none.

        With QK-norm: ``max|g_q,h| * max|g_k,h| * D * scale``; an RMS-normalised vector
        with gains g has norm at most ``max|g| sqrt(D)``, so no pass over the data is
        needed (SPEC section 3), with a factor for the rounding of 16-bit q and k
        (:func:`~lapse.ops.forgetting.common.qk_norm_bound`). Without it a bound needs the data.
        """
        if self.q_norm is None:
            return None
        g_q = self.q_norm.weight.abs().amax(-1).float()  # [H]
        g_k = self.k_norm.weight.abs().amax(-1).float()  # [K]
        g_k = g_k.repeat_interleave(self.n_heads // self.n_kv_heads)  # [H]
        return qk_norm_bound(g_q, g_k, self.head_dim, self.scale)  # [H]

    def qk_sources(self) -> tuple[nn.Module, nn.Module]:
        """The submodules whose outputs are the ``q`` and ``k`` that :meth:`attend` receives
        (after QK-norm when there is one, which follows the KV-shift)."""
        if self.q_norm is not None:
            return self.q_norm, self.k_norm
        return self.q_proj, self.k_proj
