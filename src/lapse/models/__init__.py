"""Decoder language models (an attention kind in a LLaMA or Pro block), their configs and
the registry of kinds (SPEC section 2).

Each name loads with its submodule on first use: :mod:`.config` and :mod:`.kinds` import
no torch, so the command line builds configs without it.
"""

from lapse.lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    "lapse.layers": ("Attention", "RMSNorm", "SwiGLU", "kv_shift"),
    ".config": ("ARCH_ALIASES", "ARCHS", "CASTLE_ARCHS", "PRESETS", "ModelConfig", "default_castle_window",
                "preset"),
    ".decoder": ("Block", "Decoder", "flops_per_token", "init_weights", "keep_grads", "optimizer_groups",
                 "param_count", "prepare_blocks"),
    ".kinds": ("BLOCK_KINDS",),
    ".registry": ("ATTENTION_KINDS", "attention_class", "build_attention"),
})
