"""What a config knows of each kind without building a layer: the block kinds' features and
the traits of each attention kind that :class:`~lapse.models.ModelConfig` checks.

Plain data, so a config (and the command line, which builds one for every preset) loads
without torch. :mod:`lapse.models.registry` maps the same names to the layer classes; each
trait here is the same-named class attribute of the kind's layer
(``tests/models/test_kinds.py`` holds the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class AttentionTraits:
    """What a config checks of an attention kind (``lapse.layers.Attention``'s attributes)."""

    supports_acp: bool = False
    """The kind can prune with ACP (a forget gate to bound the dropped mass with)."""
    needs_even_head_dim: bool = False
    """The kind rotates channel pairs (RoPE)."""
    matrices_per_head: int = 4
    """``d_model x head_dim`` weight matrices per head (4 for softmax attention); an ``arch``
    alias of a kind with more gets fewer heads, for the Transformer's parameters."""


ATTENTION_TRAITS: dict[str, AttentionTraits] = {
    "softmax": AttentionTraits(needs_even_head_dim=True),
    "forgetting": AttentionTraits(supports_acp=True),
    "dcp": AttentionTraits(needs_even_head_dim=True),
    "castle": AttentionTraits(needs_even_head_dim=True, matrices_per_head=7),
}


def attention_traits(kind: str) -> AttentionTraits:
    """The traits of attention kind ``kind`` (``ValueError`` naming the kinds)."""
    if kind not in ATTENTION_TRAITS:
        raise ValueError(f"unknown attention kind {kind!r}; valid kinds: {', '.join(ATTENTION_TRAITS)}")
    return ATTENTION_TRAITS[kind]
