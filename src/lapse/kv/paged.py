"""The paged KV store: memory that follows the kept tokens, per sequence and per kv head.

Per layer, a pool of pages of ``page_size`` slots shared by every sequence and key/value
head, and a page table per (sequence, kv head) with its length (vLLM's PagedAttention,
made per head: every head keeps a different number of tokens under eviction). The kept
tokens of a (sequence, head) fill its first ``lengths[b, h]`` logical slots: logical slot
``i`` is page ``page_table[b, h, i // page_size]`` at offset ``i % page_size``. They come in
the order they were appended until a compacting eviction fills the dropped slots with
later tokens (attention reads a head's slots in any order). Each slot carries, beside
``k`` and ``v``, the token's absolute position, the per-slot extras a method appends
(FoX's ``c`` for each query head of the group, float64), and an accumulated attention
score when a policy asks for one (H2O, A2SF).

What happens where:

- inside a (compiled) step: :meth:`PagedStore.append` writes the new tokens into slots
  that :meth:`PagedStore.reserve` gave pages to beforehand, and attention reads the pages
  through the table (``lapse.ops.forgetting.forgetting_attention_paged_decode``); tensor
  ops only, on buffers allocated once, so a step can be captured in a CUDA graph;
- outside it (every few steps): :meth:`PagedStore.reserve` takes pages from the free list
  for the next steps, :meth:`PagedStore.snapshot` shows a policy what each head holds, and
  :meth:`PagedStore.evict` keeps what the policy says, moves the kept tokens behind each
  head's new length into the dropped slots before it (the fewest moves) and returns the
  freed pages to the pool, where any sequence can reuse them.

Legend: B batch, H key/value heads, G query heads per kv head, D head dim, P pages,
S page size, W table width (slots per head), T new tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lapse.ops.paging import move_rows, slot_index
from lapse.ops.prefix import prefix_count

from .base import StoreBase
from .extras import static_clone, static_zeros


@dataclass(eq=False)
class PagedView:
    """What attention reads of one layer of a :class:`PagedStore` after its append.

    Attributes:
        k, v: ``[P, S, D]`` the pools.
        page_table: ``[B, H, W // S]`` int32 pages of each (sequence, kv head) in order.
        lengths: ``[B, H]`` int32 tokens held per head, the new ones included.
        extras: per-slot pools by name (``"c"``: ``[P, S, G]``), ``"pos"`` ``[P, S]`` int32.
        seqlens: ``[B]`` int32 tokens of each sequence so far, the new ones included.
        tracks_scores: the store accumulates attention scores (record them).
    """

    k: Tensor
    v: Tensor
    page_table: Tensor
    lengths: Tensor
    extras: dict[str, Tensor]
    seqlens: Tensor
    tracks_scores: bool

    def slots(self) -> tuple[Tensor, Tensor, Tensor]:
        """Page, offset and validity of every logical slot of the table ``[B, H, W]`` (a
        fixed width: usable inside a compiled step), to read or update a per-slot pool."""
        page_size = self.k.shape[1]
        width = self.page_table.shape[-1] * page_size
        return slot_index(self.page_table, self.lengths, self.k.shape[0], width, page_size)


@dataclass(eq=False)
class LayerSnapshot:
    """What one layer holds, per (sequence, kv head), slot by slot, for a policy.

    Attributes:
        layer_idx: the layer.
        valid: ``[B, H, W]`` bool, slots below the head's length.
        positions: ``[B, H, W]`` int64 absolute positions (-1 where not valid).
        scores: ``[B, H, W]`` float32 accumulated attention (zeros when not tracked).
        c: ``[B, H, W, G]`` float64 FoX cumulative log gates, or ``None``.
        c_now: ``[B, H, G]`` float64 the ``c`` of each sequence's last token, or ``None``.
        seqlens: ``[B]`` int64 tokens of each sequence so far.
        prompt_len: tokens of the prompt, the longest one of a ragged batch (for budgets
            given as a fraction of it).
        max_context: the largest position the store holds (ACP's ``L``).
        bound: ``[H, G]`` float32 ``U >= max |scale q.k|`` per query head, or ``None``
            (the generation loop fills it in from the layer).
        prompt_lens: ``[B]`` int64 each sequence's prompt length (they differ in a ragged
            batch); ``None``: all ``prompt_len``.
        extras: the other per-slot values a method appended, by name, ``[B, H, W, ...]``
            (e.g. DCP's ``drop`` flags).
        budgets: ``[B]`` int64 each sequence's budget in tokens, set by whoever fills the
            rows of a row-slot store (``PagedStore(rows=...)``, :meth:`PagedStore.admit`);
            ``None``: the policy's own. A policy with a budget keeps ``budgets[b]`` in row ``b``.
    """

    layer_idx: int
    valid: Tensor
    positions: Tensor
    scores: Tensor
    c: Tensor | None
    c_now: Tensor | None
    seqlens: Tensor
    prompt_len: int
    max_context: int
    bound: Tensor | None = None
    prompt_lens: Tensor | None = None
    extras: dict[str, Tensor] | None = None
    budgets: Tensor | None = None


class PagedStore(StoreBase):
    """A :class:`~lapse.kv.KVCache` whose memory follows the kept tokens (module doc).

    Args:
        n_layers: attention layers it serves.
        max_context: the largest position it will hold (RoPE tables, ACP's ``L``).
        max_tokens: most tokens one (sequence, head) holds at once (the table width);
            default ``max_context``. A policy with a budget needs only budget + the steps
            between evictions.
        pages: pages in each layer's pool; default enough for every head to hold
            ``max_tokens`` (no saving in memory: give fewer for a budget).
        page_size: slots per page.
        score_decay: track accumulated attention scores, decayed by this factor per
            query (A2SF's alpha; 1 is H2O); ``None``: no scores.
        rows: row-slot mode: a fixed batch of ``rows`` slots that sequences take and give
            back between steps (a server's continuous batching). A sequence is prefilled in
            a store of its own and copied in (:meth:`admit`), every step advances the
            occupied rows only (``step_rows``), and :meth:`release` returns its pages. A
            free row holds one token on the scratch page and owns no page, so the shapes
            of a step never change (one compiled step, one CUDA graph). Eviction passes
            evict the rows marked in ``row_due`` only, each to its ``row_budget``.
            ``None``: an ordinary store (one prefill of the whole batch).
    """

    def __init__(
        self,
        n_layers: int,
        *,
        max_context: int,
        max_tokens: int | None = None,
        pages: int | None = None,
        page_size: int = 16,
        score_decay: float | None = None,
        rows: int | None = None,
    ):
        super().__init__(n_layers)
        for name, value in (("max_context", max_context), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if page_size & (page_size - 1) or page_size < 16:
            raise ValueError(f"page_size must be a power of two >= 16, got {page_size}")
        max_tokens = max_context if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_context:
            raise ValueError(
                f"max_tokens must be an integer in [1, max_context = {max_context}], got {max_tokens!r}"
            )
        if pages is not None and (not isinstance(pages, int) or pages < 1):
            raise ValueError(f"pages must be a positive integer or None, got {pages!r}")
        if score_decay is not None and not 0 <= score_decay <= 1:
            raise ValueError(f"score_decay must be in [0, 1] or None, got {score_decay!r}")
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
            raise ValueError(f"rows must be a positive integer or None, got {rows!r}")
        self.capacity, self.page_size = max_context, page_size
        self.width = page_size * math.ceil(max_tokens / page_size)
        self.pages, self.score_decay = pages, score_decay
        self._room = 0  # tokens every head can still take in pages it owns (known on the host)
        self.prompt_len = 0
        self.prompt_lens: Tensor | None = None  # [B] int64, a ragged prefill's lengths
        self.k: list[Tensor | None] = [None] * n_layers
        self.v: list[Tensor | None] = [None] * n_layers
        self.extras: list[dict[str, Tensor]] = [{} for _ in range(n_layers)]
        self.page_table: list[Tensor | None] = [None] * n_layers  # [B, H, W/S] int32
        self.lengths: list[Tensor | None] = [None] * n_layers  # [B, H] int32
        # the host's page accounting, as arrays (a pass over every head is a few numpy ops,
        # not a Python loop over B x H): the free pages of each layer (a stack), and the
        # pages each (sequence, head) owns in order, the first count[b, h] of pages[b, h]
        self._free: list[_PageStack] = [_PageStack(0) for _ in range(n_layers)]
        self._count: list[np.ndarray | None] = [None] * n_layers  # [B, H] int64
        self._pages: list[np.ndarray | None] = [None] * n_layers  # [B, H, W/S] int64
        self._shuffled: set[int] = set()  # layers compacted at least once (see _check_order)
        self._pending: dict[int, Tensor] = {}  # layers evicted since the host's lists were settled:
        # the pages each head dropped at its front [B, H]
        self._graphs: dict[tuple, tuple] = {}  # apply_policy_all's CUDA graphs, by their arguments
        # per layer: the pages per head of a fresh grant that gave each head its pages in
        # order (the layout _append_prompt writes without indices), else 0
        self._prompt_pages: list[int] = [0] * n_layers
        # (shapes, layer) of the prompt's first layer with pages in order: what later layers
        # of the same shapes copy their table, positions and lengths from (_allocate)
        self._prompt_like: tuple | None = None
        self._plan_base: tuple | None = None  # plan_cut's snapshot of the prompt, without scores
        self._cut: _Cut | None = None  # the prompt's first write_cut: its shapes and plan (_open_cut)
        self._cut_ready: set[int] = set()  # layers _open_cut allocated that write_cut has not written
        # row-slot mode (rows): allocated at the first admit, on the device of the first sequence
        self.rows = rows
        self.row_due: Tensor | None = None  # [rows] bool: rows the next eviction pass evicts
        self.row_budget: Tensor | None = None  # [rows] int64: each row's budget in tokens
        self._active = np.zeros(rows or 0, dtype=np.bool_)  # the occupied rows, on the host
        self._row_tokens = np.zeros(rows or 0, dtype=np.int64)  # most tokens a row's head holds (reserve)

    # -- the KVCache protocol (begin, state, advance, length: StoreBase) -------------------

    def _make_room(self, t: int) -> None:
        """Checks the context, notes the prompt's length, and grants pages for ``t`` tokens."""
        if self.rows is not None and (t != 1 or self.new_lengths is not None or not self._active.any()):
            raise ValueError("a row-slot store takes its sequences through admit, then one token per "
                             "occupied row per step")
        if self.length + t > self.capacity:
            raise ValueError(f"{self.length} + {t} tokens exceed the store's max_context = {self.capacity}")
        if self.length > 0 and t > 1:
            raise ValueError(
                f"a paged store takes a prefill, then one token per step; got {t} tokens after "
                f"{self.length}: use a fresh store (or a DenseStore for chunks)"
            )
        if self.length == 0:
            self.prompt_len = t if self.new_lengths is None else max(self.new_lengths)
            self.prompt_lens = self._new
            return  # the prompt's pages come with each layer's allocation
        if self._room < t:  # else the pages are there: no read-back, so the host runs ahead of the device
            self.reserve(t)
        self._room -= t

    def append(self, layer_idx: int, k: Tensor, v: Tensor, **extras: Tensor) -> None:
        b, t, h, _ = k.shape
        if self.k[layer_idx] is None:
            cloned = self._allocate(layer_idx, k, v, extras)
            if self._prompt_pages[layer_idx]:
                self._append_prompt(layer_idx, k, v, extras, cloned)
                return
        s = self.page_size
        lengths = self.lengths[layer_idx]  # [B, H]
        slots = lengths[:, :, None].long() + torch.arange(t, device=k.device)  # [B, H, T]
        pages = self.page_table[layer_idx].long().gather(2, slots // s).flatten()  # [B * H * T]
        offsets = (slots % s).flatten()
        rows = pages * s + offsets  # each slot's row in the pools seen as [P * PS, ...]
        compiling = torch.compiler.is_compiling()

        def write(pool: Tensor, values: Tensor) -> None:  # values [B, H, T, ...]
            values = values.reshape(-1, *pool.shape[2:]).to(pool.dtype)
            if compiling:  # index_put_ on the pool itself: inductor writes the slots in place
                # (an index_copy_ through a view of the pool became a copy of the whole pool
                # and a copy back, twice per layer and step: 4x the paged step at 64 x 1920 on an H100)
                pool[pages, offsets] = values
            else:  # one index_copy_ over flat rows (index_put_ with two index tensors costs
                # several times more per call on a CPU)
                pool.view(-1, *pool.shape[2:]).index_copy_(0, rows, values)

        write(self.k[layer_idx], k.transpose(1, 2))  # [B, H, T, D]
        write(self.v[layer_idx], v.transpose(1, 2))
        pools = self.extras[layer_idx]
        for name, value in extras.items():
            write(pools[name], value.view(b, t, h, -1).transpose(1, 2))  # [B, H, T, G]: query heads by group
        write(pools["pos"], self._positions[:, None, :].expand(b, h, t))
        if "score" in pools:
            if compiling:
                pools["score"][pages, offsets] = 0.0
            else:
                pools["score"].view(-1).index_fill_(0, rows, 0.0)
        # a ragged prefill: the padding went into slots past each sequence's length (free)
        lengths.add_(t if self._new is None else self._new[:, None].int())

    def _append_prompt(
        self, layer_idx: int, k: Tensor, v: Tensor, extras: dict[str, Tensor], cloned: bool
    ) -> None:
        """:meth:`append` of a prompt into a layer just allocated whose heads own pages in
        order (:meth:`_grant_prompt`): head ``j`` of ``B x H`` holds rows
        ``j n S .. j n S + T - 1`` of the pool seen as ``[P * S, ...]``, so the prompt goes
        in with one copy per buffer and no slot indices (the host's work per layer of a
        prefill; on an H100 the paged prefill is bound by the host). ``cloned``: the positions and
        lengths came with the allocation (an earlier layer's, :meth:`_allocate`)."""
        b, t, h, _ = k.shape
        rows = self._prompt_pages[layer_idx] * self.page_size
        _write_in_order(self.k[layer_idx], k.transpose(1, 2), rows)
        _write_in_order(self.v[layer_idx], v.transpose(1, 2), rows)
        pools = self.extras[layer_idx]
        for name, value in extras.items():
            _write_in_order(pools[name], value.view(b, t, h, -1).transpose(1, 2), rows)
        # the pools are fresh zeros: the new slots' scores are 0 already
        if cloned:
            return
        _write_in_order(pools["pos"], self._positions[:, None, :].expand(b, h, t), rows)
        self.lengths[layer_idx].add_(t if self._new is None else self._new[:, None].int())

    def prefill_cut(
        self,
        layers: Sequence[int],
        keys: Sequence[Tensor],
        values: Sequence[Tensor],
        keep_fn: Callable[[LayerSnapshot], Tensor] | None,
        scores: Sequence[Tensor] | None = None,
        start: Tensor | None = None,
        max_kept: int | None = None,
    ) -> None:
        """The prompt of the forward in progress (after :meth:`begin`, before
        :meth:`advance`), cut by a policy before any of it is stored: what
        :meth:`append` of every layer's prompt, then :meth:`apply_policy` on each, leave
        (the same kept tokens with their positions and scores; the slots of a head in the
        order of their tokens, where a compaction fills holes with later ones), without
        writing what is dropped or running a pass per layer: :meth:`plan_cut` of every
        layer in one call, then :meth:`write_cut` of each.

        Args:
            layers: the layers to write (none written yet).
            keys, values: per layer ``[B, H, T, D]`` (heads first, as Hugging Face lays
                them out); row ``b``'s tokens start at ``start[b]`` (a left-padded prompt),
                else at 0.
            keep_fn, max_kept: as for :meth:`plan_cut`.
            scores: per layer ``[B, T, H]`` float32, each row's tokens first (from
                :func:`lapse.ops.attention_key_scores`), when the store tracks scores.
        """
        b, h, t, _ = keys[0].shape
        stacked = None if scores is None else torch.stack(list(scores))
        index, counts = self.plan_cut(keep_fn, (b, h, t), keys[0].device, stacked, len(layers), max_kept)
        for j, i in enumerate(layers):
            one = None if scores is None else scores[j]
            self.write_cut(i, keys[j], values[j], None if index is None else index[j], counts[j], one, start)

    def plan_cut(
        self,
        keep_fn: Callable[[LayerSnapshot], Tensor] | None,
        shape: tuple[int, int, int],
        device: torch.device,
        scores: Tensor | None = None,
        layers: int = 1,
        max_kept: int | None = None,
    ) -> tuple[Tensor | None, Tensor]:
        """Which tokens of the prompt in progress each head of ``layers`` layers keeps:
        ``index`` ``[layers, B, H, M]`` (each head's kept tokens in order, then filler;
        ``None``: every token, no policy and no padding) and ``counts`` ``[layers, B, H]``
        int32, for :meth:`write_cut`.

        One call of ``keep_fn`` sees the layers at once: a :class:`LayerSnapshot` whose
        batch is theirs one after the other (``[layers * B, H, T]``, ``layer_idx`` -1),
        positions from 0 (a prompt) and ``seqlens`` as they are once this forward is in. So a
        policy must not tell layers apart by ``layer_idx`` (those that do, ACP's, read a lapse
        model's gates: its decoder appends and evicts as usual). Without scores every layer
        sees the same snapshot, and one layer's plan serves all.

        Args:
            keep_fn: a policy's ``keep``; ``None`` keeps every token.
            shape: ``(B, H, T)`` of the prompt's keys.
            scores: ``[layers, B, T, H]`` float32, each row's tokens first; ``None``: zeros.
            max_kept: the most tokens ``keep_fn`` keeps per head (a policy's
                ``max_tokens``): the width ``M`` written; default ``T``.
        """
        b, h, t = shape
        key = (b, h, t, layers, device)
        if self._plan_base is None or self._plan_base[0] != key:  # the same for every layer's call
            columns = torch.arange(t, device=device)
            n = torch.full((b,), t, device=device) if self._new is None else self._new  # [B] tokens per row
            valid = (columns < n[:, None])[:, None, :].expand(b, h, t)  # [B, H, T]
            snap = LayerSnapshot(
                -1,
                valid.repeat(layers, 1, 1),
                torch.where(valid, columns, -1).repeat(layers, 1, 1),
                torch.zeros(layers * b, h, t, device=device),
                None,
                None,
                self._after.long().repeat(layers),
                self.prompt_len,
                self.capacity,
                prompt_lens=None if self.prompt_lens is None else self.prompt_lens.repeat(layers),
                extras={},
            )
            self._plan_base = key, columns, snap
        _, columns, snap = self._plan_base
        if keep_fn is None:
            if self._new is None:  # every token of every head, in order: no index work
                return None, torch.full((layers, b, h), t, dtype=torch.int32, device=device)
            keep, m = snap.valid.view(layers, b, h, t), t
        else:
            if scores is not None:
                ranked = scores.transpose(2, 3).reshape(layers * b, h, t).float()
                snap = dataclasses.replace(snap, scores=ranked)
            keep = (keep_fn(snap) & snap.valid).view(layers, b, h, t)
            m = t if max_kept is None else max(1, min(t, max_kept))
        rank = keep.long().cumsum(-1) - 1  # [L, B, H, T] each kept token's slot
        keep = keep & (rank < m)  # within the policy's max_tokens by contract
        index = torch.zeros(layers, b, h, m + 1, dtype=torch.long, device=device)
        index.scatter_(-1, torch.where(keep, rank, m), columns.expand(layers, b, h, t))
        return index[..., :m], keep.sum(-1).int()

    def write_cut(
        self,
        layer_idx: int,
        key: Tensor,
        value: Tensor,
        index: Tensor | None,
        counts: Tensor,
        scores: Tensor | None = None,
        start: Tensor | None = None,
    ) -> None:
        """A layer's prompt, cut by a :meth:`plan_cut` (``index`` ``[B, H, M]`` or ``None``
        for every token, ``counts`` ``[B, H]``), into the layer not yet written: its pages
        granted in order, the kept keys and values gathered straight into them (one
        operation per buffer; a whole prompt, one copy); the pages past each count go back
        at the next :meth:`settle`. ``key``, ``value``, ``scores``, ``start`` as for
        :meth:`prefill_cut`.

        The prompt's first call allocates every layer's buffers at once (:meth:`_open_cut`)
        and writes the positions and lengths of its plan into every layer; a later layer
        given the very same ``index`` and ``counts`` objects (a plan without scores, made
        once) writes only its keys and values. So a layer of a prefill costs its own
        writes and nothing else on the host, where Hugging Face's forward itself is the
        bound."""
        if self.length != 0 or (self.k[layer_idx] is not None and layer_idx not in self._cut_ready):
            raise ValueError(f"write_cut writes a prompt into a layer not yet written; layer {layer_idx} is")
        if (scores is None) != (self.score_decay is None):
            raise ValueError("scores must be given exactly when the store tracks them (score_decay)")
        whole = index is None  # every token of every head, in order
        b, h = key.shape[:2]
        m = key.shape[2] if whole else index.shape[2]
        shapes = (b, h, m, key.shape[-1], value.shape[-1], key.dtype, value.dtype, key.device)
        if self._cut is None and all(x is None for x in self.k):  # the prompt's first layer
            self._open_cut(shapes, index, counts)
        cut = self._cut
        shared = False
        if layer_idx in self._cut_ready:
            self._cut_ready.discard(layer_idx)
            shared = cut.shapes == shapes and index is cut.index and counts is cut.counts
            if cut.shapes == shapes:
                self._adopt_cut(layer_idx)
            else:  # not the first layer's shapes: buffers of its own
                self.k[layer_idx] = None
        if self.k[layer_idx] is None:
            self._allocate(layer_idx, key.transpose(1, 2), value.transpose(1, 2), {}, tokens=m)
        rows, pools = self._prompt_pages[layer_idx] * self.page_size, self.extras[layer_idx]
        if whole:
            _write_in_order(self.k[layer_idx], key, rows)
            _write_in_order(self.v[layer_idx], value, rows)
        else:
            source = (index if start is None else index + start.to(index.device)[:, None, None])[..., None]
            rows_of = source.expand(b, h, m, key.shape[-1])
            for pool, x in ((self.k[layer_idx], key), (self.v[layer_idx], value)):
                if x.shape[-1] != rows_of.shape[-1]:
                    rows_of = source.expand(b, h, m, x.shape[-1])
                torch.gather(x, 2, rows_of, out=_in_order(pool, b, h, rows)[:, :, :m])  # [B, H, M, D]
        if not shared:
            _write_in_order(pools["pos"], self._cut_positions(index, b, h, m, key.device), rows)
            self.lengths[layer_idx].copy_(counts)
        if scores is not None:
            scores = scores.transpose(1, 2).float()  # [B, H, T]
            _write_in_order(pools["score"], scores if whole else scores.gather(2, index), rows)
        if not whole:  # the pages past each count: at settle
            own = cut is None or cut.shapes != shapes
            self._add_pending(layer_idx, torch.zeros_like(counts) if own else cut.front)

    def _cut_positions(self, index: Tensor | None, b: int, h: int, m: int, device: torch.device) -> Tensor:
        """The positions a cut writes, ``[B, H, M]``: the plan's ``index`` (a prompt's
        positions start at 0), or ``0 .. M-1`` for every token (plan_cut's, made once)."""
        if index is not None:
            return index
        base = self._plan_base
        columns = base[1] if base is not None and base[1].shape[0] == m else torch.arange(m, device=device)
        return columns.expand(b, h, m)

    def _adopt_cut(self, layer_idx: int) -> None:
        """A layer that :meth:`_open_cut` allocated, as :meth:`write_cut` reaches it: its
        buffers marked static (a compiled step's CUDA graphs read them in place) and the
        host's page lists, copies of the first layer's (the same grant)."""
        free, count, pages = self._cut.host
        self._free[layer_idx], self._count[layer_idx] = free.copy(), count.copy()
        self._pages[layer_idx] = pages.copy()
        self._prompt_pages[layer_idx] = self._prompt_pages[0]
        tensors = (self.k[layer_idx], self.v[layer_idx], self.page_table[layer_idx], self.lengths[layer_idx])
        for t in (*tensors, *self.extras[layer_idx].values()):
            torch._dynamo.mark_static_address(t)

    def _open_cut(self, shapes: tuple, index: Tensor | None, counts: Tensor) -> None:
        """At a prompt's first :meth:`write_cut`: every layer's pools, table and lengths
        (each layer its own tensors, so no two inputs of a compiled step alias), zeroed and
        filled with one foreach operation per kind instead of several operations per layer;
        the pages of ``M`` tokens granted to every head in order; the positions and lengths
        of this plan in every layer. Nothing when the cut does not fit the general case's
        fast path (:meth:`_allocate` then serves each layer)."""
        b, h, m, d, dv, kd, vd, dev = shapes
        s, table = self.page_size, self.width // self.page_size
        n = self.pages if self.pages is not None else b * h * table
        need = -(-m // s)
        if not (0 < need <= table and b * h * need <= n and self._length == 0):
            return
        layers = range(self.n_layers)

        def empty(*shape, dtype) -> list[Tensor]:
            return [torch.empty(*shape, dtype=dtype, device=dev) for _ in layers]

        ks, vs = empty(n + 1, s, d, dtype=kd), empty(n + 1, s, dv, dtype=vd)
        pos, lengths = empty(n + 1, s, dtype=torch.int32), empty(b, h, dtype=torch.int32)
        scores = empty(n + 1, s, dtype=torch.float32) if self.score_decay is not None else []
        tables = empty(b, h, table, dtype=torch.int32)
        torch._foreach_zero_([*ks, *vs, *pos, *scores])
        torch._foreach_copy_(lengths, [counts] * self.n_layers)
        rows = need * s
        placed = self._cut_positions(index, b, h, m, dev).to(torch.int32)
        torch._foreach_copy_([_in_order(p, b, h, rows)[:, :, :m] for p in pos], [placed] * self.n_layers)
        for i in layers:
            self.k[i], self.v[i], self.page_table[i], self.lengths[i] = ks[i], vs[i], tables[i], lengths[i]
            self.extras[i] = {"pos": pos[i]} if not scores else {"pos": pos[i], "score": scores[i]}
        # the first layer's grant of `need` pages per head in order (its table made on the
        # device, its host lists), which every other layer copies: the tables now, the host
        # lists as write_cut reaches each layer (_adopt_cut)
        self._free[0], self._count[0] = _PageStack(n), np.zeros((b, h), dtype=np.int64)
        self._pages[0] = np.full((b, h, table), -1, dtype=np.int64)
        tables[0].fill_(-1)
        self._grant_prompt(0, need)
        if self.n_layers > 1:
            torch._foreach_copy_(tables[1:], [tables[0]] * (self.n_layers - 1))
        host = (self._free[0], self._count[0], self._pages[0])
        self._cut = _Cut(shapes, index, counts, torch.zeros_like(counts), host)
        self._cut_ready = set(layers)

    def view(self, layer_idx: int) -> PagedView:
        extras = self.extras[layer_idx]
        return PagedView(
            self.k[layer_idx],
            self.v[layer_idx],
            self.page_table[layer_idx],
            self.lengths[layer_idx],
            extras,
            self._after,
            "score" in extras,
        )

    def reorder(self, index: Tensor) -> None:
        raise NotImplementedError("PagedStore does not reorder its batch (beam search needs a DenseStore)")

    # -- row slots (rows=...): sequences join and leave a fixed batch between steps ---------

    def admit(
        self,
        row: int,
        sub: PagedStore,
        sub_row: int = 0,
        *,
        budget: int = 0,
        max_tokens: int | None = None,
    ) -> None:
        """Puts sequence ``sub_row`` of ``sub`` (a store of its own, prefilled and cut by the
        policy) into the free ``row``: pages granted from this pool for the pages it holds
        there, its kept slots copied page by page (keys, values, positions, scores, every
        per-slot pool: the same logical slots in the same order, so the next step and pass
        see what they would see in ``sub``), its lengths, ``seqlens``, prompt length and
        per-layer states. ``budget``: the row's budget in tokens (:attr:`LayerSnapshot.budgets`);
        ``max_tokens``: the most tokens a head of the row will hold (:meth:`reserve` grants
        it no more; default the table's width). Everything is written in place, so a
        compiled step and a captured eviction pass keep reading the same memory. The first
        admit allocates the pools (``pages`` + the scratch page) like ``sub``'s. Raises
        ``ValueError`` for a row that is not free or a ``sub`` of other shapes, and
        ``RuntimeError`` (nothing granted) when a pool lacks the pages."""
        if self.rows is None:
            raise ValueError("admit needs a row-slot store: PagedStore(..., rows=N)")
        if not isinstance(row, int) or not 0 <= row < self.rows or self._active[row]:
            raise ValueError(f"row must be a free row in [0, {self.rows}), got {row!r}")
        if not isinstance(sub, PagedStore) or sub.rows is not None or sub.seqlens is None or sub.k[0] is None:
            raise ValueError("admit copies a sequence from a prefilled PagedStore without rows")
        shape = (self.n_layers, self.page_size, self.score_decay)
        if (sub.n_layers, sub.page_size, sub.score_decay) != shape:
            raise ValueError(
                f"the sequence's store has (layers, page_size, score_decay) = ({sub.n_layers}, "
                f"{sub.page_size}, {sub.score_decay}), this one {shape}"
            )
        max_tokens = self.width if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= self.width:
            raise ValueError(f"max_tokens must be an integer in [1, {self.width}], got {max_tokens!r}")
        sub.settle()
        self.settle()
        if self.k[0] is None:
            self._open_rows(sub)
        tokens = int(sub.seqlens[sub_row])
        if tokens >= self.capacity:
            raise ValueError(f"a sequence of {tokens} tokens leaves no room in max_context = {self.capacity}")
        needed = []
        for i in range(self.n_layers):  # every layer checked before any is granted
            if set(sub.extras[i]) != set(self.extras[i]) or sub.k[i].shape[1:] != self.k[i].shape[1:]:
                raise ValueError(f"layer {i} of the sequence's store holds other pools than this one's")
            count = sub._count[i][sub_row]  # [H] pages each head holds
            if int(count.max()) * self.page_size > self.width:
                raise ValueError(f"the sequence holds more than this store's max_tokens = {self.width}")
            if int(count.sum()) > len(self._free[i]):
                raise RuntimeError(
                    f"the page pool of layer {i} has {len(self._free[i])} free pages, the sequence holds "
                    f"{int(count.sum())}"
                )
            rows = self._count[i].copy()
            rows[row] = count
            needed.append(rows)
        for i in range(self.n_layers):
            self._grant(i, needed[i])
            count = self._count[i][row]  # [H]
            # the pages of every head in order, head by head, here and there
            theirs = sub._pages[i][sub_row]  # [H, W'/S]
            src = theirs[np.arange(theirs.shape[-1]) < count[:, None]]
            dst = self._pages[i][row][np.arange(self._pages[i].shape[-1]) < count[:, None]]
            src = torch.from_numpy(src).to(sub.k[i].device)
            dst = torch.from_numpy(dst).to(self.k[i].device)
            pools = [(self.k[i], sub.k[i]), (self.v[i], sub.v[i])]
            pools += [(pool, sub.extras[i][name]) for name, pool in self.extras[i].items()]
            for mine, theirs in pools:  # [P, S, ...]: whole pages
                mine.index_copy_(0, dst, theirs.index_select(0, src))
            self.lengths[i][row].copy_(sub.lengths[i][sub_row])
            states = self.states[i]
            for name, given in sub.states[i].items():
                mine = states.get(name)
                missing = (  # tensors sub allocated that this store's state lacks
                    isinstance(getattr(given, f.name), Tensor)
                    and not isinstance(getattr(mine, f.name), Tensor)
                    for f in dataclasses.fields(given)
                )
                if mine is None or any(missing):
                    states[name] = type(given).alloc_rows(given, self.rows)
            for name, mine in states.items():
                mine.reset_rows([row])
                if name in sub.states[i]:
                    mine.copy_row(row, sub.states[i][name], sub_row)
        self.seqlens[row] = tokens
        prompt = sub.prompt_len if sub.prompt_lens is None else int(sub.prompt_lens[sub_row])
        self.prompt_lens[row] = prompt
        self.row_budget[row] = budget
        self.row_due[row] = False
        self.step_rows[row] = 1
        self._active[row] = True
        self._row_tokens[row] = max_tokens
        self._room, self._length = 0, None  # the new row has no spare slot known

    def release(self, row: int) -> None:
        """Frees ``row``: every page it holds back to the pool, the row back to one token on
        the scratch page, taking no step (in place). Its states stay until the next
        :meth:`admit` of the row overwrites them."""
        if self.rows is None or not isinstance(row, int) or not 0 <= row < self.rows or not self._active[row]:
            raise ValueError(f"release takes an occupied row of a row-slot store, got {row!r}")
        self.settle()  # first: a pending front of the row would free its pages twice
        for i in range(self.n_layers):
            count, pages = self._count[i], self._pages[i]
            held = np.arange(pages.shape[-1]) < count[row][:, None]  # [H, W/S]
            self._free[i].push(pages[row][held])
            count[row] = 0
            pages[row] = -1
            self._park(i, row)
        self.seqlens[row] = 0
        self.prompt_lens[row] = 0
        self.row_budget[row] = 0
        self.row_due[row] = False
        self.step_rows[row] = 0
        self._active[row] = False
        self._row_tokens[row] = 0
        self._length = None

    def active_rows(self) -> list[int]:
        """The occupied rows of a row-slot store, in order."""
        return np.flatnonzero(self._active).tolist()

    def _park(self, layer_idx: int, row) -> None:
        """A free row's table and length: one token on the scratch page (the paged op reads at
        least one slot per head, and a free row's step writes its slot 1, owned by no one)."""
        table = self.page_table[layer_idx]
        table[row] = -1
        table[row, :, 0] = self.k[layer_idx].shape[0] - 1
        self.lengths[layer_idx][row] = 1

    def _open_rows(self, sub: PagedStore) -> None:
        """At the first :meth:`admit`: every layer's pools like ``sub``'s (``pages`` pages and
        the scratch page), tables, lengths and host lists, every row free; the row tensors."""
        rows, columns = self.rows, self.width // self.page_size
        dev = sub.k[0].device
        for i in range(self.n_layers):
            h = sub.lengths[i].shape[1]
            n = self.pages if self.pages is not None else rows * h * columns
            self.k[i] = static_zeros(n + 1, *sub.k[i].shape[1:], dtype=sub.k[i].dtype, device=dev)
            self.v[i] = static_zeros(n + 1, *sub.v[i].shape[1:], dtype=sub.v[i].dtype, device=dev)
            self.extras[i] = {
                name: static_zeros(n + 1, *pool.shape[1:], dtype=pool.dtype, device=dev)
                for name, pool in sub.extras[i].items()
            }
            self.page_table[i] = static_zeros(rows, h, columns, dtype=torch.int32, device=dev)
            self.lengths[i] = static_zeros(rows, h, dtype=torch.int32, device=dev)
            self._park(i, slice(None))
            self._free[i] = _PageStack(n)
            self._count[i] = np.zeros((rows, h), dtype=np.int64)
            self._pages[i] = np.full((rows, h, columns), -1, dtype=np.int64)
        self.seqlens = static_zeros(rows, dtype=torch.int32, device=dev)
        self.prompt_lens = static_zeros(rows, dtype=torch.int64, device=dev)
        self.step_rows = static_zeros(rows, dtype=torch.int64, device=dev)
        self.row_due = static_zeros(rows, dtype=torch.bool, device=dev)
        self.row_budget = static_zeros(rows, dtype=torch.int64, device=dev)
        self._length = None

    # -- scores (H2O, A2SF) ----------------------------------------------------------------

    def record_scores(self, layer_idx: int, probs: Tensor) -> None:
        """Adds one step's attention ``[B, H, W]`` (per logical slot, summed over the group)
        to the accumulated scores, after decaying them: ``A = decay * A + a``."""
        pages, offsets, valid = _slots(self._tensors(layer_idx), self.width, self.page_size)
        score = self.extras[layer_idx]["score"]
        new = self.score_decay * score[pages, offsets] + probs[..., : self.width]  # [B, H, W]
        score[pages, offsets] = torch.where(valid, new, score[pages, offsets])

    def record_prefill_scores(self, layer_idx: int, scores: Tensor) -> None:
        """Sets the prompt's accumulated scores ``[B, T, H]`` (from
        ``lapse.ops.attention_key_scores``) of the tokens just appended, in order."""
        b, t, h = scores.shape
        s = self.page_size
        lengths = self.lengths[layer_idx]
        new = t if self._new is None else self._new[:, None, None]  # a ragged prefill's own lengths
        slots = (lengths[:, :, None].long() - new) + torch.arange(t, device=scores.device)  # [B, H, T]
        pages = self.page_table[layer_idx].long().gather(2, slots // s)
        self.extras[layer_idx]["score"][pages, slots % s] = scores.transpose(1, 2).float()

    # -- outside the step: pages and eviction ----------------------------------------------

    def reserve(self, t: int) -> None:
        """Gives every (sequence, head) of every allocated layer pages for ``t`` more tokens
        (reads the lengths back once; the steps these pages hold, at least ``t``, then run
        without a read-back, eager or compiled). Raises when the pool or the table is full."""
        self.settle()
        layers = [i for i in range(self.n_layers) if self.lengths[i] is not None]
        if not layers:
            return
        held = torch.stack([self.lengths[i] for i in layers]).long().cpu().numpy()  # [layers, B, H]
        wanted = held + t
        if self.rows is not None:  # each occupied row up to its most tokens; a free row takes no page
            wanted = np.minimum(wanted, np.where(self._active, self._row_tokens, 0)[None, :, None])
        needed = (wanted + self.page_size - 1) // self.page_size
        for i, rows in zip(layers, needed, strict=True):
            if self.rows is not None:
                rows[~self._active] = self._count[i][~self._active]
            self._grant(i, rows)
        self._set_room(layers, held)

    @property
    def room(self) -> int:
        """Tokens every head (of every occupied row, in row-slot mode) can take before the
        next :meth:`reserve`, as known on the host (0 after an eviction or an admit)."""
        return max(self._room, 0)

    def claim(self, t: int) -> None:
        """Takes room for ``t`` tokens before a compiled step, on the host: a step past the
        pages :meth:`reserve` gave would write through unowned table entries (on CUDA an
        illegal memory access, which ends the process's CUDA context), and one past
        ``max_context`` would read past the RoPE tables. An eviction gives the spare pages
        back, so reserve after it (``lapse.generation.generate`` does)."""
        if t > self._room:
            raise ValueError(
                f"the paged store has room for {self._room} more tokens per head (pages reserved, within "
                f"max_context = {self.capacity}), not {t}: call store.reserve(n) before compiled steps, "
                "and again after each eviction"
            )
        self._room -= t

    def snapshot(self, layer_idx: int) -> LayerSnapshot:
        """What the layer holds, gathered into logical order per head (for a policy)."""
        return _snapshot(self._tensors(layer_idx), *self._meta(layer_idx))

    def evict(self, layer_idx: int, keep: Tensor, whole_pages: bool = False) -> None:
        """Keeps the slots where ``keep`` ``[B, H, W]`` (shaped as :meth:`snapshot`'s) is True
        and valid, packs them into the first slots of their head (:func:`_compact`: the
        kept slots past the new length fill the dropped ones before it, so the order of a
        head's slots changes), and returns the pages no longer needed to the pool.
        ``whole_pages``: only drop each head's leading pages that keep nothing, moving no
        token (for policies whose kept slots form a suffix of a store still in the order
        its tokens came: one never compacted, else a ValueError). Device
        work only: the host's free list catches up at the next :meth:`reserve`,
        :meth:`bytes_held` or :meth:`settle` (one read-back for all the layers evicted
        meanwhile)."""
        self._check_order(layer_idx, whole_pages)
        tensors = self._tensors(layer_idx)
        evict = _drop_leading_pages if whole_pages else _compact
        front, moves = evict(tensors, _slots(tensors, *self._meta(layer_idx)[:2]), keep, self.page_size)
        self._evicted(layer_idx, tensors, front, moves)

    def apply_policy(
        self,
        layer_idx: int,
        keep_fn: Callable[[LayerSnapshot], Tensor],
        bound: Tensor | None = None,
        compile: bool | str = False,
        whole_pages: bool = False,
        extras: tuple[str, ...] | None = None,
    ) -> None:
        """:meth:`snapshot`, ``keep_fn`` (a policy's ``keep``) and :meth:`evict` as one pure
        function of the layer's tensors; with ``compile``, that function compiled by
        ``torch.compile`` (dynamic shapes: one compilation per policy, whatever the widths),
        which fuses the ~80 small kernels of a pass into a few (the pass is bound by their
        launches: 125M shapes, 4 x 32768, on an H100); a string names the ``torch.compile`` backend
        (``"aot_eager"``: the trace without code generation, for tests on CPU).
        ``whole_pages`` as in :meth:`evict`; ``extras``: the per-slot pools ``keep_fn`` reads
        from the snapshot's ``extras`` (a policy's ``snapshot_extras``; ``None``: all)."""
        self._check_order(layer_idx, whole_pages)
        fn = _compiled_pass("inductor" if compile is True else compile) if compile else _pass
        tensors = self._tensors(layer_idx)
        front, moves = fn(tensors, *self._meta(layer_idx), keep_fn, bound, whole_pages, extras)
        self._evicted(layer_idx, tensors, front, moves)

    def apply_policy_all(
        self,
        keep_fn: Callable[[LayerSnapshot], Tensor],
        bounds: Sequence[Tensor | None],
        compile: bool | str = False,
        whole_pages: bool = False,
        extras: tuple[str, ...] | None = None,
        graph: bool = False,
    ) -> None:
        """:meth:`apply_policy` on every layer (``bounds``: one per layer). ``graph`` (CUDA,
        with ``compile``): every layer's pass, moves included, captured once in a CUDA graph
        at the table's full width and replayed by later calls with the same arguments. A
        pass then costs its device work and one launch, where each layer's compiled pass
        costs ~1 ms of host time (Dynamo's guards, ~20 launches; H100, 125M x 64 x 2048:
        ~25 ms a pass for 12 layers). The graph's reads stay valid: the pools, tables,
        lengths and gate states are allocated once, and the bounds are copied into the
        graph's own tensors before each replay. The first call runs the passes as
        :meth:`apply_policy` does, then records them without running them (a policy's pass
        must not read the device from the host: the capture would fail)."""
        if not graph:
            for i in range(self.n_layers):
                self.apply_policy(i, keep_fn, bounds[i], compile, whole_pages, extras)
            return
        if not compile or self.k[0] is None or not self.k[0].is_cuda:
            raise ValueError("graph=True replays compiled passes on CUDA: pass compile and a store on a GPU")
        for i in range(self.n_layers):
            self._check_order(i, whole_pages)
        self._room = 0  # the spare pages go back
        # a policy's bound keep method compares its policy by value (frozen dataclasses), so
        # equal policies share a graph; keep_fn must be a pure function of the snapshot
        owner = getattr(keep_fn, "__self__", None)
        key = (owner, getattr(keep_fn, "__func__", keep_fn), compile, whole_pages, extras,
               tuple(b is None for b in bounds))
        fn = _compiled_pass("inductor" if compile is True else compile)

        def passes(static_bounds: Sequence[Tensor | None]) -> list[Tensor]:
            fronts = []
            for i in range(self.n_layers):
                tensors = self._tensors(i)
                meta = (self.width, self.page_size, i, self.prompt_len, self.capacity)  # the full width
                front, moves = fn(tensors, *meta, keep_fn, static_bounds[i], whole_pages, extras)
                _move_rows(tensors, moves)
                fronts.append(front)
            return fronts

        entry = self._graphs.get(key)
        with torch.cuda.device(self.k[0].device):  # the capture's stream and the launches on one device
            if entry is None:
                held = [None if b is None else b.detach().clone() for b in bounds]  # the graph's own
                fronts = passes(held)  # compiles (at this width) and evicts, with what the capture reads
                for i, front in enumerate(fronts):  # before the capture: its failure loses no dropped page
                    self._add_pending(i, front)
                torch.cuda.synchronize()
                recorded = torch.cuda.CUDAGraph()
                with torch.cuda.graph(recorded):
                    outputs = passes(held)  # recorded, not run
                self._graphs[key] = (recorded, held, outputs)
                return
            recorded, held, outputs = entry
            for mine, given in zip(held, bounds, strict=True):
                if mine is not None:
                    mine.copy_(given)
            recorded.replay()
            for i, front in enumerate(outputs):
                self._add_pending(i, front.clone())  # the next replay overwrites it

    def _add_pending(self, layer_idx: int, front: Tensor) -> None:
        """A layer's pages dropped at the front, added to those not yet settled (two
        whole-page passes without a settle between them shift the table twice)."""
        pending = self._pending.get(layer_idx)
        self._pending[layer_idx] = front if pending is None else pending + front

    def _evicted(self, layer_idx: int, tensors: _LayerTensors, front: Tensor, moves: Tensor | None) -> None:
        """After a layer's eviction: its rows moved (eagerly, the moving ones only), its front
        drops left for :meth:`settle`, and no room known (the spare pages went back)."""
        _move_rows(tensors, moves)
        self._add_pending(layer_idx, front)
        self._room = 0

    def settle(self) -> None:
        """Returns the pages the evictions since the last call freed to the host's free
        lists: one read-back of every evicted layer's lengths and dropped front pages."""
        if not self._pending:
            return
        layers = sorted(self._pending)
        fronts = torch.stack([self._pending[i] for i in layers])  # [layers, B, H]
        self._pending.clear()
        held = torch.stack([self.lengths[i].long() for i in layers])
        both = torch.stack([fronts.long(), held]).cpu().numpy()  # [2, layers, B, H]
        for i, front, held_i in zip(layers, both[0], both[1], strict=True):
            count, pages, free = self._count[i], self._pages[i], self._free[i]
            columns = np.arange(pages.shape[-1])  # [W/S]
            if front.any():  # dropped from the front: the table was shifted on the device
                free.push(pages[columns < front[..., None]])
                shift = np.minimum(columns + front[..., None], pages.shape[-1] - 1)
                pages[...] = np.take_along_axis(pages, shift, axis=-1)
                count -= front
            self._free_past_tokens(i, held_i)

    def trim(self) -> None:
        """Gives back the pages reserved past each head's tokens (:meth:`reserve`'s pages for
        steps that have not run: a generation that ended, or stopped early, holds them for
        nothing), so that :meth:`bytes_held` counts the pages that hold tokens. One read-back
        of the lengths. A later step needs :meth:`reserve` again (``generate`` calls it)."""
        self.settle()
        layers = [i for i in range(self.n_layers) if self.lengths[i] is not None]
        if not layers:
            return
        held = torch.stack([self.lengths[i] for i in layers]).long().cpu().numpy()  # [layers, B, H]
        for i, held_i in zip(layers, held, strict=True):
            self._free_past_tokens(i, held_i)
            # the device table's columns past each head's pages back to -1 (the scratch page), as
            # an eviction leaves them: a later reserve may give a freed page to another column, and
            # writes through every column (record_scores, DCP's drop) would then reach it twice
            table = self.page_table[i]
            kept = torch.as_tensor(self._count[i], device=table.device)  # [B, H]
            table.masked_fill_(torch.arange(table.shape[-1], device=table.device) >= kept[..., None], -1)
            if self.rows is not None:  # a free row's one token stays on the scratch page
                table[torch.from_numpy(~self._active).to(table.device), :, 0] = self.k[i].shape[0] - 1
        self._set_room(layers, held)

    def _set_room(self, layers: list[int], held: np.ndarray) -> None:
        """The steps that need no reserve: the free slots of the fullest head over ``layers``
        (``held`` ``[layers, B, H]`` their tokens), within ``max_context``, which bounds the
        positions too."""
        owned = np.stack([self._count[i] for i in layers]) * self.page_size
        spare = owned - held  # [layers, B, H]
        if self.rows is not None:  # the occupied rows (a free row never takes a token)
            if not self._active.any():
                self._room = 0
                return
            spare = spare[:, self._active]
        self._room = min(int(spare.min()), self.capacity - self.length)

    def _free_past_tokens(self, layer_idx: int, held: np.ndarray) -> None:
        """Frees layer ``layer_idx``'s pages past the ``held`` ``[B, H]`` tokens each head
        keeps (compact from its first page), from each head's end, last page first."""
        count, pages = self._count[layer_idx], self._pages[layer_idx]
        columns = np.arange(pages.shape[-1])  # [W/S]
        keep = -(-held // self.page_size)  # [B, H] pages the held tokens fill
        excess = (columns >= keep[..., None]) & (columns < count[..., None])
        if excess.any():
            self._free[layer_idx].push(pages[..., ::-1][excess[..., ::-1]])
            np.minimum(count, keep, out=count)

    def bytes_held(self) -> int:
        """Bytes of the pages in use (keys, values and every per-slot pool)."""
        self.settle()
        total = 0
        for i in range(self.n_layers):
            if self.k[i] is None:
                continue
            used = int(self._count[i].sum())
            per_page = sum(
                pool[0].numel() * pool.element_size()
                for pool in (self.k[i], self.v[i], *self.extras[i].values())
            )
            total += used * per_page
        return total

    def pages_held(self) -> int:
        """Pages the sequences own now, over all layers (tokens and pages reserved for the
        next steps)."""
        self.settle()
        return sum(int(c.sum()) for c in self._count if c is not None)

    def bytes_if_dense(self) -> int:
        """Bytes the same pools would hold keeping every token of every sequence (no
        eviction) in whole pages, as :meth:`bytes_held` counts them: what it is compared
        with, so that a store that evicted nothing holds 100% of it, not the rounding of its
        last, partly filled pages."""
        pages = -(-self.seqlens.long().cpu() // self.page_size)  # [B] pages a sequence fills
        slots = int(pages.sum()) * self.page_size
        total = 0
        for i in range(self.n_layers):
            if self.k[i] is None:
                continue
            b, h = self.lengths[i].shape
            per_slot = sum(
                pool[0, 0].numel() * pool.element_size()
                for pool in (self.k[i], self.v[i], *self.extras[i].values())
            )
            total += per_slot * h * slots
        return total

    # -- internals -----------------------------------------------------------------------

    def _check_order(self, layer_idx: int, whole_pages: bool) -> None:
        """Notes a compacting eviction (the layer's slots leave the order their tokens came
        in); refuses a whole-page one after it (it needs that order)."""
        if not whole_pages:
            self._shuffled.add(layer_idx)
        elif layer_idx in self._shuffled:
            raise ValueError(
                f"layer {layer_idx} was compacted (its slots are out of order): whole-page eviction "
                "needs a store evicted only by whole pages (one policy per store)"
            )

    def _tensors(self, layer_idx: int) -> _LayerTensors:
        gate = self.states[layer_idx].get("GateState")
        c_now = None if gate is None or gate.c_last is None else gate.c_last
        return _LayerTensors(
            self.k[layer_idx],
            self.v[layer_idx],
            self.extras[layer_idx],
            self.page_table[layer_idx],
            self.lengths[layer_idx],
            self.seqlens,
            c_now,
            self.prompt_lens,
            self.row_due,
            self.row_budget,
        )

    def _meta(self, layer_idx: int) -> tuple[int, int, int, int, int]:
        """``(width, page_size, layer_idx, prompt_len, max_context)`` of a pass over the layer:
        as many slots as the fullest head has pages for (known on the host, so a pass costs
        what is held, not what the table could hold)."""
        pages = max(1, int(self._count[layer_idx].max()))
        return pages * self.page_size, self.page_size, layer_idx, self.prompt_len, self.capacity

    def _allocate(
        self, layer_idx: int, k: Tensor, v: Tensor, extras: dict[str, Tensor], tokens: int | None = None
    ) -> bool:
        """A layer's pools, table and lengths, and its pages for the forward's ``T``
        tokens (``tokens``: that many instead, a prompt cut by :meth:`write_cut`). In a
        prompt's forward, a layer whose shapes match an earlier one's takes copies of that
        layer's table, positions and lengths (one operation each, not the four of a table
        made anew; returns True): they are equal, nothing is evicted inside a forward, and
        that layer has been written by then (layers append in order). :meth:`write_cut`
        then writes its own positions and lengths over the copies (a cut keeps other
        tokens in each layer); the table, pages granted in order, is the same."""
        b, _, h, d = k.shape
        s, table = self.page_size, self.width // self.page_size
        n = self.pages if self.pages is not None else b * h * table
        dev = k.device
        need = -(-(self._t if tokens is None else tokens) // s)
        fresh = 0 < need <= table and b * h * need <= n
        shapes = (b, h, dev, need, n)
        prompt = fresh and self._length == 0  # a prompt whose pages go in order
        like = None
        if prompt and self._prompt_like is not None and self._prompt_like[0] == shapes:
            like = self._prompt_like[1]
        # one page more than handed out: the scratch page that unowned table entries point to
        self.k[layer_idx] = static_zeros(n + 1, s, d, dtype=k.dtype, device=dev)
        self.v[layer_idx] = static_zeros(n + 1, s, v.shape[-1], dtype=v.dtype, device=dev)
        pools = {
            name: static_zeros(n + 1, s, x.shape[-1] // h, dtype=x.dtype, device=dev)
            for name, x in extras.items()
        }
        if like is None:
            pools["pos"] = static_zeros(n + 1, s, dtype=torch.int32, device=dev)
            self.page_table[layer_idx] = static_zeros(b, h, table, dtype=torch.int32, device=dev).fill_(-1)
            self.lengths[layer_idx] = static_zeros(b, h, dtype=torch.int32, device=dev)
        else:
            pools["pos"] = static_clone(self.extras[like]["pos"])
            self.page_table[layer_idx] = static_clone(self.page_table[like])
            self.lengths[layer_idx] = static_clone(self.lengths[like])
        if self.score_decay is not None:
            pools["score"] = static_zeros(n + 1, s, dtype=torch.float32, device=dev)
        self.extras[layer_idx] = pools
        self._free[layer_idx] = _PageStack(n)
        self._count[layer_idx] = np.zeros((b, h), dtype=np.int64)
        self._pages[layer_idx] = np.full((b, h, table), -1, dtype=np.int64)
        if fresh:
            self._grant_prompt(layer_idx, need, table_made=like is not None)
        else:  # none, or more than the table or the pool holds: the general case (its errors)
            self._grant(layer_idx, np.full((b, h), need, dtype=np.int64))
        if prompt and like is None and self._prompt_pages[layer_idx]:  # written in order next
            self._prompt_like = (shapes, layer_idx)
        return like is not None

    def _grant_prompt(self, layer_idx: int, n: int, table_made: bool = False) -> None:
        """:meth:`_grant` of ``n`` pages to every head of a layer just allocated (its stack
        new: popping gives pages ``0, 1, ...``): head ``j`` of ``B x H`` takes pages
        ``j n .. j n + n - 1``, the table made on the device (a copy from the host's
        pageable memory would wait for the device, once per layer of every prefill), and
        the prompt written without indices (:meth:`_append_prompt`). ``table_made``: the
        device's table is an earlier layer's copy already."""
        count = self._count[layer_idx]
        total = count.size * n
        self._pages[layer_idx][:, :, :n] = self._free[layer_idx].pop(total).reshape(*count.shape, n)
        count += n
        if not table_made:
            table = self.page_table[layer_idx]
            fresh = torch.arange(total, dtype=torch.int32, device=table.device)
            table[:, :, :n] = fresh.view(*count.shape, n)
        self._prompt_pages[layer_idx] = n

    def _grant(self, layer_idx: int, needed: np.ndarray) -> None:
        """Pages from the free list until (b, h) owns ``needed[b, h]`` pages (``[B, H]``):
        heads in order, each head's new pages in order, popped from the top of the stack."""
        table_width = self.width // self.page_size
        free, count, pages = self._free[layer_idx], self._count[layer_idx], self._pages[layer_idx]
        # check everything first: a failed grant leaves the table and the lists as they were
        over = np.argwhere(needed > table_width)
        if len(over):
            b, h = over[0]
            raise ValueError(
                f"layer {layer_idx}, sequence {b}, head {h} would hold more than "
                f"max_tokens = {self.width} "
                "tokens: evict more often or build the store with a larger max_tokens"
            )
        want = np.clip(needed - count, 0, None).ravel()  # [B * H] new pages per head
        total = int(want.sum())
        if total > len(free):
            raise RuntimeError(
                f"the page pool of layer {layer_idx} is full ({self.k[layer_idx].shape[0] - 1} pages of "
                f"{self.page_size}): give the store more pages or the policy a smaller budget"
            )
        self._prompt_pages[layer_idx] = 0
        if not total:
            return
        taken = free.pop(total)  # what popping one page at a time would give, in order
        head = np.repeat(np.arange(want.size), want)  # [total] the head each new page goes to
        first = np.repeat(np.cumsum(want) - want, want)  # where that head's new pages start in `taken`
        column = np.repeat(count.ravel(), want) + np.arange(total) - first
        b, h = np.divmod(head, count.shape[1])
        pages[b, h, column] = taken
        count += want.reshape(count.shape)
        table = self.page_table[layer_idx]
        update = torch.from_numpy(np.stack([b, h, column, taken])).to(table.device)  # [4, total]
        table[update[0], update[1], update[2]] = update[3].to(torch.int32)

    def __repr__(self) -> str:
        return (
            f"PagedStore(layers={self.n_layers}, length={self.length}, page_size={self.page_size}, "
            f"width={self.width}, bytes_held={self.bytes_held()})"
        )


class _PageStack:
    """A layer's free pages, a stack held in one numpy array (pages freed and taken in
    bulk: a pass frees tens of thousands at 125M x 64 x 2048, where a Python list's
    ``tolist``/``extend`` cost ~1 ms per layer). Starts full, ``n - 1`` at the bottom and
    page 0 on top."""

    def __init__(self, n: int):
        self._pages = np.arange(n - 1, -1, -1, dtype=np.int64)
        self._top = n

    def __len__(self) -> int:
        return self._top

    def push(self, pages: np.ndarray) -> None:
        """Puts ``pages`` on the stack, the last one on top."""
        if self._top + len(pages) > len(self._pages):
            raise RuntimeError(
                f"{len(pages)} pages freed onto {self._top} free of {len(self._pages)}: a page freed twice"
            )
        self._pages[self._top : self._top + len(pages)] = pages
        self._top += len(pages)

    def pop(self, n: int) -> np.ndarray:
        """Takes ``n`` pages off the top, the top one first."""
        if not 0 <= n <= self._top:
            raise RuntimeError(f"{n} pages asked of {self._top} free")
        self._top -= n
        return self._pages[self._top : self._top + n][::-1].copy()

    def copy(self) -> _PageStack:
        other = _PageStack.__new__(_PageStack)
        other._pages, other._top = self._pages.copy(), self._top
        return other

    def tolist(self) -> list[int]:
        """The free pages, bottom first."""
        return self._pages[: self._top].tolist()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _PageStack):
            return NotImplemented
        return self.tolist() == other.tolist()


# -- a pass over one layer, as pure functions of its tensors (compilable) ---------------------


@dataclass(eq=False)
class _LayerTensors:
    """One layer's buffers as a pass sees them (see :class:`PagedStore`)."""

    k: Tensor
    v: Tensor
    extras: dict[str, Tensor]
    table: Tensor
    lengths: Tensor
    seqlens: Tensor
    c_now: Tensor | None
    prompt_lens: Tensor | None
    due: Tensor | None = None  # [B] bool, row-slot mode: the rows a pass evicts (the others keep all)
    budgets: Tensor | None = None  # [B] int64, row-slot mode: each row's budget in tokens


@dataclass(eq=False)
class _Cut:
    """A prompt's first :meth:`PagedStore.write_cut`: ``(B, H, M, D, Dv, dtypes, device)``,
    the plan written into every layer (``index``, ``counts``), a ``[B, H]`` zero (no page
    dropped at the front) every layer's pending drops share, and the host's page lists of a
    layer so granted (free stack, counts, pages), which each layer copies."""

    shapes: tuple
    index: Tensor | None
    counts: Tensor
    front: Tensor
    host: tuple


def _in_order(pool: Tensor, b: int, h: int, rows: int) -> Tensor:
    """The pool of a layer whose head ``j`` of ``B x H`` owns rows ``j rows .. (j + 1) rows
    - 1`` of the pool seen as ``[P * S, ...]`` (pages granted in order,
    :meth:`PagedStore._grant_prompt`), as ``[B, H, rows, ...]`` (a view)."""
    flat = pool.view(-1, *pool.shape[2:])[: b * h * rows]
    return flat.view(b, h, rows, *pool.shape[2:])


def _write_in_order(pool: Tensor, values: Tensor, rows: int) -> None:
    """``values`` ``[B, H, T, ...]`` into the first ``T`` slots of each head of such a
    layer (:func:`_in_order`): one copy."""
    b, h, t = values.shape[:3]
    _in_order(pool, b, h, rows)[:, :, :t].copy_(values)


def _slots(t: _LayerTensors, width: int, page_size: int) -> tuple[Tensor, Tensor, Tensor]:
    return slot_index(t.table, t.lengths, t.k.shape[0], width, page_size)


def _snapshot(
    t: _LayerTensors,
    width: int,
    page_size: int,
    layer_idx: int,
    prompt_len: int,
    max_context: int,
    slots: tuple[Tensor, Tensor, Tensor] | None = None,
    extras: tuple[str, ...] | None = None,
) -> LayerSnapshot:
    pages, offsets, valid = _slots(t, width, page_size) if slots is None else slots
    pools = t.extras
    positions = torch.where(valid, pools["pos"][pages, offsets].long(), -1)
    scores = (
        pools["score"][pages, offsets] if "score" in pools else torch.zeros(valid.shape, device=valid.device)
    )
    c = pools["c"][pages, offsets] if "c" in pools else None  # [B, H, W, G]
    c_now = None if t.c_now is None else t.c_now.view(*valid.shape[:2], -1)  # [B, H, G]
    others = {
        name: pool[pages, offsets]
        for name, pool in pools.items()
        if name not in _SNAPSHOT_POOLS and (extras is None or name in extras)
    }
    return LayerSnapshot(
        layer_idx,
        valid,
        positions,
        scores,
        c,
        c_now,
        t.seqlens.long(),
        prompt_len,
        max_context,
        prompt_lens=t.prompt_lens,
        extras=others,
        budgets=t.budgets,
    )


_SNAPSHOT_POOLS = ("pos", "score", "c")  # gathered into their own snapshot fields


def _compact(
    t: _LayerTensors, slots: tuple[Tensor, Tensor, Tensor], keep: Tensor, page_size: int
) -> tuple[Tensor, Tensor]:
    """Packs the kept valid slots of every head into its first ``new_len`` slots with the
    fewest moves: each kept slot at or past ``new_len`` fills a dropped slot below it (the
    k-th such slot the k-th such hole); a kept slot below ``new_len`` stays where it is.
    Attention reads a head's slots in any order (each carries its position and extras),
    so only the holes cost: a pass that drops ``n`` tokens moves at most ``n`` rows per
    head, where packing in order moved every row behind the first hole (the whole head).

    Sets the lengths and clears the table entries past the kept pages (in place; no host
    sync), and returns the pages each head gave up at its front ``[B, H]`` (none) and the
    moves ``[3, B * H * W]``: source and destination rows of the pools seen as
    ``[P * PS, ...]`` and whether the slot moves (:func:`_move_rows` applies them eagerly,
    the moving rows only). Every head with the same ``keep`` row gets the same moves (the
    heads of a DCP layer stay aligned slot by slot)."""
    pages, offsets, valid = slots
    keep = keep & valid
    b, h, w = keep.shape
    new_len = keep.sum(-1, keepdim=True)  # [B, H, 1]
    index = torch.arange(w, device=keep.device)  # [W]
    below = index < new_len  # [B, H, W]
    hole = below & ~keep  # dropped slots that kept ones fill
    moving = keep & ~below  # kept slots past the new length, as many as the holes
    # the slot of the k-th hole at column k (the other slots write the spare column w)
    rank = torch.where(hole, prefix_count(hole) - 1, w)
    hole_at = torch.zeros(b, h, w + 1, dtype=torch.long, device=keep.device)
    hole_at.scatter_(-1, rank, index.expand(b, h, w))
    target = hole_at.gather(-1, (prefix_count(moving) - 1).clamp_min(0))  # [B, H, W]
    src = pages * page_size + offsets
    dst = pages.gather(-1, target) * page_size + offsets.gather(-1, target)
    new_len = new_len[..., 0]
    t.lengths.copy_(new_len)
    kept_pages = (new_len + page_size - 1) // page_size  # [B, H]
    columns = torch.arange(t.table.shape[-1], device=t.table.device)
    t.table.masked_fill_(columns >= kept_pages[..., None], -1)
    return torch.zeros_like(new_len), torch.stack([src.flatten(), dst.flatten(), moving.flatten().long()])


def _move_rows(t: _LayerTensors, moves: Tensor | None) -> None:
    """Applies :func:`_compact`'s moves to every pool (keys, values, each per-slot pool),
    the moving rows only (:func:`lapse.ops.paging.move_rows`: on CUDA one kernel per pool that
    reads the flags itself, so the host does not wait for the device; sources and
    destinations are disjoint, past and below the new lengths)."""
    if moves is None:
        return
    move_rows((t.k, t.v, *t.extras.values()), moves)


def _drop_leading_pages(
    t: _LayerTensors, slots: tuple[Tensor, Tensor, Tensor], keep: Tensor, page_size: int
) -> tuple[Tensor, None]:
    """Drops, per head, the leading pages holding no kept slot, by shifting the table: no
    token moves. The slots of a page that keeps any slot all stay (a policy whose kept
    slots form a suffix, such as ACP's, only keeps up to ``page_size - 1`` tokens more
    than it asked for). Returns the pages dropped at each head's front ``[B, H]``; clears
    the table entries past the held pages (in place; no host sync)."""
    _, _, valid = slots
    b, h, w = keep.shape
    wanted = (keep & valid).view(b, h, w // page_size, page_size).any(-1)  # [B, H, W/S]
    front = (prefix_count(wanted) == 0).sum(-1)  # [B, H] leading pages with nothing kept
    held = t.lengths.long()
    new_len = (held - front * page_size).clamp_min(0)  # the dropped pages were full (not the last)
    front = torch.where(new_len > 0, front, (held + page_size - 1) // page_size)
    columns = torch.arange(t.table.shape[-1], device=t.table.device)  # [W/S]
    source = columns + front[..., None]  # [B, H, W/S]
    kept_pages = (new_len + page_size - 1) // page_size
    shifted = t.table.gather(-1, source.clamp_max(t.table.shape[-1] - 1))
    t.table.copy_(torch.where(columns < kept_pages[..., None], shifted, -1))
    t.lengths.copy_(new_len)
    return front, None


def _pass(
    t: _LayerTensors,
    width: int,
    page_size: int,
    layer_idx: int,
    prompt_len: int,
    max_context: int,
    keep_fn: Callable[[LayerSnapshot], Tensor],
    bound: Tensor | None,
    whole_pages: bool = False,
    extras: tuple[str, ...] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """A policy's pass over one layer: its front drops and moves (:func:`_compact`)."""
    slots = _slots(t, width, page_size)
    snap = _snapshot(t, width, page_size, layer_idx, prompt_len, max_context, slots, extras)
    snap.bound = bound
    keep = keep_fn(snap)
    if t.due is not None:  # rows not due (and free ones) keep what they hold
        keep = torch.where(t.due[:, None, None], keep, snap.valid)
    evict = _drop_leading_pages if whole_pages else _compact
    return evict(t, slots, keep, page_size)


@functools.cache
def _compiled_pass(backend: str = "inductor"):
    return torch.compile(_pass, dynamic=True, backend=backend)
