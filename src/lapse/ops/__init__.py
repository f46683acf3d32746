"""Pure functions on tensors: the attention ops of lapse."""

from .castle import (
    castle_attention,
    castle_attention_decode,
    castle_decode_update,
    castle_lookahead_keys,
)
from .forgetting import AttentionStats, forgetting_attention, forgetting_attention_decode
from .scores import attention_key_scores

__all__ = [
    "AttentionStats",
    "attention_key_scores",
    "castle_attention",
    "castle_attention_decode",
    "castle_decode_update",
    "castle_lookahead_keys",
    "forgetting_attention",
    "forgetting_attention_decode",
]
