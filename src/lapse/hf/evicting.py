"""Eviction on Hugging Face models: a ``transformers`` cache backed by a lapse paged store.

``EvictingCache(policy)`` is the cache of ``model.generate`` for LLaMA-family models
(LLaMA, SmolLM2, Mistral, Qwen2/3: grouped-query attention, RoPE applied by the model
before its cache) and for lapse's own adapter (:class:`~lapse.hf.LapseForCausalLM`),
passed as ``cache=`` (transformers >= 5.24; ``past_key_values=`` before:
:data:`lapse.hf.CACHE_ARG` is the installed name).
The keys and values go into a :class:`~lapse.kv.PagedStore`, and an eviction policy of
:mod:`lapse.generation.policies` cuts it, as :func:`lapse.generation.generate` does::

    model = AutoModelForCausalLM.from_pretrained(...)
    cache = EvictingCache(H2O(budget=64, recent=16), model=model)  # installs "lapse_paged"
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=32)

How a Hugging Face attention layer reaches the store: the layer calls
``cache.update(k, v, layer_idx)`` and then the attention function of
``config._attn_implementation``. This module registers one, ``"lapse_paged"``
(:func:`register_attention`, with SDPA's mask function); ``EvictingCache(..., model=m)``
switches ``m`` to it (:func:`use_lapse_attention`; or load the model with
``attn_implementation="lapse_paged"``). ``update`` hands the layer to the attention function
through a thread-local slot and returns the new keys and values unchanged; the attention
function takes the slot and then

- on the prompt (the cache's first forward): runs Hugging Face's own SDPA over the prompt
  with its mask (exactly what ``sdpa`` computes), then cuts the layer's prompt to the
  budget and writes only the kept tokens into the store (:meth:`lapse.kv.PagedStore.plan_cut`,
  :meth:`~lapse.kv.PagedStore.write_cut`; the store holds no padding, so each row is as
  if run alone). A policy that ranks by attention decides per layer from the prompt's
  accumulated attention per key (:func:`lapse.ops.attention_key_scores`, each left-padded
  row alone); one that does not (``SinkWindow``, ``Dense``) decides once for every layer.
  So no eviction pass runs in the prefill, nothing dropped is written, the pool is sized
  for the budget, and a layer's whole prompt is held only while the layer runs (as
  kvpress's presses cut each layer; a ``DynamicCache`` holds every layer's);
- on a decode step (one token per row): appends the token and attends over the store with
  the paged decode op (:func:`lapse.ops.forgetting.forgetting_attention_paged_decode`,
  softmax, grouped heads read their kv head's pages), recording the step's attention per
  key for H2O/A2SF. The mask ``generate`` passes is not read: the store holds no padding.

With no ``EvictingCache`` in the slot (another cache, or none) ``"lapse_paged"`` is plain
SDPA, so a model switched to it behaves as before. A cache whose handoff is never taken
(the model's attention is not ``"lapse_paged"``) raises at the next layer.

Eviction passes run between forwards, never inside one. The prompt is cut inside its
forward, each layer as its attention ends (a lapse model's prompt, in the store whole, by a
pass as the forward ends), so a timed prefill includes the cut, as kvpress's presses
compress inside theirs. Then a pass runs before decode step ``i`` when
``i % policy.every == 0`` and ``i > 0``, in eager mode (Hugging Face's ``generate`` loop is
eager).

For a :class:`~lapse.hf.LapseForCausalLM`, the lapse model's own layers append to the same
store and run the same paged op (and FoX's gates, so ``ACPBoundary`` works there); the
cache only makes the store and evicts between forwards (:meth:`EvictingCache.lapse_store`,
:meth:`EvictingCache.end_forward`), the same two steps as for Hugging Face models.

Legend: B batch, T new tokens, HQ query heads, H kv heads, D head dim.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lapse.generation import DCPDrop, Policy, check_policy_fits, logit_bounds
from lapse.generation import records_scores as layers_record_scores
from lapse.kv import PagedStore
from lapse.models import Decoder
from lapse.ops import attention_key_scores
from lapse.ops.forgetting import forgetting_attention_paged_decode

from .padding import padding_runs, roll_rows

ATTENTION = "lapse_paged"
"""The name of the attention function under ``AttentionInterface`` (and its mask function)."""

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""Hugging Face ``model_type`` values whose attention is causal softmax over RoPE'd keys
that the model caches before attending (what the paged decode op computes)."""

HIDDEN = "lapse_dcp_hidden"
"""The keyword that carries an attention layer's input to the attention function, for the
DCP interaction projections (:mod:`lapse.hf.dcp` sets it from a forward pre-hook)."""

_slot = threading.local()  # .cache: the EvictingCache whose update the next attention call takes


def register_attention() -> None:
    """Registers ``"lapse_paged"`` with ``AttentionInterface`` and, as SDPA's mask function,
    with ``AttentionMaskInterface`` (idempotent; ``import lapse.hf`` calls it)."""
    AttentionInterface.register(ATTENTION, lapse_paged_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_lapse_attention(model: nn.Module) -> None:
    """Switches a Hugging Face model's attention to ``"lapse_paged"`` (SDPA unless an
    :class:`EvictingCache` is in use). A :class:`~lapse.hf.LapseForCausalLM` needs nothing."""
    if _lapse_decoder(model) is not None:
        return
    register_attention()
    if model.config._attn_implementation != ATTENTION:
        model.set_attn_implementation(ATTENTION)


def lapse_paged_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """The ``"lapse_paged"`` attention function: ``query`` ``[B, HQ, T, D]``, ``key``,
    ``value`` ``[B, H, T, D]`` (Hugging Face's layout) -> ``[B, T, HQ, D]``. Over an
    :class:`EvictingCache` see the module doc; otherwise Hugging Face's SDPA. A layer with
    DCP (``module.dcp``, :func:`lapse.hf.add_dcp`) attends under its keep mask instead."""
    hidden = kwargs.pop(HIDDEN, None)
    dcp = getattr(module, "dcp", None)
    cache = getattr(_slot, "cache", None)
    if cache is None or cache._handoff != module.layer_idx:
        if dcp is not None:
            return dcp.attend_full(query, key, value, attention_mask, scaling, hidden), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    _slot.cache, cache._handoff = None, None
    return cache._attend(module, query, key, value, attention_mask, scaling, hidden, **kwargs), None


class EvictingCache(Cache):
    """A ``transformers`` cache whose tokens live in a lapse :class:`~lapse.kv.PagedStore`,
    cut by an eviction ``policy`` between decode steps (module doc).

    Args:
        policy: a policy of :mod:`lapse.generation.policies` (``Dense``, ``SinkWindow``,
            ``H2O``, ``A2SF``; those that read the model's layers, ``ACPBoundary`` and
            ``DCPDrop``, on lapse models only).
        model: the model it will serve: checked against the policy now, and a Hugging Face
            model is switched to the ``"lapse_paged"`` attention (:func:`use_lapse_attention`).
            Without it the checks run on the first forward, and the model must already use
            ``"lapse_paged"``.
        max_context: the most positions a row reaches (prompt + new tokens; default the
            model's ``max_position_embeddings``). It sizes the store of a policy without a
            bound (``Dense``): give it to hold less memory.
        page_size: slots per page of the store.
        compile: run each eviction pass compiled (:meth:`PagedStore.apply_policy`);
            default: on CUDA.

    One cache serves one ``generate`` call (a batch of prompts, of any lengths when
    left-padded). Not supported: beam search and other batch reordering, cropping
    (assisted generation), a second prompt chunk after the first.
    """

    is_croppable = False

    def __init__(
        self,
        policy: Policy,
        *,
        model: nn.Module | None = None,
        max_context: int | None = None,
        page_size: int = 16,
        compile: bool | None = None,
    ):
        super().__init__(layers=[])
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a lapse.generation policy, got {type(policy).__name__}")
        if max_context is not None and (
            not isinstance(max_context, int) or isinstance(max_context, bool) or max_context < 2
        ):
            raise ValueError(f"max_context must be an integer >= 2 or None, got {max_context!r}")
        self.policy, self.max_context, self.page_size, self.compile = policy, max_context, page_size, compile
        self.store: PagedStore | None = None
        self._seen = 0  # positions of every row so far, padding included (what DynamicCache counts)
        self._steps = 0  # decode forwards so far
        self._handoff: int | None = None  # the layer whose update the attention function has yet to take
        self._bounds: list[Tensor | None] | None = None  # ACP's U per layer (lapse models)
        self._start: Tensor | None = None  # [B] where each row's tokens start in the prompt's forward
        self._new = 0  # tokens of the forward in progress
        self._plan: tuple[Tensor | None, Tensor] | None = None  # the prompt's cut, the same for every layer
        self._prompt_cut = False  # the prompt went into the store cut (_cut_prompt)
        self._checked = False
        if model is not None:
            self._check(model)
            use_lapse_attention(model)

    # -- what Hugging Face asks of a cache ------------------------------------------------

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Hands the layer to the ``"lapse_paged"`` attention function (which appends to the
        store) and returns the new keys and values ``[B, H, T, D]`` unchanged."""
        if self._handoff is not None:
            raise RuntimeError(
                f"layer {self._handoff}'s attention did not go through {ATTENTION!r}: an EvictingCache "
                "needs the model's attention switched to it (EvictingCache(policy, model=model), "
                "lapse.hf.use_lapse_attention(model), or from_pretrained(..., "
                f"attn_implementation={ATTENTION!r}))"
            )
        self._handoff = layer_idx
        _slot.cache = self
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions seen per row, padding included (as ``DynamicCache`` counts them)."""
        return self._seen

    def get_mask_sizes(self, query_length: int | Tensor, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask for a forward of ``query_length`` new
        positions (transformers before 5.3 passes the forward's ``cache_position``, a
        tensor of that length, instead)."""
        if isinstance(query_length, Tensor):
            query_length = query_length.shape[0]
        return self._seen + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False  # eviction runs between forwards, on the host's page lists

    @property
    def is_initialized(self) -> bool:
        return self.store is not None

    @property
    def batch_size(self) -> int:
        return -1 if self.store is None or self.store.batch_size is None else self.store.batch_size

    def reset(self) -> None:
        """Forgets everything (the next forward is a new prompt)."""
        self.store, self._seen, self._steps, self._handoff, self._start = None, 0, 0, None, None
        self._plan, self._prompt_cut = None, False

    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise NotImplementedError(
            "EvictingCache does not reorder its batch (beam search needs a DynamicCache)"
        )

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("EvictingCache cannot be cropped (evicted tokens are gone)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("EvictingCache does not repeat its batch (num_return_sequences > 1)")

    def batch_select_indices(self, indices: Tensor) -> None:
        raise NotImplementedError("EvictingCache does not select batch rows")

    def __repr__(self) -> str:
        return f"EvictingCache(policy={self.policy!r}, seen={self._seen}, store={self.store!r})"

    # -- the steps shared by Hugging Face models and the lapse adapter ---------------------

    def _check(self, model: nn.Module) -> None:
        """The policy fits the model (a clear ``ValueError`` naming the family when not)."""
        decoder = _lapse_decoder(model)
        if decoder is not None:
            check_policy_fits(decoder, self.policy)
            self._bounds = logit_bounds(decoder)
        else:
            _check_family(model.config, self.policy, _has_dcp(model))
        self._checked = True

    def _open(
        self, config, batch: int, prompt_len: int, kv_heads: int, whole_prompt: bool = True
    ) -> PagedStore:
        """The store for a prompt of ``prompt_len`` (the batch's longest): a pool no larger
        than the policy's bound plus the steps between evictions, and room for the whole
        prompt when it goes in before its cut (``whole_prompt``: a lapse model's or a DCP
        layer's; a Hugging Face layer's prompt goes in cut, :meth:`_cut_prompt`)."""
        total = self.max_context or config.max_position_embeddings
        if prompt_len + 1 > total:
            raise ValueError(
                f"the prompt ({prompt_len} tokens) leaves no room to generate in max_context = {total} "
                "(the model's max_position_embeddings unless given): shorten it"
            )
        window = _sliding_window(config)
        if window is not None and window < total:
            raise ValueError(
                f"this {config.model_type} model attends over a sliding window of {window} tokens, which the "
                f"paged decode op does not apply: give max_context <= {window} (prompt + new tokens), or "
                "use the window policy on a full-attention model"
            )
        policy = self.policy
        policy.check_context(prompt_len, total)
        bound = policy.max_tokens(prompt_len)
        held = prompt_len if whole_prompt else 0
        per_head = total if bound is None else min(total, max(held, bound + policy.every))
        self.store = PagedStore(
            config.num_hidden_layers,
            max_context=total,
            max_tokens=per_head,
            pages=batch * kv_heads * -(-per_head // self.page_size),
            page_size=self.page_size,
            score_decay=policy.score_decay,
        )
        return self.store

    def _before_step(self) -> None:
        """Before decode step ``i``: the policy's pass over every layer when ``i % every == 0``,
        outside the forward (step 0's, the prompt's cut, ran as the prompt's forward ended)."""
        if self._steps == 0 or self._steps % self.policy.every:
            return
        self._evict()

    def _evict(self) -> None:
        """The policy's pass over every layer, then the host's page lists settled (none for
        a policy that keeps every token)."""
        if self.policy.keeps_all:
            return
        store = self.store
        compile = self.compile if self.compile is not None else store.k[0].is_cuda
        bounds = self._bounds or [None] * store.n_layers
        # per-layer passes: the CUDA-graph replay that lapse's own loop uses (graph=True) has
        # not been measured or tested through Hugging Face's loop yet
        store.apply_policy_all(
            self.policy.keep, bounds, compile=compile, whole_pages=self.policy.whole_pages,
            extras=self.policy.snapshot_extras, graph=False,
        )
        store.settle()

    def end_forward(self, t: int) -> None:
        """After a forward of ``t`` positions per row (padding included); after the
        prompt's, its cut to the budget."""
        prompt = self._seen == 0
        if not prompt:
            self._steps += 1
        self._seen += t
        if prompt and not self._prompt_cut:  # a lapse adapter's prompt: in the store, whole
            self._evict()

    def lapse_store(self, model: nn.Module, batch: int, t: int) -> PagedStore:
        """For the lapse adapter (``model`` a :class:`~lapse.hf.LapseForCausalLM`): the store
        its decoder appends to in a forward of ``t`` tokens per row (made on the prompt;
        evicted before the decode steps due). Call :meth:`end_forward` after the forward."""
        if not self._checked:
            self._check(model)
        if self._seen == 0:
            config = model.config
            return self._open(config, batch, t, config.n_kv_heads or config.n_heads)
        if t != 1:
            raise ValueError(f"an EvictingCache takes a prompt, then one token per step; got {t} tokens")
        self._before_step()
        return self.store

    # -- a Hugging Face layer's attention (from lapse_paged_attention) ---------------------

    def _attend(self, module, query, key, value, attention_mask, scaling, hidden, **kwargs) -> Tensor:
        i, t = module.layer_idx, query.shape[2]
        config = module.config
        if i == 0:
            self._begin(module, query, key, attention_mask)
        if getattr(module, "dcp", None) is not None:
            out = self._attend_dcp(module.dcp, query, key, value, hidden)
        elif self._seen == 0:  # the prompt: Hugging Face's SDPA, then into the store, cut
            out, _ = sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, **kwargs
            )
            self._cut_prompt(i, query, key, value, scaling)
        else:
            out = self._decode(i, query, key, value, scaling)
        if i == config.num_hidden_layers - 1:
            self.store.advance()
            self.end_forward(t)
        return out

    def _begin(self, module, query: Tensor, key: Tensor, attention_mask: Tensor | None) -> None:
        """Layer 0 of a forward: the store made (the prompt) or evicted on schedule, then
        ``begin`` of the forward's tokens."""
        b, _, t, _ = query.shape
        if self._seen == 0:
            if not self._checked:
                _check_family(module.config, self.policy, hasattr(module, "dcp"))
                self._checked = True
            mask = None if attention_mask is None else _keys_of_last_query(attention_mask, t)
            self._start, lengths = padding_runs(mask, t, fresh=True)
            whole = getattr(module, "dcp", None) is not None  # DCP layers append the whole prompt
            self._open(module.config, b, t, key.shape[1], whole).begin(b, t, query.device, lengths)
            return
        if t != 1:
            raise ValueError(
                f"an EvictingCache takes a prompt, then one token per step; got {t} tokens after {self._seen}"
            )
        self._before_step()
        self.store.begin(b, 1, query.device)

    def _cut_prompt(
        self, i: int, query: Tensor, key: Tensor, value: Tensor, scaling: float | None
    ) -> None:
        """A layer's prompt into the store cut to the budget as its attention ends
        (:meth:`~lapse.kv.PagedStore.plan_cut`, :meth:`~lapse.kv.PagedStore.write_cut`): the
        dropped tokens never written, and the layer's whole prompt held no longer than
        Hugging Face holds it. A policy that ranks by attention decides per layer from the
        prompt's accumulated attention per key (each row's tokens first); one that does
        not decides once, for every layer."""
        store, policy = self.store, self.policy
        scores = None if store.score_decay is None else self._prompt_scores(query, key, scaling)
        plan = self._plan
        if plan is None or scores is not None:
            keep = None if policy.keeps_all else policy.keep
            b, h, t, _ = key.shape
            stacked = None if scores is None else scores[None]
            index, counts = store.plan_cut(
                keep, (b, h, t), key.device, stacked, 1, policy.max_tokens(store.prompt_len)
            )
            plan = (None if index is None else index[0]), counts[0]
            if scores is None:
                self._plan = plan
        store.write_cut(i, key, value, *plan, scores, self._start)
        self._prompt_cut = True

    def _prompt_scores(self, query: Tensor, key: Tensor, scaling: float | None) -> Tensor:
        """The prompt's accumulated attention per key ``[B, T, H]`` float32, each row's
        tokens first (:func:`lapse.ops.attention_key_scores`; a left-padded row alone)."""
        decay = self.store.score_decay
        q, k = (x.transpose(1, 2) for x in (query, key))  # [B, T, heads, D]
        if self._start is not None:
            q, k = (roll_rows(x, self._start) for x in (q, k))
        lengths = self.store.new_lengths
        if lengths is None:  # no padding: the batch in one call
            return attention_key_scores(q, k, scale=scaling, alpha=decay)
        scores = torch.zeros(*k.shape[:3], dtype=torch.float32, device=k.device)  # [B, T, H]
        for b, n in enumerate(lengths):  # each prompt alone (no padding queries; A2SF's weights)
            one = attention_key_scores(q[b : b + 1, :n], k[b : b + 1, :n], scale=scaling, alpha=decay)
            scores[b, :n] = one[0]
        return scores

    def _attend_dcp(self, dcp, query: Tensor, key: Tensor, value: Tensor, hidden: Tensor) -> Tensor:
        """A DCP layer's prompt or decode step over the store: the lapse layer's paged path
        (drop flags per slot, freed by ``DCPDrop``), each padded prompt row's tokens first
        as for every other layer, moved back after. ``[B, T, HQ, D]``."""
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, T, heads, D]
        start = self._start if self._seen == 0 else None
        if start is not None:
            q, k, v, hidden = (roll_rows(x, start) for x in (q, k, v, hidden))
        q_int, k_int = dcp.interaction(hidden)  # [B, T, r]
        out = dcp._attend_paged(q, k, v, q_int, k_int, None, self.store)  # [B, T, HQ, D]
        return out if start is None else roll_rows(out, -start)

    def _decode(self, i: int, query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
        """One token per row over the store: ``[B, 1, HQ, D]``."""
        store = self.store
        store.append(i, key.transpose(1, 2), value.transpose(1, 2))  # [B, 1, H, D]
        view = store.view(i)
        out = forgetting_attention_paged_decode(
            query[:, :, 0].contiguous(),
            view.k,
            view.v,
            view.page_table,
            view.lengths,
            scale=scaling,
            return_key_probs=view.tracks_scores,
            check_values=False,
        )
        if view.tracks_scores:
            out, probs = out
            store.record_scores(i, probs)  # [B, H, W]
        return out[:, None]  # [B, 1, HQ, D]


def _lapse_decoder(model: nn.Module) -> Decoder | None:
    """The lapse decoder of the lapse adapter (``model.model``), or ``None`` for a Hugging
    Face model."""
    decoder = getattr(model, "model", None)
    return decoder if isinstance(decoder, Decoder) else None


def records_scores(model: nn.Module) -> bool:
    """Whether every attention layer of ``model`` (a lapse adapter or a Hugging Face model)
    records the attention scores H2O, A2SF and the recall of ``lapse eval policy-loss`` read:
    DCP layers do not."""
    decoder = _lapse_decoder(model)
    return layers_record_scores(decoder) if decoder is not None else not _has_dcp(model)


def _has_dcp(model: nn.Module) -> bool:
    """Whether a layer of ``model`` has DCP (:func:`lapse.hf.add_dcp` registers ``dcp`` as
    a submodule of each ``model.model.layers[i].self_attn``): a dictionary lookup per
    attention layer (a walk over every module took ~1 ms of each prefill's host time at
    SmolLM2-135M), every module when the model is laid out otherwise."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList) and all("self_attn" in layer._modules for layer in layers):
        return any("dcp" in layer.self_attn._modules for layer in layers)
    return any("dcp" in m._modules for m in model.modules())


def _check_family(config, policy: Policy, dcp: bool) -> None:
    """Raises a ``ValueError`` naming the model family when the cache cannot serve it
    (``dcp``: the model has DCP layers, :func:`lapse.hf.add_dcp`)."""
    family = getattr(config, "model_type", type(config).__name__)
    if isinstance(policy, DCPDrop) and not dcp:
        raise ValueError(
            f"DCPDrop needs DCP parameters (W_Qint, W_Kint, beta) in every attention layer, and this "
            f"{family} model has none: add them with lapse.hf.add_dcp(model) and fine-tune"
        )
    if dcp and policy.score_decay is not None:
        raise ValueError(
            f"{type(policy).__name__} ranks tokens by attention scores, which DCP layers do not record: use "
            "DCPDrop (or Dense, SinkWindow) on a DCP model"
        )
    if type(policy).check is not Policy.check and not isinstance(policy, DCPDrop):  # a lapse model's
        raise ValueError(
            f"{type(policy).__name__} needs what lapse's layers provide (ACPBoundary: FoX forget gates; "
            f"DCPDrop: DCP's drop flags), and a {family} model has plain softmax attention: use a lapse "
            "model, or the h2o, a2sf or window policy"
        )
    if family not in FAMILIES:
        raise ValueError(
            f"EvictingCache serves LLaMA-family models ({', '.join(FAMILIES)}) and lapse models; got a "
            f"{family} model"
        )
    if getattr(config, "num_key_value_heads", None) is None:
        return
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError("query heads must be a multiple of key/value heads")


def _sliding_window(config) -> int | None:
    """The window of a model's sliding-window layers (``None``: full attention only)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return window


def _keys_of_last_query(mask: Tensor, t: int) -> Tensor:
    """The keys the prompt's last query sees, ``[B, T]`` 0/1: its tokens (SDPA's 4D mask is
    boolean, True where attended, or additive floats, 0 where attended)."""
    row = mask[:, 0, -1, -t:]  # [B, T]
    keep = row if row.dtype == torch.bool else row == 0
    return keep.long()


__all__ = ["ATTENTION", "EvictingCache", "register_attention", "use_lapse_attention"]
