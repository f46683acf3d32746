"""Pure functions on tensors: the attention ops of lapse."""

from .castle import (
    castle_attention,
    castle_attention_decode,
    castle_decode_step,
    castle_decode_update,
    castle_lookahead_keys,
)
from .dcp import (
    alpha_sigmoid,
    dcp_attention,
    dcp_sparsity,
    dcp_sparsity_loss,
    interaction_log_mask,
    interaction_log_mask_step,
    interaction_logits,
    log_alpha_sigmoid,
)
from .forgetting import AttentionStats, forgetting_attention, forgetting_attention_decode
from .scores import attention_key_scores

__all__ = [
    "AttentionStats",
    "alpha_sigmoid",
    "attention_key_scores",
    "castle_attention",
    "castle_attention_decode",
    "castle_decode_step",
    "castle_decode_update",
    "castle_lookahead_keys",
    "dcp_attention",
    "dcp_sparsity",
    "dcp_sparsity_loss",
    "forgetting_attention",
    "forgetting_attention_decode",
    "interaction_log_mask",
    "interaction_log_mask_step",
    "interaction_logits",
    "log_alpha_sigmoid",
]
