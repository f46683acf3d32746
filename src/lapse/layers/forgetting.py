"""Forgetting attention (FoX, SPEC section 1) with Adaptive Computation Pruning (section 3)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lapse.kv import GateState, KVCache, PagedView, ShiftState
from lapse.ops.backend import triton_usable
from lapse.ops.forgetting import (
    cumulative_log_gates,
    forgetting_attention,
    forgetting_attention_cached,
    forgetting_attention_decode,
    forgetting_decode_input,
)
from lapse.ops.forgetting.common import ACP_BLOCK, LOG_GATE_FLOOR, AttentionStats, tile_areas
from lapse.ops.forgetting.library import compiled_forgetting_attention

from .attention import Attention
from .norm import gate_linear

_OWN_BOUND = object()  # ForgettingAttention._full's default: the layer's own ACP bound


class ForgettingAttention(Attention):
    """Softmax attention with a forget gate ``log f_t = logsigmoid(W_f x_t + b_f)`` per
    query head and no positional encoding: :func:`lapse.ops.forgetting_attention`.

    With a cache: each token's cumulative log gate ``c_j`` (float64) is kept beside its
    key; the first call (prefill) runs the full-sequence op (ACP included), later calls
    :func:`lapse.ops.forgetting.forgetting_attention_cached` (one token: the split-K
    decode kernel on CUDA), or over a paged store
    :func:`lapse.ops.forgetting.forgetting_attention_paged_decode`. ACP prunes only in the
    full-sequence op; at decoding time the ``ACPBoundary`` eviction policy carries it on.

    Args: those of :class:`~lapse.layers.Attention`, and
        acp: prune with ACP (SPEC section 3), tolerance ``acp_eps``. The bound ``U`` is
            :meth:`~lapse.layers.Attention.logit_bound` where the layer has one (QK-norm),
            else the op's ``"auto"`` (from the largest query and key norms).
        backend: the op's backend (``auto``, ``triton``, ``torch``, ``naive``).
    """

    supports_acp = True
    context_modes = ("head", "gather")

    def __init__(self, *args, acp: bool = False, acp_eps: float = math.exp(-10),
                 backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.acp, self.acp_eps, self.backend = acp, acp_eps, backend
        self.fgate = nn.Linear(self.q_proj.in_features, self.n_heads, bias=True)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, positions: Tensor, cache: KVCache | None
    ) -> Tensor:
        # log gates in float32 (SPEC section 1), float64 when the model runs in float64
        log_fgate = F.logsigmoid(gate_linear(self.fgate, x))  # [B, T, H]
        if cache is None:
            if self.context is not None:
                return self._full_context(q, k, v, log_fgate)
            return self._full(q, k, v, log_fgate)
        b, t, h, _ = q.shape
        first = t > 1 and cache.length == 0  # prefill: the full-sequence op
        c_last = cache.state(self.layer_idx, GateState).ensure(b, h, q.device)  # [B, H] float64
        c = cumulative_log_gates(log_fgate, initial=c_last, dtype=torch.float64)  # [B, T, H]
        c_last.copy_(cache.last(c))
        cache.append(self.layer_idx, k, v, c=c)
        view = cache.view(self.layer_idx)
        paged = isinstance(view, PagedView)
        if first:
            if not (paged and view.tracks_scores):
                return self._full(q, k, v, log_fgate)
            o, lse = self._full(q, k, v, log_fgate, return_lse=True)  # the scores reuse its lse
            self._record_prefill_scores(q, k, cache, log_fgate, lse)
            return o
        backend = "torch" if self.backend == "naive" else self.backend
        if paged:
            return self._paged_decode(q, view, cache, backend, c_query=c[:, -1])
        return forgetting_attention_cached(
            q, view.k, view.v, view.extras["c"], view.seqlens,
            scale=self.scale, backend=backend, check_values=False,
        )  # [B, T, H, D]

    def _fused_step(
        self, q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None, x: Tensor, cache: KVCache
    ) -> Tensor | None:
        """A one-token step over a store that lets a kernel write its slots (a dense one)
        with the Triton backend and no autograd: the forget gate, ``c_t``, the KV-shift,
        the QK-norm and the cache writes in one kernel
        (:func:`~lapse.ops.forgetting.forgetting_decode_input`), then the split-K decode
        kernel with the output norm and gate in its epilogue. The same function as the
        separate steps (tests hold them together); six kernels fewer per FoX (Pro) layer
        in a compiled step (``BENCHMARKS.md``)."""
        triton = self.backend == "triton" or (self.backend == "auto" and x.is_cuda)
        if torch.is_grad_enabled() or x.dtype == torch.float64 or not (triton and triton_usable(x)):
            return None
        b, _, h, _ = q.shape
        c_last = cache.state(self.layer_idx, GateState).ensure(b, h, x.device)  # [B, H] float64
        write_targets = getattr(cache, "write_targets", None)  # None: a store of another kind
        targets = None if write_targets is None else write_targets(self.layer_idx, k, v, c=c_last[:, None])
        if targets is None:
            return None
        k_buf, v_buf, extras, slot = targets
        k_prev = v_prev = None
        if self.k_shift is not None:
            k_prev, v_prev = cache.state(self.layer_idx, ShiftState).ensure(k, v)
        norm = self.q_norm is not None
        q = forgetting_decode_input(
            x[:, 0], q[:, 0], k[:, 0], v[:, 0],
            fgate_weight=self.fgate.weight, fgate_bias=self.fgate.bias,
            k_shift_weight=self.k_shift.weight if k_prev is not None else None,
            v_shift_weight=self.v_shift.weight if k_prev is not None else None,
            q_norm_weight=self.q_norm.weight if norm else None,
            k_norm_weight=self.k_norm.weight if norm else None,
            eps=self.q_norm.eps if norm else 0.0,
            c_last=c_last, k_prev=k_prev, v_prev=v_prev,
            k_cache=k_buf, v_cache=v_buf, c_cache=extras["c"], slot=slot, backend="triton",
        )  # [B, H, D]
        view = cache.view(self.layer_idx)
        gated = {}
        if gate is not None:
            gated = dict(out_norm_weight=self.o_norm.weight, out_gate=gate.view(q.shape),
                         out_norm_eps=self.o_norm.eps)
        return forgetting_attention_decode(
            q, view.k, view.v, view.extras["c"], view.seqlens,
            scale=self.scale, backend="triton", check_values=False, **gated,
        )[:, None]  # [B, 1, H, D]

    def _full_context(self, q: Tensor, k: Tensor, v: Tensor, log_fgate: Tensor) -> Tensor:
        """:meth:`_full` over the whole sequence under context parallelism, for this rank's
        tokens. In ``head`` mode a per-head ACP bound is cut to the rank's heads; in
        ``gather`` mode each query chunk attends to the keys before its end, with the gates
        of those keys, so the biases (and the tiles ACP prunes) are the one-process op's."""
        ctx = self.context
        bound = self.acp_bound()
        if isinstance(bound, Tensor) and ctx.mode == "head":
            bound = bound[ctx.head_slice(self.n_heads)]
        calls = []  # with collect_stats: each call's statistics, (queries, keys, keys not sent)

        def attend(q: Tensor, k: Tensor, v: Tensor, log_fgate: Tensor, eps: float = self.acp_eps,
                   skipped: int = 0) -> Tensor:
            o = self._full(q, k, v, log_fgate, acp=bound, acp_eps=eps)
            if self.collect_stats:
                calls.append((self.last_stats, q.shape[1], k.shape[1], skipped))
            return o

        if ctx.mode == "gather" and isinstance(bound, Tensor):
            o = self._gather_kept(attend, q, k, v, log_fgate, bound)
        else:
            o = ctx.attend(attend, q, k, v, log_fgate)
        if self.collect_stats:
            self.last_stats = self._row_stats(calls, q.shape[0])
        return o

    # Eager as a whole: which keys travel is decided on the host (one read of the first kept
    # key per chunk, then the all-to-all's sizes), which Dynamo cannot trace; disabled here,
    # a compiled block breaks once around it rather than falling back to eager in the middle
    # of the plan's loops.
    @torch.compiler.disable
    def _gather_kept(self, attend, q: Tensor, k: Tensor, v: Tensor, log_fgate: Tensor,
                     bound: Tensor) -> Tensor:
        """``gather`` mode with an ACP bound that needs no data (QK-norm's): only the keys
        some row of a chunk keeps are sent to it. The row's gates are gathered first (one
        float per token and head); keys ``j`` with ``c_q0 - c_j < delta`` for the chunk's
        first query ``q0`` and every head (so for all its queries, ``c`` falling along the
        row) weigh below ``(eps / 2) / T`` each and are neither sent nor computed; the op
        prunes within the rest at ``eps / 2``: the pruned mass of a row stays below eps."""
        ctx = self.context
        n = q.shape[1] // 2
        gates = ctx.gather(log_fgate.detach())  # [B, T, H]
        with torch.no_grad():
            # c of cumulative_log_gates, scanned along the last, contiguous dim of [B, H, T]:
            # CUDA's float64 scan along any other dim is slow (5.8 ms a layer at T 32k on an
            # H200, most of the plan); -c grows along the row
            r = gates.to(torch.float64).clamp_min(LOG_GATE_FLOOR).transpose(1, 2).contiguous()
            rising = -torch.cumsum(r, dim=-1)  # [B, H, T]
            t = rising.shape[-1]
            u = bound.to(rising.device, torch.float64).expand(self.n_heads)  # [H]
            delta = -2.0 * u - math.log(t) + math.log(self.acp_eps / 2)  # [H]
            firsts = []
            for chunk in ctx.chunks:
                q0 = chunk * n
                limit = (rising[:, :, q0] + delta)[..., None]  # [B, H, 1]: keep j iff -c_j >= this
                firsts.append(torch.searchsorted(rising, limit).amin().clamp_max(q0))
        starts, intervals, (keys, values, kept_gates) = ctx.gather_ranges(
            torch.stack(firsts), k, v, log_fgate)

        def rows_of(lo: int, hi: int) -> slice:  # [lo, hi) as indices of the gathered tokens
            at = 0
            for a, b in intervals:
                if a <= lo and hi <= b:
                    return slice(at + lo - a, at + hi - a)
                at += b - a
            raise AssertionError(f"[{lo}, {hi}) was not gathered")

        out = []
        for i, (chunk, start) in enumerate(zip(ctx.chunks, starts, strict=True)):
            rows = rows_of(start, (chunk + 1) * n)
            out.append(attend(q[:, i * n : (i + 1) * n], keys[:, rows], values[:, rows], kept_gates[:, rows],
                              eps=self.acp_eps / 2, skipped=start))
        return torch.cat(out, dim=1)  # [B, 2n, H, D]

    @torch.no_grad()
    def _row_stats(self, calls: list, batch: int) -> AttentionStats:
        """The pruned share of each whole row and head ``[B, H]`` under context
        parallelism: one minus the tile area this rank's calls computed (summed over the
        row's ranks) over the row's causal tile area in one process. At most the share
        whole-tile pruning can reach (one process keeps every diagonal tile; a call that
        was sent only the keys it keeps may compute a little less), so FLOPs counted from it
        never exceed the work done. ``block_start`` is left empty (each call has its own
        tile grid)."""
        ctx, h = self.context, self.n_heads
        dev = calls[0][0].block_start.device
        computed = torch.zeros(batch, h, dtype=torch.float64, device=dev)
        heads = ctx.head_slice(h) if ctx.mode == "head" else slice(None)
        full = lambda n: torch.full((batch,), n, device=dev)  # noqa: E731
        for stats, tq, tk, _ in calls:
            p, c = tile_areas(stats.block_start, full(tq), full(tk))
            computed[:, heads] += c[:, None] - p
        t = ctx.global_length(2 * calls[0][1]) if ctx.mode == "gather" else calls[0][1]
        m = -(-t // ACP_BLOCK)
        _, causal = tile_areas(torch.zeros(batch, 1, m, dtype=torch.int32, device=dev), full(t), full(t))
        rows = torch.tensor([min(ACP_BLOCK, t - i * ACP_BLOCK) for i in range(m)], dtype=torch.float64)
        most = 1 - float((rows * rows).sum()) / float(causal[0])  # all but the diagonal tiles
        fraction = (1 - ctx.total(computed) / causal[:, None]).clamp(0, most)  # [B, H]
        return AttentionStats(fraction.float(), torch.empty(batch, h, 0, dtype=torch.int32, device=dev))

    def _full(
        self, q: Tensor, k: Tensor, v: Tensor, log_fgate: Tensor, return_lse: bool = False,
        acp: Tensor | str | None | object = _OWN_BOUND, acp_eps: float | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """FoX attention over the whole sequence (training, or the prefill); with
        ``return_lse`` also its row log-sum-exp ``[B, H, T]``. While compiling, the Triton
        path goes through custom ops the compiler keeps in the block's graph
        (:mod:`lapse.ops.forgetting.library`); anything else runs eager, outside it.
        ``acp``, ``acp_eps``: the ACP bound and tolerance, the layer's own unless given."""
        if acp is _OWN_BOUND:
            acp = self.acp_bound()
        acp_eps = self.acp_eps if acp_eps is None else acp_eps
        triton = self.backend == "triton" or (self.backend == "auto" and q.is_cuda)
        if (torch.compiler.is_compiling() and triton and not (return_lse or self.collect_stats)
                and q.dtype != torch.float64):
            return compiled_forgetting_attention(
                q, k, v, log_fgate, scale=self.scale, acp=acp, acp_eps=acp_eps
            )
        return self._full_eager(q, k, v, log_fgate, return_lse, acp, acp_eps)

    # torch.compile cannot trace the op's Triton kernels: Inductor re-compiles user Triton
    # kernels itself and fails on the forward kernel's nested @triton.jit helpers (Triton 3.6,
    # torch 2.11). The Triton path has custom ops for it (_full); this is every other case.
    @torch.compiler.disable
    def _full_eager(
        self, q: Tensor, k: Tensor, v: Tensor, log_fgate: Tensor, return_lse: bool = False,
        acp: Tensor | str | None = None, acp_eps: float | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        out = forgetting_attention(
            q, k, v, log_fgate,
            scale=self.scale, acp=acp, acp_eps=self.acp_eps if acp_eps is None else acp_eps,
            return_lse=return_lse, return_stats=self.collect_stats, backend=self.backend,
        )
        if not (return_lse or self.collect_stats):
            return out
        out = list(out)
        if self.collect_stats:
            self.last_stats = out.pop()
        return tuple(out) if return_lse else out[0]

    @torch.no_grad()
    def acp_bound(self) -> Tensor | str | None:
        """The ACP bound ``U >= max |scale q.k|`` per query head: ``None`` when ACP is off,
        :meth:`logit_bound` where the layer has one, else ``"auto"`` (from the data)."""
        if not self.acp:
            return None
        bound = self.logit_bound()
        return "auto" if bound is None else bound
