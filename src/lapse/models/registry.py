"""The one place a kind name becomes a class: attention kinds and block kinds.

A config names its attention kind (``softmax``, ``forgetting``, ``dcp``, ``castle``) and its block kind
(``llama``, ``pro``) as separate fields; :func:`build_attention` turns the two into a
layer. A new method adds an entry here (its layer in ``lapse.layers``, and in
:mod:`.kinds` what a config checks of it without importing the layer); nothing else
branches on its name.
"""

from __future__ import annotations

from dataclasses import asdict

from lapse.layers import Attention, CastleAttention, DCPAttention, ForgettingAttention, SoftmaxAttention

from .kinds import ATTENTION_TRAITS, BLOCK_KINDS


def _softmax(config, **common) -> Attention:
    return SoftmaxAttention(**common, rope_base=config.rope_base)


def _forgetting(config, **common) -> Attention:
    return ForgettingAttention(**common, acp=config.acp, acp_eps=config.acp_eps, backend=config.attn_backend)


def _dcp(config, **common) -> Attention:
    return DCPAttention(**common, rope_base=config.rope_base, r=config.dcp_r, beta_init=config.dcp_beta_init)


def _castle(config, **common) -> Attention:
    return CastleAttention(
        **common, window=config.castle_window, rope_base=config.rope_base, backend=config.attn_backend,
        fold_every=config.castle_fold_every,
    )


ATTENTION_KINDS: dict[str, type[Attention]] = {
    "softmax": SoftmaxAttention, "forgetting": ForgettingAttention, "dcp": DCPAttention,
    "castle": CastleAttention,
}
_BUILDERS = {"softmax": _softmax, "forgetting": _forgetting, "dcp": _dcp, "castle": _castle}
assert set(ATTENTION_KINDS) == set(_BUILDERS) == set(ATTENTION_TRAITS)  # a kind is an entry in each


def attention_class(kind: str) -> type[Attention]:
    """The layer class of attention kind ``kind`` (``ValueError`` naming the kinds)."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; valid kinds: {', '.join(ATTENTION_KINDS)}")
    return ATTENTION_KINDS[kind]


def build_attention(config, layer_idx: int) -> Attention:
    """The attention layer ``layer_idx`` of a model with ``config`` (a ``ModelConfig``)."""
    attention_class(config.attention)
    block = BLOCK_KINDS[config.block]
    features = {k: v for k, v in asdict(block).items() if k != "mlp_ratio"}
    return _BUILDERS[config.attention](
        config,
        d_model=config.d_model,
        n_heads=config.n_heads,
        n_kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        layer_idx=layer_idx,
        norm_eps=config.norm_eps,
        qk_norm_eps=config.qk_norm_eps,
        **features,
    )
