"""The one place a kind name becomes a class: attention kinds and block kinds.

A config names its attention kind (``softmax``, ``forgetting``, ``dcp``, ``castle``) and its block kind
(``llama``, ``pro``) as separate fields; :func:`build_attention` turns the two into a
layer. A new method adds an entry here (and its layer in ``lapse.layers``); nothing else
branches on its name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lapse.layers import Attention, CastleAttention, DCPAttention, ForgettingAttention, SoftmaxAttention


@dataclass(frozen=True)
class BlockKind:
    """The features a block kind gives every attention layer, and its default MLP size."""

    kv_shift: bool
    qk_norm: bool
    output_gate: bool
    mlp_ratio: float
    """SwiGLU size as a multiple of ``d_model`` (see ``ModelConfig.mlp_ratio``)."""


BLOCK_KINDS: dict[str, BlockKind] = {
    "llama": BlockKind(kv_shift=False, qk_norm=False, output_gate=False, mlp_ratio=4.0),
    # the smaller MLP pays for the output gate, so Pro and LLaMA have the same size (SPEC section 2)
    "pro": BlockKind(kv_shift=True, qk_norm=True, output_gate=True, mlp_ratio=3.5),
}


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
