"""Decoder language models (an attention kind in a LLaMA or Pro block), their configs and
the registry of kinds (SPEC section 2)."""

from lapse.layers import Attention, RMSNorm, SwiGLU, kv_shift

from .config import ARCH_ALIASES, ARCHS, CASTLE_ARCHS, PRESETS, ModelConfig, default_castle_window, preset
from .decoder import (
    Block,
    Decoder,
    flops_per_token,
    init_weights,
    keep_grads,
    optimizer_groups,
    param_count,
    prepare_blocks,
)
from .registry import ATTENTION_KINDS, BLOCK_KINDS, attention_class, build_attention

__all__ = [
    "ARCHS",
    "ARCH_ALIASES",
    "ATTENTION_KINDS",
    "BLOCK_KINDS",
    "CASTLE_ARCHS",
    "PRESETS",
    "Attention",
    "Block",
    "Decoder",
    "ModelConfig",
    "RMSNorm",
    "SwiGLU",
    "attention_class",
    "build_attention",
    "default_castle_window",
    "flops_per_token",
    "init_weights",
    "keep_grads",
    "kv_shift",
    "optimizer_groups",
    "param_count",
    "prepare_blocks",
    "preset",
]
