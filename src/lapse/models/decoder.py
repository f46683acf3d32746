"""Decoder-only language models: an attention kind in a LLaMA or Pro block (SPEC section 2).

One file, read top-down: the block, the model, then small named functions for init,
parameter count, optimizer groups and FLOPs. The layers are in :mod:`lapse.layers`; the
registry (:mod:`.registry`) builds each block's attention layer from the config.

Shapes: a trailing comment on each line that makes a new shape. Legend: B batch, T time,
C d_model, H query heads, V vocab.

Incremental decoding: ``Decoder.forward(..., cache=store)`` takes any
:class:`lapse.kv.KVCache` (e.g. :class:`lapse.kv.DenseStore`). The model asks the store
for the new tokens' positions (``begin``), each attention layer appends its keys and
values (and what its kind needs) and attends to everything held, and the model ends the
forward with ``advance``. A first call is the prefill; one token per sequence is a decode
step with fixed shapes (compilable, :mod:`lapse.generation`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lapse.kv import KVCache
from lapse.layers import ContextParallel, RMSNorm, RotaryEmbedding, SoftmaxAttention, SwiGLU
from lapse.ops.forgetting import ACP_BLOCK

from .config import ModelConfig
from .loss import chunk_rows, chunked_lm_loss
from .registry import build_attention


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = build_attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.mlp_hidden)

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), positions, cache)
        return x + self.mlp(self.mlp_norm(x))


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of ``[B, T, V]`` logits against ``[B, T]`` labels (``-100``
    left out), computed in float32. Compiled (:func:`prepare_blocks`), the float32 copy of
    the logits and its log-softmax are never written out: the reductions read the logits in
    their own dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


class Decoder(nn.Module):
    """The language model: embedding, ``n_layers`` blocks, final RMSNorm, untied head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self, config.init_std)
        # Set by prepare_blocks when the blocks replay CUDA graphs: each forward then begins
        # a CUDA-graph step (one block's outputs are the next one's inputs, so one step
        # must span the whole forward and its backward) and makes its RoPE tables first.
        self.cuda_graphs = False
        self.context = None  # ContextParallel: set_context
        self.loss_fn = lm_loss  # prepare_blocks compiles it with the blocks
        # Rows of [B * T] per chunk of the loss without logits (forward(return_logits=False)):
        # a chunk's float32 logits take at most 256 MiB.
        self.loss_chunk = chunk_rows(config.vocab_size)

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        lengths: Tensor | None = None,
        return_logits: bool = True,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Logits and, with ``labels``, the mean cross-entropy.

        Args:
            input_ids: ``[B, T]`` integer token ids.
            labels: ``[B, T]`` the target of every position, already shifted (the token
                that follows ``input_ids[:, t]``); ``-100`` marks positions left out of
                the loss.
            cache: a :class:`lapse.kv.KVCache` (e.g. ``lapse.kv.DenseStore(n_layers)``).
                ``input_ids`` continue the sequences it holds: their keys and values are
                appended to it and they attend to everything held (for RoPE, their
                positions continue the held ones). Empty at first: the first call is
                the prefill.
            lengths: ``[B]`` tokens of each row in a right-padded batch of prompts of
                different lengths (a ragged prefill: the cache holds each prompt, not its
                padding; ``cache.last`` picks each one's last position). Without a cache
                nothing needs it (attention is causal: the padding after a prompt does
                not change its logits).
            return_logits: ``False`` (with ``labels``; training and validation): no logits
                are returned or ever made whole; the loss is computed with the output
                projection, ``loss_chunk`` rows of ``[B * T]`` at a time
                (:func:`lapse.models.loss.chunked_lm_loss`), so its memory grows with
                ``T x C``, not ``T x V``. The same loss and gradients up to the order of
                float32 sums.

        Returns:
            ``(logits, loss)``: logits ``[B, T, V]`` in the model's dtype (``None`` with
            ``return_logits=False``), loss a float32 scalar (``None`` without labels).
        """
        shape = tuple(getattr(input_ids, "shape", ()))
        if labels is not None and (not isinstance(labels, Tensor) or tuple(labels.shape) != shape):
            raise ValueError(
                f"labels must have the shape of input_ids {shape}, got {tuple(getattr(labels, 'shape', ()))}"
            )
        if not return_logits and labels is None:
            raise ValueError("return_logits=False needs labels: the loss is all it returns")
        hidden = self.hidden_states(input_ids, cache=cache, lengths=lengths)  # [B, T, C]
        if not return_logits:
            # The weight itself, not a call of lm_head per chunk: under FSDP2 the root's
            # pre-forward hook has already put the gathered, plain weight in place (the
            # sharded DTensor is back only after the forward), and the gradient returned for
            # it accumulates where FSDP2 reduce-scatters it from.
            loss = chunked_lm_loss(hidden, self.lm_head.weight, labels, self.loss_chunk)
            return None, self._context_share(loss, labels)
        logits = self.lm_head(hidden)  # [B, T, V]
        if labels is None:
            return logits, None
        return logits, self._context_share(self.loss_fn(logits, labels), labels)

    def _context_share(self, loss: Tensor, labels: Tensor) -> Tensor:
        """Under context parallelism, this rank's share of its rows' mean loss times the
        ranks per row: ``cp * (sum over its labels) / (labels over the whole rows)``. Their
        mean over the row's ranks is the rows' mean, and gradients averaged over every
        rank (FSDP2, DDP) are those of the global batch's mean. ``loss``: the mean over
        this rank's labels (0 where it holds none)."""
        if self.context is None:
            return loss
        count = (labels != -100).sum()
        share = count * self.context.size / self.context.total(count).clamp_min(1)
        return torch.where(count > 0, loss, 0.0) * share

    def hidden_states(
        self, input_ids: Tensor, *, cache: KVCache | None = None, lengths: Tensor | None = None
    ) -> Tensor:
        """The final-norm output ``[B, T, C]``, the input of ``lm_head`` (what
        :meth:`forward` turns into logits; evaluations that must not hold ``[B, T, V]``
        logits project it a chunk of positions at a time, and the prefill projects only
        the last position). ``cache`` and ``lengths`` as in :meth:`forward`."""
        if not torch.compiler.is_compiling():
            self._check_inputs(input_ids, cache)
        b, t = input_ids.shape
        if cache is None and self.context is not None:  # this rank's tokens of each row
            positions = self.context.positions(t, input_ids.device)  # [1, T]
            t = self.context.global_length(t)  # the RoPE tables cover the whole rows
        elif cache is None:
            positions = torch.arange(t, device=input_ids.device)[None]  # [1, T]
        else:
            positions = cache.begin(b, t, input_ids.device, lengths)  # [B, T]
        if not torch.compiler.is_compiling():
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            # The RoPE tables are made here, before the blocks: a table made inside a
            # compiled block would be an output of its CUDA graph (freed at the next step),
            # and inside a checkpointed compiled block it would make the forward's graph
            # differ from the recompute's, which finds the table made.
            self.prepare_rope(t if cache is None else cache.capacity, input_ids.device)
        x = self.embed(input_ids)  # [B, T, C]
        for block in self.blocks:
            x = block(x, positions, cache)  # [B, T, C]
        if cache is not None:
            cache.advance()
        return self.norm(x)  # [B, T, C]

    def set_context(self, context, *, attention: bool = True) -> None:
        """Train under context parallelism (a :class:`lapse.layers.ContextParallel`, or
        ``None``: one process): each rank's ``input_ids`` are then its tokens of the same
        rows (``context.split``), positions and attention follow the whole rows, and the
        loss is this rank's share of the rows' mean (:meth:`forward`). Raises where an
        attention layer cannot run under it.

        ``attention=False`` leaves the attention across ranks to another library: positions,
        the loss's share and the Pro block's KV-shift still follow the whole rows, but each
        layer's SDPA runs on the rank's own tokens, causal in their order, where
        ``torch.distributed.tensor.experimental.context_parallel`` puts its ring attention
        (``lapse bench train``'s ``transformer-torchcp``). Softmax attention only; the ranks'
        tokens must be the chunks ``context.split`` gives, as torch's head-tail sharding does."""
        layers = context
        if context is not None and not attention:
            for block in self.blocks:
                if type(block.attn).attend is not SoftmaxAttention.attend:
                    raise ValueError(
                        f"set_context(attention=False) leaves SDPA to torch's context parallelism: "
                        f"softmax attention only, got {type(block.attn).__name__}"
                    )
            layers = _LocalAttention(context.group, context.size, context.rank, "gather")
        for block in self.blocks:
            block.attn.set_context(layers)
        self.context = context

    def _check_inputs(self, input_ids: Tensor, cache: KVCache | None) -> None:
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            if isinstance(input_ids, Tensor):
                got = f"shape {tuple(input_ids.shape)}, dtype {input_ids.dtype}"
            else:
                got = type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer tensor [batch, time], got {got}")
        if cache is None:
            return
        if not isinstance(cache, KVCache):
            raise TypeError(
                f"cache must be a lapse.kv.KVCache (e.g. lapse.kv.DenseStore), got {type(cache).__name__}"
            )
        if cache.n_layers != len(self.blocks):
            raise ValueError(
                f"the cache has {cache.n_layers} layers but the model has {len(self.blocks)}: "
                "make it with DenseStore(config.n_layers)"
            )

    @contextlib.contextmanager
    def fused_projections(self, keep: bool = False) -> Iterator[None]:
        """Inside, one-token steps without autograd (decoding) multiply each layer's input
        once with its q, k, v (and output gate) weights concatenated, and once with
        ``[W_gate; W_up]``: a snapshot of the weights taken at entry (the decode step's
        small GEMMs are bound by kernel latency, :meth:`lapse.layers.Attention.fuse_projections`). Prefill,
        training and everything outside use the separate projections. The snapshot (one
        more copy of those weights) is freed on exit, or with ``keep`` kept for the next
        entry to write into, so a captured CUDA graph finds it at the same address
        (``generate(compile=True)`` keeps it). Every entry copies the weights again;
        weights changed inside (in place, by ``load_state_dict`` or an optimizer step, or by
        ``.to()``) are copied again before the next fused step
        (:meth:`refresh_fused_projections`), except writes that bump no version counter
        (through ``.data``; fused optimizers): enter again after those. Sharded weights
        (DTensors: FSDP2) are not fused."""
        try:
            for block in self.blocks:
                block.attn.fuse_projections()
                block.mlp.fuse_projections()
            yield
        finally:
            for block in self.blocks:
                block.attn.fuse_projections(False, keep)
                block.mlp.fuse_projections(False, keep)

    def refresh_fused_projections(self) -> None:
        """Inside :meth:`fused_projections`, takes each layer's snapshot again where its
        weights changed since it was taken (their address, dtype, device or version
        counter differ: ``lapse.layers.fused.FusedWeights``); outside, nothing. Host work
        only, no device sync: about 5 us per layer (60-80 us for 12 layers on a busy 2-core
        CPU). An eager step checks each layer by itself; a compiled one cannot without a
        graph break, so ``lapse.generation.compiled_decode_one_token`` calls this before
        each step."""
        for block in self.blocks:
            block.attn.refresh_fused()
            block.mlp.refresh_fused()

    def prepare_rope(self, max_positions: int, device: torch.device) -> None:
        """Makes the RoPE tables of every layer for ``max_positions`` now, on the host. A
        table first made inside a compiled step would be an output of its CUDA graph, which
        the next replay overwrites (a step whose prompt went in through another model, say
        a Hugging Face prefill: :func:`lapse.hf.generate`); ``lapse.generation.
        compiled_decode_one_token`` calls this before each step (a dictionary lookup once
        the tables are there)."""
        ready = (max_positions, device)
        if self.__dict__.get("_rope_ready") == ready:
            return
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module._tables(max_positions, device)
        self.__dict__["_rope_ready"] = ready

    def set_collect_stats(self, enabled: bool) -> None:
        """Keep each layer's statistics of the next forwards (ACP's, for forgetting
        attention) in ``attn.last_stats``."""
        for block in self.blocks:
            block.attn.collect_stats = enabled
            block.attn.last_stats = None

    def pruned_fractions(self) -> Tensor | None:
        """ACP pruned fraction of the last forward per layer and head, averaged over the
        batch: ``[n_layers, H]`` float32, or ``None`` where no statistics were collected."""
        stats = [block.attn.last_stats for block in self.blocks]
        if any(s is None for s in stats):
            return None
        return torch.stack([s.pruned_fraction.float().mean(0) for s in stats])  # [n_layers, H]


@dataclass(frozen=True, eq=False)
class _LocalAttention(ContextParallel):
    """The layers' context under ``Decoder.set_context(..., attention=False)``: RoPE's table
    and the KV-shift follow the whole rows as under :class:`ContextParallel`, but
    :meth:`attend` runs the kind's attention over the rank's own tokens (``gather``: its
    mode only so that no head count is checked)."""

    def attend(self, fn, q: Tensor, k: Tensor, v: Tensor, *per_key: Tensor, shared=()) -> Tensor:
        return fn(q, k, v, *per_key, *shared)


def prepare_blocks(
    model: Decoder, *, activation_checkpointing: bool = False, compile: bool | str = False
) -> None:
    """Training set-up of each block, in place: activation checkpointing (the block's
    activations recomputed in the backward instead of kept, ``torch.distributed``'s
    composable ``checkpoint``), then ``torch.compile`` per block (``compile`` a string: its
    mode, e.g. ``"reduce-overhead"``, CUDA graphs) and of the loss (:func:`lm_loss`, in the
    default mode; the loss without logits, ``forward(return_logits=False)``, stays eager:
    :func:`lapse.models.loss.chunked_lm_loss`). The trainer and ``lapse bench train`` share it.

    With CUDA graphs (``model.cuda_graphs``) each forward begins a CUDA-graph step
    (``cudagraph_mark_step_begin``: without it every block call would start one and free
    the previous block's saved activations), and a training step must give the parameters
    their gradients first (:func:`keep_grads`)."""
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in model.blocks:
            checkpoint(block)
    if compile:
        mode = compile if isinstance(compile, str) else None
        for block in model.blocks:
            block.compile(mode=mode)
        model.loss_fn = torch.compile(lm_loss)
        if mode in ("reduce-overhead", "max-autotune"):  # torch.compile's modes with CUDA graphs
            model.cuda_graphs = True


def keep_grads(model: nn.Module) -> None:
    """Gives every trainable parameter of ``model`` that has no gradient a zero one. Before
    each step of a model whose blocks replay CUDA graphs, with ``zero_grad(set_to_none=
    False)`` after it: a gradient first made by a replayed backward would live in the
    graphs' memory and be overwritten by the next micro-batch. Called at the step, not at
    set-up: a checkpoint's optimizer state loads into a model without gradients
    (``torch.distributed.checkpoint`` skips its initialisation when any parameter has one)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def init_weights(model: nn.Module, std: float) -> None:
    """Every Linear and embedding weight ~ N(0, std), biases 0, norm gains 1 (SPEC section 2)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


def param_count(model: nn.Module, non_embedding: bool = True) -> int:
    """Number of parameters; ``non_embedding`` leaves out the input embedding table.

    The embedding is a lookup that costs no FLOPs; the untied output head is a matmul and
    is counted, so ``6 * param_count(model)`` is the training FLOPs per token outside
    attention. The presets' nominal sizes follow this count (see :mod:`.config`).
    """
    total = sum(p.numel() for p in model.parameters())
    if non_embedding and isinstance(model, Decoder):
        total -= model.embed.weight.numel()
    return total


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: decay on Linear and embedding weights; none on norm gains,
    biases and scalars (DCP's ``beta``, an offset like a bias) (SPEC section 2). A parameter
    shared by several modules appears once; frozen ones (``requires_grad`` off) are left out."""
    decay: dict[int, nn.Parameter] = {}
    no_decay: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if isinstance(module, RMSNorm) or name == "bias" or p.dim() == 0:
                no_decay[id(p)] = p
            else:
                decay[id(p)] = p
    return [
        {"params": list(decay.values()), "weight_decay": weight_decay},
        {"params": [p for i, p in no_decay.items() if i not in decay], "weight_decay": 0.0},
    ]


def flops_per_token(config: ModelConfig, seq_len: int | None = None, *, pruned: float = 0.0) -> float:
    """Training FLOPs per token (forward + backward) for MFU: the work the model does.

    ``6 N`` for the matmuls (``N`` = :func:`param_count` with ``non_embedding``) plus the
    attention scores and values: ``QK^T`` and ``PV`` cost ``2 * 2 * D`` per (query, key)
    pair and head, times 3 for forward and backward, over the ``T^2 / 2`` pairs of causal
    attention (FlashAttention's count): ``6 * n_layers * H * D * T`` per token.

    ``pruned``: ACP's pruned fraction, the mean over layers and heads of
    ``AttentionStats.pruned_fraction`` (pruned tile area / causal tile area; every layer
    and head has the same ``T`` and ``D``, so the mean weighs them as their FLOPs do). The
    pruned tiles' pairs are left out of the attention term: the pairs counted are never more
    than the tiles the kernels compute (their diagonal tiles are whole), so FLOPs counted
    per second stay below the device's peak. ``pruned=0`` counts attention as dense causal:
    the dense-equivalent count, the work a run without pruning does. ``seq_len`` defaults
    to ``max_seq_len``.
    """
    t = config.max_seq_len if seq_len is None else seq_len
    if not 0.0 <= pruned <= 1.0:
        raise ValueError(f"pruned must be a fraction in [0, 1], got {pruned!r}")
    if pruned and not (config.attention == "forgetting" and config.acp):
        raise ValueError(f"pruned {pruned} given for {config.name} without ACP: nothing of it is pruned")
    causal_tiles, prunable = _acp_tile_areas(t)
    pruned_pairs = pruned * causal_tiles
    if pruned_pairs > prunable * (1 + 1e-6):  # float32 statistics round
        raise ValueError(
            f"pruned {pruned} is more than ACP can prune at T={t} ({prunable / causal_tiles:.6f}: "
            "it keeps every diagonal tile)"
        )
    with torch.device("meta"):
        n = param_count(Decoder(config), non_embedding=True)
    pairs_per_token = t / 2 - min(pruned_pairs, prunable) / t
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * pairs_per_token
    return float(6 * n + attention)


def _acp_tile_areas(t: int) -> tuple[int, int]:
    """``(causal, prunable)``: the area of ACP's causal tiles of one ``T x T`` head (what
    ``pruned_fraction`` divides by: each query block's key blocks up to its diagonal one,
    whole, clipped at ``T``), and the most of it ACP can prune (every key block before the
    diagonal one)."""
    block = ACP_BLOCK
    causal = prunable = 0
    for start in range(0, t, block):
        rows = min(block, t - start)
        causal += rows * min(start + block, t)
        prunable += rows * start
    return causal, prunable
