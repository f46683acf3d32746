"""A pretrained Hugging Face LLaMA-family causal LM as a lapse :class:`~lapse.models.Decoder`.

``lapse import`` (:mod:`lapse.train.importing`) writes the result as a run folder, so
generation, evaluation, benchmarks and DCP fine-tuning (``lapse train --init-from``) run
on real pretrained weights. The two models compute the same function:

- the architecture is ``transformer-llama`` (softmax attention with RoPE in the LLaMA
  block: pre-norm RMSNorm, SwiGLU, final RMSNorm, an output head); ``d_model``,
  ``n_layers``, ``n_heads``, ``n_kv_heads`` (GQA), the head dim (``attn_head_dim`` when it
  is not ``hidden_size / num_attention_heads``), the SwiGLU width (``mlp_hidden_size``,
  ``intermediate_size`` as it is), ``rope_base`` (``rope_theta``), ``norm_eps``
  (``rms_norm_eps``), ``vocab_size`` and ``max_seq_len`` (``max_position_embeddings``)
  are copied;
- RoPE: both rotate the channel pairs ``(i, i + D/2)`` (rotate-half), so the q and k
  weights are copied without permuting rows (a GGUF file's interleaved rows are undone
  by ``transformers`` when it loads the file);
- a tied output head (``tie_word_embeddings``) becomes lapse's untied ``lm_head``, a copy
  of the embedding: equal at the start, free to differ once fine-tuned.

What lapse cannot represent is refused with a :class:`NotRepresentable` naming the reason:
attention or MLP biases (Qwen2's q/k/v biases), QK-norm without the Pro block (Qwen3), a
sliding window shorter than the context, RoPE scaling (``rope_type`` other than
``default``), an activation other than SiLU, and model types outside ``llama`` and
``mistral``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from lapse.models import Decoder, ModelConfig

from .loading import check_gguf_packages, load_pretrained, resolve_model_path

MODEL_TYPES = ("llama", "mistral")
"""``model_type``s lapse can hold exactly (what the checks below then confirm per model)."""

_REFUSED_TYPES = {
    "qwen2": "its q/k/v projections have biases, which lapse's attention has not",
    "qwen3": "its QK-norm (one RMSNorm per head dim, shared by the heads) has no lapse block: "
    "lapse has QK-norm only in the Pro block, with KV-shift and an output gate",
}


class NotRepresentable(ValueError):
    """A pretrained model with a feature lapse's ``transformer-llama`` does not have."""


def lapse_config(config: PretrainedConfig) -> ModelConfig:
    """The ``transformer-llama`` :class:`~lapse.models.ModelConfig` of a Hugging Face
    LLaMA-family config; :class:`NotRepresentable` for what lapse cannot hold."""
    kind = getattr(config, "model_type", None)
    if kind in _REFUSED_TYPES:
        raise NotRepresentable(f"cannot import a {kind} model: {_REFUSED_TYPES[kind]}")
    if kind not in MODEL_TYPES:
        raise NotRepresentable(
            f"cannot import model type {kind!r}: lapse imports the LLaMA family ({', '.join(MODEL_TYPES)})"
        )
    if getattr(config, "attention_bias", False):
        raise NotRepresentable(f"cannot import this {kind} model: its attention projections have biases")
    if getattr(config, "mlp_bias", False):
        raise NotRepresentable(f"cannot import this {kind} model: its MLP projections have biases")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise NotRepresentable(
            f"cannot import this {kind} model: its MLP activation is {act!r}, lapse's SwiGLU uses SiLU"
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        raise NotRepresentable(
            f"cannot import this {kind} model: it attends through a sliding window of {window} tokens "
            f"(below its context, {config.max_position_embeddings}); lapse's softmax attention sees "
            "every token"
        )
    rope_base = _rope_base(config, kind)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    natural = config.hidden_size // config.num_attention_heads
    tiled = config.hidden_size % config.num_attention_heads == 0 and head_dim == natural
    return ModelConfig(
        arch="transformer-llama",
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        attn_head_dim=None if tiled else head_dim,
        mlp_hidden_size=config.intermediate_size,
        rope_base=rope_base,
        norm_eps=config.rms_norm_eps,
        max_seq_len=config.max_position_embeddings,
    )


def _rope_base(config: PretrainedConfig, kind: str) -> float:
    """``rope_theta``, from ``rope_parameters`` (``transformers`` 5) or the old fields;
    :class:`NotRepresentable` for any RoPE scaling."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None)
    rope_type = params.get("rope_type", "default")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "scaled"))
    if rope_type != "default":
        raise NotRepresentable(
            f"cannot import this {kind} model: it scales RoPE (rope_type {rope_type!r}); lapse's RoPE "
            "is unscaled"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise NotRepresentable(f"cannot import this {kind} model: its config gives no rope_theta")
    return float(theta)


def lapse_state_dict(model: PreTrainedModel, config: ModelConfig, share: bool = False) -> dict[str, Tensor]:
    """The weights of a Hugging Face LLaMA-family ``model`` under lapse's parameter names,
    float32; a tied output head is copied into ``lm_head``. ``share``: the model's own
    tensors instead (its dtype, no copy; a tied head is the embedding itself).
    :class:`NotRepresentable` when the model holds a tensor with no lapse counterpart (a
    bias, a QK-norm, ...)."""
    hf = dict(model.state_dict())
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        names[f"{ours}.attn_norm.weight"] = f"{theirs}.input_layernorm.weight"
        names[f"{ours}.mlp_norm.weight"] = f"{theirs}.post_attention_layernorm.weight"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"{ours}.attn.{p}.weight"] = f"{theirs}.self_attn.{p}.weight"
        for ours_p, theirs_p in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            names[f"{ours}.mlp.{ours_p}.weight"] = f"{theirs}.mlp.{theirs_p}.weight"
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) or "lm_head.weight" not in hf
    names["lm_head.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
    missing = sorted(set(names.values()) - set(hf))
    if missing:
        raise NotRepresentable(f"the model lacks weights a LLaMA block has: {', '.join(missing[:4])}")
    extra = sorted(set(hf) - set(names.values()) - {"lm_head.weight"})
    if extra:
        raise NotRepresentable(f"the model has weights lapse has no place for: {', '.join(extra[:4])}")
    if share:
        return {ours: hf[theirs].detach() for ours, theirs in names.items()}
    # clone: the tied head must not share memory with the embedding (safetensors refuses that)
    dense = torch.contiguous_format
    return {ours: hf[theirs].detach().float().clone(memory_format=dense) for ours, theirs in names.items()}


def decoder_from_hf(model: PreTrainedModel, share: bool = False) -> Decoder:
    """A float32 lapse :class:`~lapse.models.Decoder` computing what ``model`` computes.
    ``share``: its parameters are the model's own tensors (the model's dtype and device, no
    copy: for inference beside the model, :func:`lapse.hf.generate`; a change to either
    model's weights changes both)."""
    config = lapse_config(model.config)
    with torch.device("meta"):  # every weight is overwritten: skip the init
        decoder = Decoder(config)
    decoder.load_state_dict(lapse_state_dict(model, config, share), assign=True)
    return decoder.eval()


def load_for_import(
    path_or_package: str | Path, gguf_file: str | None = None
) -> tuple[PreTrainedModel, object, ModelConfig]:
    """The float32 Hugging Face model and tokenizer at ``path_or_package`` (as
    :func:`~lapse.hf.load_pretrained` takes it) and its lapse config; the config is checked
    before any weight is read, so what lapse cannot represent fails fast."""
    folder, gguf = resolve_model_path(path_or_package, gguf_file)
    check_gguf_packages(gguf)  # before transformers reads the file and asks for them itself
    extra = {} if gguf is None else {"gguf_file": gguf}
    config = lapse_config(AutoConfig.from_pretrained(folder, **extra))
    model, tokenizer = load_pretrained(folder, gguf)
    if tokenizer.eos_token_id is None:
        raise NotRepresentable(f"the tokenizer of {path_or_package} defines no end-of-text token")
    if len(tokenizer) > config.vocab_size:
        raise NotRepresentable(
            f"the tokenizer of {path_or_package} has {len(tokenizer)} ids but the model's embedding only "
            f"{config.vocab_size} rows"
        )
    return model, tokenizer, config
