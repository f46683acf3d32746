"""Token generation over a :mod:`lapse.kv` store.

The structure of gpt-fast's ``generate.py``: :func:`prefill` runs the prompt and fills
the store (logits of the last position only), :func:`decode_one_token` runs one new token
per sequence against it with fixed shapes, so that :func:`compiled_decode_one_token`
compiles it (``torch.compile(mode="reduce-overhead", fullgraph=True)``: one CUDA graph
per step), and :func:`sample` picks the next token without reading anything back to the
host (greedy, or temperature / top-k sampling by the exponential-race form of the
Gumbel-max trick).

Legend: B batch, T prompt length, N new tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lapse.kv import DenseStore, KVCache, PagedStore, check_lengths
from lapse.models import Decoder

from .policies import Dense, Policy


@torch.no_grad()
def prefill(
    model: Decoder, input_ids: Tensor, cache: KVCache, lengths: Tensor | Sequence[int] | None = None
) -> Tensor:
    """Runs the prompt ``[B, T]`` into ``cache``; returns the last position's logits ``[B, V]``
    (only that position is projected to the vocabulary). ``lengths`` ``[B]`` (a tensor or
    a list): prompts of different lengths, right-padded (each one's last position)."""
    hidden = model.hidden_states(input_ids, cache=cache, lengths=lengths)  # [B, T, C]
    return model.lm_head(cache.last(hidden))  # [B, V]


@torch.no_grad()
def decode_one_token(model: Decoder, token: Tensor, cache: KVCache) -> Tensor:
    """Runs one token per sequence ``[B, 1]`` against ``cache``; returns its logits ``[B, V]``.

    Fixed shapes: the store must already have room (a prefill, or ``capacity``)."""
    logits, _ = model(token, cache=cache)  # [B, 1, V]
    return logits[:, -1]


DECODE_RECOMPILE_LIMIT = 64
"""Compiled entries of the decode step a process may hold (:func:`compiled_decode_one_token`)."""


@functools.cache
def compiled_decode_one_token(
    mode: str | None = "reduce-overhead", backend: str = "inductor"
) -> Callable[[Decoder, Tensor, KVCache], Tensor]:
    """:func:`decode_one_token` compiled whole (``fullgraph=True``), made once per process
    and (mode, backend). With ``reduce-overhead`` each step replays a CUDA graph: the
    returned logits are overwritten by the next step (clone them to keep them), and the
    store's buffers must not be reallocated between steps (give the store its capacity).
    ``backend="aot_eager"`` checks the trace without code generation (tests on CPU).

    Each call runs under ``torch._dynamo.config.patch``, which keeps Python floats constant
    (``specialize_float``: models of different head dims in one process), and raises Dynamo's recompile
    limit to at least ``DECODE_RECOMPILE_LIMIT`` for the compiles of this call only: every
    model kind, batch and store shape is one more compiled entry of the same function
    (entries of every (mode, backend) count together), and with ``fullgraph=True`` the
    ninth would be an error (Dynamo's default limit is 8), not a slower step. Dynamo reads
    the limit when a call misses its cache, inside the call
    (``tests/generation/test_generate.py``: nine entries, the setting unchanged after).

    Before each step the model's fused projections are checked against its weights on the
    host (:meth:`lapse.models.Decoder.refresh_fused_projections`; the compiled step cannot
    read a weight's address without a graph break): weights changed inside
    ``fused_projections`` are copied into the snapshot again, in place where the shapes
    agree, so a captured CUDA graph reads them. No device sync; host time per step, with
    the patch's 15 us, about 90 us for 12 layers on a busy 2-core CPU, which overlaps the
    device's work on the steps before (the step reads nothing back)."""
    compiled = torch.compile(decode_one_token, mode=mode, backend=backend, fullgraph=True)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6

    def step(model: Decoder, token: Tensor, cache: KVCache) -> Tensor:
        refresh = getattr(model, "refresh_fused_projections", None)  # None: a hand-written model
        if refresh is not None:
            refresh()
        prepare = getattr(model, "prepare_rope", None)  # the RoPE tables made outside the graph
        if prepare is not None:
            prepare(cache.capacity, token.device)
        # specialize_float: Python floats of the model (a layer's scale, norm eps) stay
        # constants. Else Dynamo makes a float that changed between two compiles (models of
        # another head dim) a symbolic input, which the ops' scalar checks cannot read.
        limit = max(getattr(config, name), DECODE_RECOMPILE_LIMIT)
        cache.claim(token.shape[1])  # a store without room says so here, not in a kernel
        with config.patch({name: limit, "specialize_float": True}):
            return compiled(model, token, cache)

    return step


def supports_paged(model: Decoder) -> bool:
    """Every attention layer of ``model`` decodes over a :class:`~lapse.kv.PagedStore`."""
    return all(getattr(block.attn, "supports_paged", True) for block in model.blocks)


def records_scores(model: Decoder) -> bool:
    """Every attention layer of ``model`` records each key's attention where the store tracks
    scores (H2O, A2SF, the recall of the policy evaluations); DCP's do not."""
    return all(getattr(block.attn, "records_scores", True) for block in model.blocks)


def _check_ids(input_ids: Tensor, vocab_size: int) -> None:
    """Token ids within the vocabulary (a ragged batch's padding too: the prefill embeds it):
    one read-back before the prefill, instead of an embedding's index error (or, on a GPU, a
    device assert)."""
    lo, hi = (int(x) for x in torch.stack([input_ids.min(), input_ids.max()]).tolist())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"input_ids must be token ids in [0, {vocab_size}) (the model's vocabulary), "
                         f"got ids from {lo} to {hi}")


def check_policy_fits(model: Decoder, policy: Policy) -> None:
    """Raises a one-line ``ValueError`` when ``policy`` cannot evict from ``model``'s paged
    store: its own check (:meth:`Policy.check`), a kind that decodes over a dense store only,
    a per-head decision where the layers need every head to keep the same slots, or scores
    the layers do not record (DCP's: H2O/A2SF there would rank every token at 0)."""
    policy.check(model)
    name = model.config.name
    if not supports_paged(model):
        raise ValueError(
            f"a {name} model decodes over a DenseStore only (its per-slot state changes after "
            f"it is written): eviction policies do not apply to it yet; use the dense policy"
        )
    if policy.score_decay is not None and not records_scores(model):
        raise ValueError(
            f"{type(policy).__name__} ranks tokens by their attention scores, which a {name} model's layers "
            "do not record: use the dcp policy (or dense, window) on it"
        )
    if not policy.uniform_heads and any(getattr(b.attn, "needs_uniform_heads", False) for b in model.blocks):
        raise ValueError(
            f"a {name} model shares per-slot state across the heads of a layer, so every head "
            f"must keep the same tokens; {type(policy).__name__} decides per head (A2SF/H2O: per='layer', "
            "--per layer)"
        )


def paged_store_for(
    model: Decoder, batch: int, prompt_len: int, max_new_tokens: int, policy: Policy, page_size: int = 16,
    *, score_decay: float | None = None,
) -> PagedStore:
    """A paged store for ``policy``: room for the prompt, and a pool and table no larger
    than the policy's bound (plus the steps between evictions) once the prompt is cut.
    ``score_decay``: record attention scores with this decay although the policy ranks by
    none (a sequence that joins a shared store which records them); ``None``: the policy's."""
    check_policy_fits(model, policy)
    if score_decay is not None and policy.score_decay not in (None, score_decay):
        raise ValueError(f"a {type(policy).__name__} policy records scores with decay {policy.score_decay}, "
                         f"not {score_decay}")
    total = prompt_len + max_new_tokens
    policy.check_context(prompt_len, total)
    bound = policy.max_tokens(prompt_len)
    per_head = total if bound is None else min(total, max(prompt_len, bound + policy.every))
    heads = model.config.kv_heads
    pages = batch * heads * -(-per_head // page_size)
    return PagedStore(
        model.config.n_layers,
        max_context=total,
        max_tokens=per_head,
        pages=pages,
        page_size=page_size,
        score_decay=policy.score_decay if score_decay is None else score_decay,
    )


def logit_bounds(model: Decoder) -> list[Tensor | None]:
    """Each layer's ``U >= max |scale q.k|`` ``[K, G]`` (``None`` without QK-norm): what
    :class:`~lapse.generation.policies.ACPBoundary` reads; the weights do not change while
    generating, so compute it once."""
    bounds = [block.attn.logit_bound() for block in model.blocks]
    return [None if b is None else b.view(model.config.kv_heads, -1) for b in bounds]


@torch.no_grad()
def evict(
    model: Decoder,
    store: PagedStore,
    policy: Policy,
    bounds: list[Tensor | None] | None = None,
    compile: bool | str | None = None,
    graph: bool | None = None,
) -> None:
    """Applies ``policy`` to every layer of ``store`` (outside any compiled step);
    ``bounds``: :func:`logit_bounds` of the model, computed here when not given.
    ``compile``: run each layer's pass compiled (:meth:`PagedStore.apply_policy`); by
    default on CUDA, where the pass is bound by kernel launches. ``graph``: the compiled
    passes of all layers replayed as one CUDA graph (:meth:`PagedStore.apply_policy_all`);
    by default wherever ``compile`` is on CUDA. The host's page lists catch up once, at
    the end."""
    if policy.keeps_all:  # nothing to evict (Dense)
        return
    bounds = logit_bounds(model) if bounds is None else bounds
    cuda = store.k[0] is not None and store.k[0].is_cuda
    if compile is None:
        compile = cuda
    if graph is None:
        graph = bool(compile) and cuda
    store.apply_policy_all(policy.keep, bounds, compile=compile, whole_pages=policy.whole_pages,
                           extras=policy.snapshot_extras, graph=graph)
    store.settle()


def sample(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    top_p: float | None = None,
) -> Tensor:
    """The next token ``[B, 1]`` (int64) from logits ``[B, V]``.

    ``temperature == 0``: the argmax. Otherwise a draw from ``softmax(logits / temperature)``
    restricted to the ``top_k`` largest logits (all when ``None``) and then to the smallest
    set of most likely tokens whose probability reaches ``top_p`` (nucleus sampling; all
    when ``None``): ``argmax_v p_v / E_v`` with ``E_v ~ Exp(1)`` is distributed as ``p``
    (the Gumbel-max trick), and unlike ``torch.multinomial`` it never synchronises with the
    host.
    """
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature  # [B, V]
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_p, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)  # [B, V]
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        drop = torch.zeros_like(before, dtype=torch.bool).scatter_(-1, order, before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))  # the most likely token always stays
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    race = torch.empty_like(probs).exponential_(1, generator=generator)  # [B, V]
    return (probs / race).argmax(dim=-1, keepdim=True)


def sample_rows(
    logits: Tensor,
    temperatures: Sequence[float],
    top_ks: Sequence[int | None],
    top_ps: Sequence[float | None],
    generators: Sequence[torch.Generator | None],
) -> Tensor:
    """The next token ``[R]`` of each row of ``logits`` ``[R, V]`` under its own sampling
    parameters: row ``i`` draws what :func:`sample` draws for ``logits[i : i + 1]`` with
    ``temperatures[i]``, ``top_ks[i]``, ``top_ps[i]`` and ``generators[i]`` (the same
    arithmetic, and the same numbers from the same generator), in a few batched kernels
    instead of a handful per row; only the rows' own random draws are one kernel each
    (the rows without a generator share one draw from the default one)."""
    r, v = logits.shape
    dev = logits.device
    greedy = [t == 0 for t in temperatures]
    if all(greedy):
        return logits.argmax(dim=-1)
    temps = torch.tensor([t if t != 0 else 1.0 for t in temperatures], dtype=torch.float32, device=dev)
    x = logits.float() / temps[:, None]  # [R, V]
    ks = [min(k, v) if k is not None else None for k in top_ks]
    if any(k is not None for k in ks):
        top = torch.topk(x, max(k for k in ks if k is not None), dim=-1).values  # [R, kmax]
        at = torch.tensor([(k or 1) - 1 for k in ks], device=dev)
        kth = top.gather(-1, at[:, None])  # [R, 1]
        kth = kth.masked_fill(torch.tensor([k is None for k in ks], device=dev)[:, None], float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p is not None for p in top_ps):
        ps = torch.tensor([p if p is not None else math.inf for p in top_ps], dtype=torch.float32, device=dev)
        sorted_p, order = torch.softmax(x, dim=-1).sort(dim=-1, descending=True)  # [R, V]
        before = sorted_p.cumsum(-1) - sorted_p
        drop = torch.zeros_like(before, dtype=torch.bool).scatter_(-1, order, before >= ps[:, None])
        x = x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [R, V]
    race = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None and not greedy[i]]
    if shared:
        race[shared] = torch.empty(len(shared), v, device=dev).exponential_(1)
    for i, g in enumerate(generators):
        if g is not None and not greedy[i]:  # a greedy row draws nothing, as in sample
            race[i].exponential_(1, generator=g)
    drawn = (probs / race).argmax(dim=-1)  # [R]
    if not any(greedy):
        return drawn
    return torch.where(torch.tensor(greedy, device=dev), logits.argmax(dim=-1), drawn)


@torch.no_grad()
def generate(
    model: Decoder,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_tokens: Sequence[int] = (),
    check_every: int = 16,
    cache: KVCache | None = None,
    return_logits: bool = False,
    compile: bool = False,
    policy: Policy | None = None,
    on_token: Callable[[Tensor], None] | None = None,
    lengths: Sequence[int] | Tensor | None = None,
    pad_token_id: int | None = None,
    prefilled: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Continues every prompt by up to ``max_new_tokens`` tokens.

    Args:
        model: a :class:`lapse.models.Decoder`.
        input_ids: ``[B, T]`` the prompts; of different lengths with ``lengths``.
        max_new_tokens: how many tokens to append, at least 1.
        temperature, top_k, top_p, generator: see :func:`sample`; greedy by default.
        stop_tokens: a sequence that draws one of these ends there: its later positions
            repeat ``stop_tokens[0]``. The device is asked whether every sequence has
            ended only every ``check_every`` steps (no host sync per token), and
            generation stops early when all have.
        cache: a store to continue (its sequences go on with ``input_ids``; a
            :class:`~lapse.kv.PagedStore` takes a prompt only when empty); a fresh
            :class:`~lapse.kv.DenseStore` with room for ``T + max_new_tokens`` positions
            by default.
        return_logits: also return the logits each new token was drawn from.
        compile: decode with :func:`compiled_decode_one_token` (CUDA graphs on a GPU;
            the first call compiles, which takes a while), and run the eviction passes
            compiled (:func:`evict`).
        policy: an eviction policy (:mod:`lapse.generation.policies`): the tokens go into a
            :class:`~lapse.kv.PagedStore` (:func:`paged_store_for`, unless ``cache`` is
            one), the prompt is cut to the policy's budget after the prefill, and the
            policy runs again every ``policy.every`` steps, outside the decode step.
        on_token: called with each new token ``[B, 1]`` as it is drawn (streaming; reading
            it on the host waits for the device each step).
        lengths: ``[B]`` a ragged batch: row ``b`` of ``input_ids`` is a prompt of
            ``lengths[b]`` tokens followed by padding (any ids of the vocabulary). Each
            prompt is prefilled alone in effect (the store holds none of the padding) and
            continues from its own last token; the same as generating each prompt on its own.
        pad_token_id: what fills a ragged row after its end in the result (default
            ``stop_tokens[0]``, else 0).
        prefilled: ``[B, V]`` the logits of each prompt's last token when ``cache``
            already holds the prompts (cut to the policy's budget when there is one; e.g.
            a Hugging Face model's prefill through :class:`lapse.hf.EvictingCache`,
            :func:`lapse.hf.generate`): no prefill and no cut before the first step; the
            policy runs again every ``policy.every`` steps after it. ``input_ids`` are
            then only put in front of the new tokens in the result.

    Returns:
        ``[B, T + N]`` the prompts followed by the new tokens (``N`` below
        ``max_new_tokens`` when every sequence stopped early; with ``lengths``, row ``b``
        is its prompt, its ``N`` new tokens, then padding: ``out[b, : lengths[b] + N]``),
        and with ``return_logits`` the logits ``[B, N, V]`` (float32 or the model's
        dtype if wider).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every must be a positive integer, got {check_every!r}")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be [batch, time] with at least one token, got {got}")
    if lengths is not None:
        lengths, host_lengths = check_lengths(lengths, *input_ids.shape, input_ids.device)
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy (H2O(budget=64), SinkWindow(...), ...), got {policy!r}")
    _check_ids(input_ids, model.config.vocab_size)
    if isinstance(policy, Dense) and not supports_paged(model):
        policy = None  # keeping everything needs no paged store
    if cache is None and policy is not None:
        cache = paged_store_for(model, input_ids.shape[0], input_ids.shape[1], max_new_tokens, policy)
    elif cache is None:
        cache = DenseStore(model.config.n_layers, capacity=input_ids.shape[1] + max_new_tokens)
    elif policy is not None:
        if not isinstance(cache, PagedStore) or cache.score_decay != policy.score_decay:
            got = type(cache).__name__
            if isinstance(cache, PagedStore):
                got += f" with score_decay={cache.score_decay}"
            raise ValueError(
                f"a {type(policy).__name__} policy needs a PagedStore with score_decay={policy.score_decay} "
                f"(make it with paged_store_for), got {got}"
            )
        check_policy_fits(model, policy)
    if prefilled is not None and (cache is None or cache.length == 0 or lengths is not None):
        raise ValueError("prefilled logits continue a cache that holds the prompts (and take no lengths)")
    step = compiled_decode_one_token() if compile else decode_one_token
    if prefilled is None:  # the store takes the host list: checked once, no second read-back
        logits = prefill(model, input_ids, cache, None if lengths is None else host_lengths)  # [B, V]
    else:
        logits = prefilled
    if compile and cache.capacity < cache.length + max_new_tokens - 1:
        raise ValueError(
            f"a compiled decode step needs the room in advance: the cache has capacity {cache.capacity} "
            f"for {cache.length} + {max_new_tokens - 1} tokens"
        )
    stops = torch.tensor(list(stop_tokens), dtype=torch.long, device=input_ids.device)  # [S]
    done = torch.zeros(input_ids.shape[0], 1, dtype=torch.bool, device=input_ids.device)  # [B, 1]

    def draw(logits: Tensor) -> Tensor:
        nonlocal done
        token = sample(logits, temperature, top_k, generator, top_p)  # [B, 1]
        if len(stop_tokens):
            token = torch.where(done, stops[0], token)
            done = done | torch.isin(token, stops)
        if on_token is not None:
            on_token(token)
        return token

    if policy is None and isinstance(cache, PagedStore):
        cache.reserve(max_new_tokens - 1)  # pages for every step, before any (compiled) step
    bounds = None if policy is None else logit_bounds(model)
    first = policy.every if policy is not None and prefilled is not None else 0  # the first pass's step
    replayed = policy is not None and max_new_tokens - 1 > first + policy.every  # a second pass will come
    steps = [logits]
    tokens = [draw(logits)]  # [B, 1] each
    # a model without fused projections (a hand-written one in a test, say) decodes as is
    fused = getattr(model, "fused_projections", None)
    with contextlib.nullcontext() if fused is None else fused(keep=compile):
        for i in range(max_new_tokens - 1):
            if len(stop_tokens) and i % check_every == 0 and bool(done.all()):
                break
            if policy is not None and i % policy.every == 0:
                # the prompt's cut (done already when prefilled), then every `every`; a CUDA graph of
                # the passes only when it will be replayed (the first pass runs, then captures: a
                # graph never replayed is pure cost)
                if i > 0 or prefilled is None:
                    evict(model, cache, policy, bounds, compile=compile, graph=None if replayed else False)
                cache.reserve(min(policy.every, max_new_tokens - 1 - i))  # pages for the next steps
            logits = step(model, tokens[-1], cache)
            if compile and return_logits:
                logits = logits.clone()  # the next CUDA-graph replay overwrites it
            steps.append(logits)
            tokens.append(draw(logits))
    if isinstance(cache, PagedStore):
        cache.trim()  # the pages reserved for steps that did not run (stopped early, or the last pass's)
    new = torch.cat(tokens, dim=1)  # [B, N]
    if lengths is None:
        out = torch.cat([input_ids, new], dim=1)  # [B, T + N]
    else:  # each prompt's new tokens right after it, then padding
        pad = pad_token_id if pad_token_id is not None else (stop_tokens[0] if len(stop_tokens) else 0)
        t = input_ids.shape[1]
        out = input_ids.new_full((input_ids.shape[0], t + new.shape[1]), pad)  # [B, T + N]
        prompt = torch.arange(t, device=out.device) < lengths[:, None]  # [B, T]
        out[:, :t] = torch.where(prompt, input_ids, pad)
        out.scatter_(1, lengths[:, None] + torch.arange(new.shape[1], device=out.device), new)
    if not return_logits:
        return out
    return out, torch.stack(steps, dim=1).to(torch.promote_types(logits.dtype, torch.float32))  # [B, N, V]
