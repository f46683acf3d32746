"""Pure functions on tensors: the attention ops of lapse."""

from .forgetting import AttentionStats, forgetting_attention, forgetting_attention_decode

__all__ = ["AttentionStats", "forgetting_attention", "forgetting_attention_decode"]
