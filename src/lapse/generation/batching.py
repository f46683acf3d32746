"""Continuous batching: requests join and leave one decode batch between steps.

A :class:`RowBatcher` holds ``rows`` fixed row slots of one :class:`~lapse.kv.PagedStore`
in row-slot mode. A request is prefilled alone in a store of its own (what
:func:`~lapse.generation.generate` builds for one prompt), its first token drawn, its
prompt cut by the policy, and its kept pages copied into pages of the shared pool
(:meth:`RowBatcher.admit`); then every :meth:`RowBatcher.step` decodes one token for each
occupied row at once, and :meth:`RowBatcher.release` gives a row's pages back. A free row
costs compute in the step (the shapes never change: one compiled step, one CUDA graph) and
no memory. Each row's tokens are those ``generate`` gives its prompt alone, with the same
policy and, for a seeded request, the same draws.

The caller decides when a request ends (end of text, ``max_new_tokens``, stop strings) and
releases its row; it admits only what :meth:`RowBatcher.can_admit` accepts. Admission
checks each request's worst case in pages, layer by layer (:meth:`RowBatcher.pages_needed`:
the prompt and new tokens, or the policy's bound), and once the prompt is cut keeps reserved
only what the row can still grow to: each head's kept tokens plus the new ones (and one
reservation ahead), so a policy without a bound (ACP, DCP) that kept little of its prompt
frees the rest for other requests. A step never runs out of pages: no preemption. Not
thread-safe: one thread owns the batcher (and the model, and every torch call on them).

Legend: T prompt length, N new tokens, S page size, H kv heads, L layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from lapse.kv import PagedStore
from lapse.models import Decoder

from .generate import (
    check_policy_fits,
    compiled_decode_one_token,
    decode_one_token,
    evict,
    logit_bounds,
    paged_store_for,
    prefill,
    sample,
    sample_rows,
)
from .policies import Dense, Policy, SinkWindow


@dataclass(frozen=True)
class RowRequest:
    """One sequence to continue, as :class:`RowBatcher` takes it."""

    prompt: list[int]
    """Token ids, at least one."""
    max_new_tokens: int
    """Most tokens to draw, at least 1 (the caller releases the row by then)."""
    temperature: float = 1.0
    """0: greedy."""
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    """A seeded request draws as ``generate(..., generator=torch.Generator().manual_seed(seed))``
    draws for its prompt alone (a generator on the model's device); ``None``: torch's
    default generator."""
    budget: float | int | None = None
    """The policy's budget for this request (H2O, A2SF: ``budget``; window: ``window``,
    an int); ``None``: the policy's own."""
    policy: Policy | None = None
    """This request's own eviction policy (another kind than the batcher's, or other
    settings); ``None``: the batcher's. It must fit the model and the shared store
    (:meth:`RowBatcher.check`)."""

    def __post_init__(self) -> None:
        if not self.prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in self.prompt):
            raise ValueError("prompt must be a non-empty list of token ids")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if self.policy is not None and not isinstance(self.policy, Policy):
            raise ValueError(f"policy must be a Policy or None, got {self.policy!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")


@dataclass(eq=False)
class _Row:
    """An occupied row: its request, policy and generator, the last token drawn (the next
    step's input), the steps taken, and the pages reserved for it in each layer ``[L]``."""

    request: RowRequest
    policy: Policy
    generator: torch.Generator | None
    token: int
    steps: int
    pages: np.ndarray


class RowBatcher:
    """``rows`` row slots decoding together over one paged store (module doc).

    Args:
        model: a :class:`lapse.models.Decoder` whose layers decode over a paged store.
        policy: the eviction policy every row runs (a request may change its budget only);
            ``None``: :class:`~lapse.generation.Dense` (no eviction, still paged).
        rows: the batch of a step, the most requests decoding at once.
        pages: pages of each layer's pool (``page_size`` slots per kv head each); default
            enough for every row to hold ``max_context`` tokens.
        max_context: the longest sequence, prompt and new tokens, a request may reach.
        compile: decode with :func:`~lapse.generation.compiled_decode_one_token` and run
            the eviction passes compiled (a CUDA graph on a GPU); a string names the
            ``torch.compile`` backend instead (``"aot_eager"``: the trace without code
            generation, for tests on CPU).
        ahead: the most steps one reservation of pages covers.
        page_size: slots per page.

    Decoding is fastest inside ``model.fused_projections(keep=compile)``, which the owner
    enters once (``generate`` does; the results agree up to rounding)."""

    def __init__(
        self,
        model: Decoder,
        policy: Policy | None,
        *,
        rows: int,
        pages: int | None = None,
        max_context: int,
        compile: bool | str = False,
        ahead: int = 16,
        page_size: int = 16,
    ):
        policy = Dense() if policy is None else policy
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy or None, got {policy!r}")
        for name, value in (("rows", rows), ("max_context", max_context), ("ahead", ahead)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_policy_fits(model, policy)
        self.model, self.policy, self.rows, self.max_context = model, policy, rows, max_context
        self.compile, self.ahead, self.page_size = compile, ahead, page_size
        config = model.config
        self._heads, self._layers = config.kv_heads, config.n_layers
        if pages is None:
            pages = rows * self._heads * math.ceil(max_context / page_size)
        self.store = PagedStore(
            config.n_layers,
            max_context=max_context,
            pages=pages,
            page_size=page_size,
            score_decay=policy.score_decay,
            rows=rows,
        )
        self._pages_per_layer = pages
        self._device = next(model.parameters()).device
        self._rows: dict[int, _Row] = {}
        self._bounds: list | None = None  # logit_bounds, once (the weights do not change)
        self._passes: dict[tuple, Policy] = {}  # the policy each eviction pass runs (_pass_for)
        if isinstance(compile, str):
            self._step = compiled_decode_one_token(mode=None, backend=compile)
        else:
            self._step = compiled_decode_one_token() if compile else decode_one_token

    # -- accounting -------------------------------------------------------------------------

    def pages_needed(self, req: RowRequest) -> int:
        """The most pages the request holds, over all layers: what admission reserves.
        A head holds the prompt and new tokens without eviction; under a policy with a
        bound, at most that bound and the tokens of the steps between two passes (the
        prompt is cut in the request's own store, before it joins)."""
        policy = self._policy_for(req)
        return self._layers * self._heads * math.ceil(self._hold(req, policy) / self.page_size)

    def pages_total(self) -> int:
        """Pages of every layer's pool together."""
        return self._layers * self._pages_per_layer

    def pages_free(self) -> int:
        """Pages no occupied row has reserved, over all layers."""
        return int(self._free_per_layer().sum())

    def _free_per_layer(self) -> np.ndarray:
        """Pages of each layer's pool no occupied row has reserved ``[L]``."""
        reserved = sum((r.pages for r in self._rows.values()), np.zeros(self._layers, dtype=np.int64))
        return self._pages_per_layer - reserved

    def _worst_per_layer(self, req: RowRequest) -> np.ndarray:
        """:meth:`pages_needed` layer by layer ``[L]`` (the same in every layer)."""
        per_layer = self._heads * math.ceil(self._hold(req, self._policy_for(req)) / self.page_size)
        return np.full(self._layers, per_layer, dtype=np.int64)

    def pages_used(self) -> int:
        """Pages the rows hold now, over all layers (reads the device once after an eviction)."""
        return self.store.pages_held()

    def free_rows(self) -> int:
        return self.rows - len(self._rows)

    def active_rows(self) -> list[int]:
        return sorted(self._rows)

    def can_admit(self, req: RowRequest) -> bool:
        """A free row and, in every layer, enough unreserved pages for the request's worst
        case (:meth:`check` passed)."""
        return self.free_rows() > 0 and bool((self._worst_per_layer(req) <= self._free_per_layer()).all())

    def check(self, req: RowRequest) -> None:
        """Raises a one-line ``ValueError`` for a request this batcher can never take: too
        long for ``max_context``, more pages than the pools hold, token ids outside the
        vocabulary, a budget the policy refuses."""
        if not isinstance(req, RowRequest):
            raise TypeError(f"expected a RowRequest, got {type(req).__name__}")
        total = len(req.prompt) + req.max_new_tokens
        if total > self.max_context:
            raise ValueError(
                f"{len(req.prompt)} prompt tokens + {req.max_new_tokens} new tokens exceed the "
                f"context of {self.max_context} tokens"
            )
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in req.prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if req.policy is not None:
            self._check_kind(self._policy_for(req))
        need = self.pages_needed(req)
        if need > self.pages_total():
            raise ValueError(
                f"the request needs {need} KV pages, more than the {self.pages_total()} there are"
            )

    # -- rows -----------------------------------------------------------------------------

    @torch.no_grad()
    def admit(self, req: RowRequest) -> tuple[int, int]:
        """Prefills the request alone, draws its first token, cuts its prompt by the policy
        and copies what it keeps into the lowest free row; returns ``(row, first token id)``.
        Raises ``ValueError`` (:meth:`check`) for a request that can never fit, and
        ``RuntimeError`` when none fits now (:meth:`can_admit` is False: call it first)."""
        self.check(req)
        if not self.can_admit(req):
            raise RuntimeError(
                f"no room now: {self.free_rows()} free rows, {self.pages_free()} free pages of "
                f"{self.pages_needed(req)} needed (call can_admit first)"
            )
        policy = self._policy_for(req)
        t, n = len(req.prompt), req.max_new_tokens
        ids = torch.tensor([req.prompt], dtype=torch.long, device=self._device)  # [1, T]
        sub = paged_store_for(self.model, 1, t, n, policy, page_size=self.page_size,
                              score_decay=self.store.score_decay)  # the shared store's, to join it
        logits = prefill(self.model, ids, sub)  # [1, V]
        generator = None
        if req.seed is not None:
            generator = torch.Generator(device=self._device).manual_seed(req.seed)
        first = sample(logits, req.temperature, req.top_k, generator, req.top_p)  # [1, 1]
        if not policy.keeps_all:  # the prompt's cut, generate's pass before its first step
            evict(self.model, sub, policy, self._logit_bounds(), compile=self.compile, graph=False)
        row = min(set(range(self.rows)) - set(self._rows))
        hold = self._hold(req, policy)
        self.store.admit(row, sub, budget=_budget(policy, t), max_tokens=hold)
        # What the row can still grow to: each head's kept tokens, one a step, and at most one
        # reservation ahead (reserve grants up to held + ahead, never past hold).
        kept = torch.stack([sub.lengths[i][0] for i in range(self._layers)]).long().cpu().numpy()  # [L, H]
        grow = np.minimum(kept + n + self.ahead, hold)
        pages = ((grow + self.page_size - 1) // self.page_size).sum(axis=1)  # [L]
        token = int(first)
        pages = np.minimum(pages, self._worst_per_layer(req))
        self._rows[row] = _Row(req, policy, generator, token, 0, pages)
        return row, token

    @torch.no_grad()
    def step(self) -> dict[int, int]:
        """One decode step over the occupied rows: each row's last token in, its next one
        drawn; ``{row: token id}`` (one read of the device). Before it, the rows whose
        policy's ``every`` steps have passed are evicted (one pass over the batch), and
        pages reserved for the next steps where needed."""
        if not self._rows:
            return {}
        active = self.active_rows()
        for r in active:
            if self._rows[r].steps + 1 >= self._rows[r].request.max_new_tokens:
                raise ValueError(f"row {r} has drawn its max_new_tokens: release it before the next step")
        store = self.store
        due: dict[tuple, list[int]] = {}  # rows whose policy's every steps have passed, by pass
        for r in active:
            row = self._rows[r]
            if not row.policy.keeps_all and row.steps > 0 and row.steps % row.policy.every == 0:
                due.setdefault(self._pass_for(row.policy), []).append(r)
        for key, rows in due.items():
            mask = torch.zeros(self.rows, dtype=torch.bool)
            mask[rows] = True
            store.row_due.copy_(mask)
            evict(self.model, store, self._passes[key], self._logit_bounds(), compile=self.compile)
            store.row_due.zero_()
        if store.room < 1:
            evicting = [self._rows[r].policy.every for r in active if not self._rows[r].policy.keeps_all]
            store.reserve(min([self.ahead, *evicting]))
        tokens = [[self._rows[r].token if r in self._rows else 0] for r in range(self.rows)]
        logits = self._step(self.model, torch.tensor(tokens, device=self._device), store)  # [rows, V]
        rows = [self._rows[r] for r in active]
        reqs = [row.request for row in rows]
        picked = logits[active] if len(active) < self.rows else logits  # [active, V]
        ids = sample_rows(  # each row as generate draws for its prompt alone
            picked, [q.temperature for q in reqs], [q.top_k for q in reqs], [q.top_p for q in reqs],
            [row.generator for row in rows],
        ).tolist()
        for r, token in zip(active, ids, strict=True):
            self._rows[r].token = token
            self._rows[r].steps += 1
        return dict(zip(active, ids, strict=True))

    def release(self, row: int) -> None:
        """The row's pages back to the pool and the row free (a request finished, cancelled
        or disconnected)."""
        if row not in self._rows:
            raise ValueError(f"row {row!r} is not occupied")
        self.store.release(row)
        del self._rows[row]

    # -- internals ------------------------------------------------------------------------

    def _policy_for(self, req: RowRequest) -> Policy:
        """The request's policy (its own, or the batcher's) with the request's budget (its
        own checks raise ValueError)."""
        policy = self.policy if req.policy is None else req.policy
        if req.budget is None:
            return policy
        fields = {f.name for f in dataclasses.fields(policy)}
        if "budget" in fields:
            return dataclasses.replace(policy, budget=req.budget)
        if isinstance(policy, SinkWindow):
            if not isinstance(req.budget, int):
                raise ValueError(
                    f"a window policy's budget is its window in tokens (an int), got {req.budget!r}"
                )
            return dataclasses.replace(policy, window=req.budget)
        raise ValueError(f"the {type(policy).__name__} policy takes no budget")

    def _check_kind(self, policy: Policy) -> None:
        """Raises a one-line ``ValueError`` for a request's own policy that the model or the
        shared store cannot run: the store records attention scores (with one decay) only
        when the batcher's policy ranks by them."""
        check_policy_fits(self.model, policy)
        decay = policy.score_decay
        if decay is not None and decay != self.store.score_decay:
            held = ("records no attention scores" if self.store.score_decay is None
                    else f"records scores with decay {self.store.score_decay}")
            raise ValueError(
                f"{type(policy).__name__} ranks tokens by attention scores with decay {decay}, and the "
                f"shared KV store {held} (it serves the {type(self.policy).__name__} policy)"
            )

    def _pass_for(self, policy: Policy) -> tuple:
        """The key of the eviction pass that serves ``policy``'s rows, its policy kept in
        ``self._passes``: a pass reads each row's budget (or window) from the store, so the
        policies that differ only there share one pass (and one captured graph)."""
        key = (type(policy), *((f.name, getattr(policy, f.name)) for f in dataclasses.fields(policy)
                               if f.name not in ("budget", "window")))
        self._passes.setdefault(key, policy)
        return key

    def _hold(self, req: RowRequest, policy: Policy) -> int:
        """The most tokens a head of the request's row holds (module doc of the policies: a
        pass leaves at most the bound, and ``every`` steps add as many tokens before the next)."""
        total = len(req.prompt) + req.max_new_tokens
        bound = None if policy.keeps_all else policy.max_tokens(len(req.prompt))
        return total if bound is None else min(total, bound + policy.every)

    def _logit_bounds(self) -> list:
        if self._bounds is None:
            self._bounds = logit_bounds(self.model)
        return self._bounds


def _budget(policy: Policy, prompt_len: int) -> int:
    """The row's budget in tokens for the passes over the shared store (``LayerSnapshot.budgets``)."""
    tokens = getattr(policy, "tokens", None)  # A2SF, H2O
    if tokens is not None:
        return tokens(prompt_len)
    if isinstance(policy, SinkWindow):
        return policy.window
    return 0
