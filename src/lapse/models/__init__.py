"""Decoder language models (FoX and Transformer, LLaMA and Pro) and their configs (SPEC section 2)."""

from .config import ARCHS, PRESETS, ModelConfig, preset
from .decoder import (
    Attention,
    Block,
    Decoder,
    RMSNorm,
    SwiGLU,
    flops_per_token,
    init_weights,
    kv_shift,
    optimizer_groups,
    param_count,
    rope,
)

__all__ = [
    "ARCHS",
    "PRESETS",
    "Attention",
    "Block",
    "Decoder",
    "ModelConfig",
    "RMSNorm",
    "SwiGLU",
    "flops_per_token",
    "init_weights",
    "kv_shift",
    "optimizer_groups",
    "param_count",
    "preset",
    "rope",
]
