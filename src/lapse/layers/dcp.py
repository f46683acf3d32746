"""Dynamic Context Pruning (SPEC section 6): softmax attention with RoPE under a learned,
irreversible keep mask ``I`` shared by the layer's heads.

    q_int, k_int = W_Qint x, W_Kint x                       [B, T, r]
    z[n, j]      = q_int[n] . k_int[j] / sqrt(r) + beta
    log I[k, j]  = sum_{n=j+1..k} log Ibar[n, j]            Ibar = sigma_alpha(z) or 1[z > 0]
    o            = softmax(scale q k^T + log I) v

Which ``Ibar``: the alpha-sigmoid while the layer trains (``alpha`` is set by the
trainer's schedule), the step ``1[z > 0]`` at inference. The switch is ``step_mask``:
``None`` (the default) follows ``self.training`` like dropout does, so ``model.eval()``
gives the inference model (full forward and cached decoding alike); ``True``/``False``
force one mask whatever the mode.

Decoding over a :class:`~lapse.kv.DenseStore`: each token appends its interaction key
``kint`` ``[B, S, r]`` and its ``log_keep`` ``[B, S]`` beside ``k, v``: the ``log I`` of
that slot as of the sequence's latest token (0 kept, ``<= LOG_FLOOR`` dropped). A new
token ``n`` adds its ``log Ibar[n, j]`` to every held slot ``j < n`` in place (the
product of SPEC section 6, so a dropped slot stays dropped) and attends with ``log_keep``
as an additive bias; its own slot starts at 0. A dropped slot's ``log_keep`` is held at
``LOG_FLOOR`` (``exp`` is 0 there in any float, as for the ``-inf`` it stands for). The
prefill computes ``log I`` over the prompt and stores each token's row entry as of the
prompt's last token. Shapes stay fixed (every slot is scored, the causal mask picks the
held ones), so the step compiles.

Shapes: a trailing comment on each line that makes a new shape. Legend: B batch, T new
tokens, C d_model, H query heads, K key/value heads, D head dim, S cache slots, r
interaction dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lapse.kv import KVCache, PagedView
from lapse.ops.dcp import (
    LOG_FLOOR,
    dcp_attention,
    dcp_sparsity,
    interaction_log_mask,
    interaction_log_mask_step,
    interaction_logits,
    log_alpha_sigmoid,
)
from lapse.ops.dcp.alpha_sigmoid import check_alpha
from lapse.ops.dcp.paged_drop import dcp_paged_drop
from lapse.ops.forgetting import forgetting_attention_paged_decode

from .softmax import SoftmaxAttention


@dataclass(eq=False)
class DCPStats:
    """What a DCP layer's last full forward dropped (kept when ``collect_stats`` is set).

    Attributes:
        dropped: ``[B, T]`` float32, the share of earlier tokens dropped at each position
            (:func:`lapse.ops.dcp.dcp_sparsity`; 0 at position 0), under the mask the
            forward used (alpha-sigmoid or step).
    """

    dropped: Tensor


class DCPInteraction:
    """What DCP adds to a softmax attention layer, for any module that mixes it in: the
    interaction projections and ``beta``, the mask of the current mode, and the decode
    over a paged store. The host class provides ``training``, ``layer_idx``,
    ``n_heads``, ``n_kv_heads``, ``scale``, ``collect_stats`` and ``last_stats``; it calls
    :meth:`init_interaction` in its ``__init__`` (lapse's :class:`DCPAttention`, and the
    Hugging Face wrapper of :mod:`lapse.hf.dcp`).

    Attributes:
        alpha: the alpha-sigmoid's alpha (``>= 1``, checked when set); the trainer's
            schedule sets it, 1.0 at first. Also held in a 0-d float64 buffer that the
            setter fills in place: compiled code reads that, so the training forward
            compiles whole and a new value needs no recompilation.
        step_mask: ``None``: the step mask in eval mode, the alpha-sigmoid in training
            mode; ``True``/``False``: always the step / the alpha-sigmoid.
        keep_log_mask: keep the last full forward's ``log I`` ``[B, T, T]`` (with its
            graph, for the sparsity loss) until :meth:`take_log_mask` takes it.
    """

    marks_dropped_slots = True  # each slot's drop flag, read by lapse.generation.DCPDrop

    def init_interaction(self, c: int, r: int, beta_init: float) -> None:
        """``W_Qint, W_Kint: c -> r`` (no bias) and ``beta`` at ``beta_init``."""
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"the DCP interaction dim r must be a positive integer, got {r!r}")
        if not math.isfinite(beta_init):
            raise ValueError(f"beta_init must be a finite number, got {beta_init!r}")
        self.r = r
        self.qint_proj = nn.Linear(c, r, bias=False)  # W_Qint
        self.kint_proj = nn.Linear(c, r, bias=False)  # W_Kint
        self.beta = nn.Parameter(torch.tensor(float(beta_init)))
        # alpha as data for compiled code (see _alpha_arg): float64, so that it holds the
        # float exactly; not in the state dict (the trainer's schedule sets it each step)
        self.register_buffer("_alpha_t", torch.ones((), dtype=torch.float64), persistent=False)
        self.alpha = 1.0
        self.step_mask: bool | None = None
        self.keep_log_mask = False
        self.last_log_mask: Tensor | None = None
        self.interaction_backend = "auto"  # of the alpha-sigmoid: "auto", "triton" or "torch"

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._alpha = check_alpha(value)
        self._alpha_t.fill_(self._alpha)  # in place: a compiled graph reads the new value

    def _alpha_arg(self) -> float | Tensor:
        """The alpha-sigmoid's alpha: the float in eager code (the closed forms at 1 and 2
        are host branches there), the 0-d buffer under ``torch.compile``, so that one graph
        serves every value of the schedule instead of one recompilation per step."""
        return self._alpha_t if torch.compiler.is_compiling() else self._alpha

    def _apply(self, fn, recurse=True):
        # model.to(dtype) would round the alpha buffer and to_empty() leave it unset: it
        # stays float64 and is refilled from the float, the one value it ever holds
        super()._apply(fn, recurse)
        alpha_t = self._buffers.get("_alpha_t")
        if alpha_t is not None:
            if alpha_t.dtype != torch.float64:
                self._alpha_t = alpha_t = torch.empty((), dtype=torch.float64, device=alpha_t.device)
            alpha_t.fill_(self._alpha)
        return self

    @property
    def uses_step_mask(self) -> bool:
        """Whether the next forward uses the step ``1[z > 0]`` (else the alpha-sigmoid)."""
        return not self.training if self.step_mask is None else self.step_mask

    def interaction_parameters(self) -> list[nn.Parameter]:
        """``W_Qint``, ``W_Kint`` and ``beta``: what DCP adds to softmax attention."""
        return [self.qint_proj.weight, self.kint_proj.weight, self.beta]

    def take_log_mask(self) -> Tensor | None:
        """The ``log I`` kept by the last full forward (see ``keep_log_mask``), and forget
        it (holding it would keep that forward's graph alive)."""
        log_i, self.last_log_mask = self.last_log_mask, None
        return log_i

    def _attend_paged(
        self, q: Tensor, k: Tensor, v: Tensor, q_int: Tensor, k_int: Tensor, positions: Tensor, cache: KVCache
    ) -> Tensor:
        """Decoding over a :class:`~lapse.kv.PagedStore`, with the step mask only.

        Each slot carries a ``drop`` flag (0 kept, ``-LOG_FLOOR`` dropped: the paged op's
        FoX-style bias ``c_query - c_j`` with ``c_query = 0`` is then ``LOG_FLOOR``, an
        exact 0 after ``exp``) and its share of ``kint``: the interaction key is padded to
        a multiple of the kv heads and each head's pages hold one slice (``r / K`` values
        per slot instead of ``r`` in every head), which works because every head of a
        layer holds the same slots (``needs_uniform_heads``). A new token reads the
        slices back, drops the slots its ``z <= 0`` says, and attends; the
        :class:`~lapse.generation.DCPDrop` policy frees what is flagged.
        """
        if not self.uses_step_mask:
            raise ValueError("DCP over a paged store decodes with the inference step mask: call model.eval()")
        b, t, _ = q_int.shape
        kh, hq = self.n_kv_heads, self.n_heads
        r = q_int.shape[-1]
        part = -(-r // kh)  # kint values per head and slot
        # in the interaction keys' own dtype: z is computed from them in it (no wider copy is read)
        kint = F.pad(k_int, (0, part * kh - r))  # [B, T, K * part]
        if t > 1:  # prefill: log I over the prompt, each token's flag as of its prompt's last token
            log_i = self._log_mask(q_int, k_int)  # [B, T, T]
            dropped = cache.last(log_i) <= LOG_FLOOR  # [B, T]
            drop = torch.where(dropped, -LOG_FLOOR, 0.0)[..., None].expand(b, t, hq).float()
            cache.append(self.layer_idx, k, v, kint=kint, drop=drop.contiguous())
            return dcp_attention(q, k, v, log_i, scale=self.scale)
        cache.append(self.layer_idx, k, v, kint=kint, drop=q.new_zeros(b, 1, hq, dtype=torch.float32))
        view = cache.view(self.layer_idx)
        flags = view.extras["drop"]
        dcp_paged_drop(q_int[:, 0], view.extras["kint"], flags, view.page_table, view.lengths, self.beta)
        o = forgetting_attention_paged_decode(
            q[:, 0], view.k, view.v, view.page_table, view.lengths,
            c_pages=flags, c_query=q.new_zeros(b, hq, dtype=torch.float32), scale=self.scale,
            check_values=False,
        )
        return o[:, None]  # [B, 1, H, D]

    def _log_mask(self, q_int: Tensor, k_int: Tensor) -> Tensor:
        """``log I`` ``[B, T, T]`` of a full forward, under the mask of the current mode;
        kept for the sparsity loss and statistics when asked."""
        if self.uses_step_mask:
            log_i = interaction_log_mask_step(q_int, k_int, self.beta)
        else:
            log_i = interaction_log_mask(
                q_int, k_int, self.beta, self._alpha_arg(), backend=self.interaction_backend
            )
        if self.keep_log_mask:
            self.last_log_mask = log_i
        if self.collect_stats:
            self.last_stats = DCPStats(dropped=dcp_sparsity(log_i))
        return log_i



class DCPAttention(DCPInteraction, SoftmaxAttention):
    """Softmax attention with RoPE and the DCP interaction mask (see the module doc).

    Args: those of :class:`~lapse.layers.SoftmaxAttention`, and
        r: interaction dimension of ``W_Qint, W_Kint: d_model -> r`` (no bias).
        beta_init: initial value of the layer's scalar offset ``beta``.

    Attributes: those of :class:`DCPInteraction`.
    """

    supports_paged = True
    needs_uniform_heads = True  # kint is split across the kv heads' pages (see _attend_paged)
    records_scores = False  # its attention runs under the drop mask, without the scores H2O/A2SF read
    context_modes = ("head",)  # the mask is shared by every head: each rank makes it whole

    def __init__(self, *args, r: int = 64, beta_init: float = 2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.init_interaction(self.q_proj.in_features, r, beta_init)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, positions: Tensor, cache: KVCache | None
    ) -> Tensor:
        t = q.shape[1]
        q, k = self._rotate(q, k, positions, cache)
        q_int, k_int = self.qint_proj(x), self.kint_proj(x)  # [B, T, r]
        if cache is None:
            if self.context is not None:  # head mode: every rank's heads read the whole mask
                ctx = self.context
                log_i = self._log_mask(ctx.gather(q_int), ctx.gather(k_int))  # [B, T_all, T_all]
                return ctx.attend(
                    lambda q, k, v, log_i: dcp_attention(q, k, v, log_i, scale=self.scale),
                    q, k, v, shared=(log_i,),
                )
            return dcp_attention(q, k, v, self._log_mask(q_int, k_int), scale=self.scale)
        if isinstance(cache.view(self.layer_idx), PagedView):
            return self._attend_paged(q, k, v, q_int, k_int, positions, cache)
        if t > 1 and cache.length == 0:  # prefill: log I over the prompt
            log_i = self._log_mask(q_int, k_int)  # [B, T, T]
            log_keep = cache.last(log_i).clamp_min(LOG_FLOOR)  # [B, T]: as of each prompt's last token
            cache.append(self.layer_idx, k, v, kint=k_int, log_keep=log_keep.detach())
            return dcp_attention(q, k, v, log_i, scale=self.scale)
        acc = torch.float64 if q_int.dtype == torch.float64 else torch.float32
        cache.append(self.layer_idx, k, v, kint=k_int, log_keep=q_int.new_zeros(q_int.shape[:2], dtype=acc))
        view = cache.view(self.layer_idx)
        log_keep = view.extras["log_keep"]  # [B, S]: as of the token before these
        z = interaction_logits(q_int, view.extras["kint"], self.beta)  # [B, T, S]
        if self.uses_step_mask:
            log_ibar = torch.where(z > 0, 0.0, LOG_FLOOR).to(z.dtype)
        else:
            log_ibar = log_alpha_sigmoid(z, self._alpha_arg()).clamp_min(LOG_FLOOR)
        slots = torch.arange(z.shape[-1], device=z.device)  # [S]
        later = slots[None, None, :] < positions[:, :, None]  # [B, T, S]: token n acts on slots j < n
        rows = log_keep[:, None, :] + torch.where(later, log_ibar, 0.0).cumsum(dim=1)  # [B, T, S]
        log_keep.copy_(cache.last(rows).clamp_min(LOG_FLOOR))  # in place: irreversible from now on
        held = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
        bias = torch.where(held, rows, -math.inf).to(q.dtype)  # [B, T, S]
        keys, values = view.k, view.v  # [B, S, K, D]
        if t > 1:  # a chunk after a prefix (eager): only the held slots, as SoftmaxAttention
            n = cache.length + t
            keys, values, bias = keys[:, :n], values[:, :n], bias[..., :n]
        return self._sdpa(q, keys, values, bias[:, None])

def take_log_masks(layers: list[DCPAttention]) -> tuple[list[Tensor], Tensor]:
    """The ``log I`` each layer kept in its last full forward (``keep_log_mask``; taken
    from the layers) and the share of context each dropped, ``[L]``: the mean over
    positions ``k >= 1`` of dropped / k. What DCP training reads after each forward."""
    masks = [layer.take_log_mask() for layer in layers]
    if any(m is None for m in masks):
        raise RuntimeError("a DCP layer kept no log I: no full forward ran since the last call")
    with torch.no_grad():
        dropped = torch.stack([dcp_sparsity(m)[:, 1:].mean() for m in masks])  # [L]
    return masks, dropped
