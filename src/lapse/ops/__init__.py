"""Pure functions on tensors: the attention ops of lapse."""

from .forgetting import AttentionStats, forgetting_attention, forgetting_attention_decode
from .scores import attention_key_scores

__all__ = [
    "AttentionStats",
    "attention_key_scores",
    "forgetting_attention",
    "forgetting_attention_decode",
]
