"""Hugging Face ``transformers`` adapter: config, causal-LM wrapper and Auto registration.

Importing ``lapse.hf`` registers model type ``"lapse"`` with ``AutoConfig`` and
``AutoModelForCausalLM`` (idempotently), so that ``save_pretrained`` folders load with
the Auto classes. ``lapse.hf`` is the only package that imports ``transformers``
(``from lapse.hf import LapseForCausalLM``).

- :class:`LapseConfig` holds the :class:`~lapse.models.ModelConfig` fields under the same
  names (``from_model_config`` / ``to_model_config`` convert); the model checks it.
- :class:`LapseForCausalLM` wraps a :class:`~lapse.models.Decoder` as ``self.model``.
  ``labels`` follow the Hugging Face convention (unshifted: the loss of position ``t``
  is on ``labels[:, t + 1]``), unlike ``Decoder``, whose labels are already shifted.
  The cache is a lapse store (:class:`~lapse.hf.LapseCache`, a ``DenseStore`` that
  answers ``generate``'s questions), passed around as ``cache`` (transformers >= 5.24;
  ``past_key_values`` before: the forward takes either, :mod:`lapse.hf.compat`): the model
  makes it on the first call with ``use_cache``, so ``generate()`` never makes a
  ``DynamicCache`` (``_supports_default_dynamic_cache`` returns False, the route
  transformers keeps for models with their own cache).

Padding: an ``attention_mask`` whose ones are one contiguous run per row (left padding,
as ``generate`` wants for decoder-only models, or right padding). A padded row is moved
so that its tokens come first, run as a ragged batch (``Decoder(..., lengths=)``: the
cache holds no padding and each sequence continues from its own last token), and its
logits moved back; the result equals each row run alone. Later calls with a cache bring
one token per sequence (``generate``'s decode steps) whose mask entries are 1.

Not supported: holes in a row's mask, padding in a chunk after a prefix, ``inputs_embeds``,
assisted generation (the cache cannot be cropped), hidden states and attention outputs.
"""

from __future__ import annotations

from dataclasses import asdict, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast

from lapse.models import Decoder, ModelConfig, RMSNorm
from lapse.models.checkpoint import model_config_from_json

from .cache import LapseCache
from .compat import CACHE_ARG, CACHE_NAMES, either_cache
from .evicting import EvictingCache
from .padding import padding_runs, roll_rows

_DEFAULT = ModelConfig()


class LapseConfig(PretrainedConfig):
    """The :class:`~lapse.models.ModelConfig` of a lapse decoder as a ``transformers``
    config (``config.json``). The fields mean what they mean there; the usual
    ``transformers`` names (``hidden_size``, ``num_hidden_layers``, ...) are aliases."""

    model_type = "lapse"
    keys_to_ignore_at_inference = list(CACHE_NAMES)  # the output's cache, under either transformers' name
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "max_position_embeddings": "max_seq_len",
    }

    attention: str = _DEFAULT.attention
    block: str = _DEFAULT.block
    arch: str | None = None  # an alias of (attention, block); exports written before those fields hold it
    vocab_size: int = _DEFAULT.vocab_size
    d_model: int = _DEFAULT.d_model
    n_layers: int = _DEFAULT.n_layers
    n_heads: int = _DEFAULT.n_heads
    n_kv_heads: int | None = _DEFAULT.n_kv_heads
    attn_head_dim: int | None = _DEFAULT.attn_head_dim
    mlp_ratio: float | None = _DEFAULT.mlp_ratio
    mlp_multiple_of: int = _DEFAULT.mlp_multiple_of
    mlp_hidden_size: int | None = _DEFAULT.mlp_hidden_size
    rope_base: float = _DEFAULT.rope_base
    norm_eps: float = _DEFAULT.norm_eps
    qk_norm_eps: float = _DEFAULT.qk_norm_eps
    acp: bool = _DEFAULT.acp
    acp_eps: float = _DEFAULT.acp_eps
    max_seq_len: int = _DEFAULT.max_seq_len
    dcp_r: int = _DEFAULT.dcp_r
    dcp_beta_init: float = _DEFAULT.dcp_beta_init
    castle_window: int | None = _DEFAULT.castle_window
    castle_fold_every: int | None = _DEFAULT.castle_fold_every
    init_std: float = _DEFAULT.init_std
    attn_backend: str = _DEFAULT.attn_backend
    use_cache: bool = True
    tie_word_embeddings: bool = False  # the output head is untied (SPEC section 2)
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        model_config = self.to_model_config()  # ModelConfig's checks, with its error messages
        self.attention, self.block, self.arch = model_config.attention, model_config.block, None
        self.castle_window = model_config.castle_window

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs) -> LapseConfig:
        """A ``LapseConfig`` with ``config``'s fields; ``kwargs`` set ``transformers``
        fields (``eos_token_id``, ...)."""
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a lapse ModelConfig, got {type(config).__name__}")
        return cls(**asdict(config), **kwargs)

    def to_model_config(self) -> ModelConfig:
        """The :class:`~lapse.models.ModelConfig` these fields describe (validated; as a saved
        run's, so exports written before a check was added still load)."""
        return model_config_from_json({f.name: getattr(self, f.name) for f in fields(ModelConfig)})


class LapseForCausalLM(PreTrainedModel, GenerationMixin):
    """A lapse :class:`~lapse.models.Decoder` (any attention and block kind) as a
    ``transformers`` causal LM: ``forward``, ``generate``, ``save_pretrained`` /
    ``from_pretrained`` (safetensors). The decoder is ``self.model``; its state-dict keys
    are the decoder's with the prefix ``model.``."""

    config_class = LapseConfig
    _no_split_modules = ["Block"]
    _skip_keys_device_placement = list(CACHE_NAMES)  # the forward takes the cache under either name
    # The lapse cache is not a transformers Cache: the forward makes it (see the module doc).
    _is_stateful = True  # refuses assisted generation, which would need to crop the cache

    def __init__(self, config: LapseConfig):
        super().__init__(config)
        self.model = Decoder(config.to_model_config())
        self.post_init()

    @classmethod
    def from_decoder(cls, decoder: Decoder) -> LapseForCausalLM:
        """The adapter around a copy of ``decoder``'s weights (e.g. a trained checkpoint:
        ``lapse export RUN OUT`` writes it with ``save_pretrained``)."""
        hf = cls(LapseConfig.from_model_config(decoder.config))
        hf.model.load_state_dict(decoder.state_dict())
        return hf.to(next(decoder.parameters()).dtype)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _init_weights(self, module: nn.Module) -> None:
        """SPEC section 2: Linear and embedding weights ~ N(0, init_std), biases 0, norm
        gains 1 (:func:`lapse.models.init_weights`, in the form ``transformers`` calls it
        module by module, skipping weights loaded from a checkpoint)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=self.config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            init.zeros_(module.bias)
        if isinstance(module, RMSNorm):
            init.ones_(module.weight)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.lm_head = value

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: LapseCache | EvictingCache | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: LapseCache | EvictingCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """Logits ``[B, T, V]`` for ``input_ids`` ``[B, T]``, continuing ``cache``.

        Args:
            input_ids: ``[B, T]`` token ids (required: ``inputs_embeds`` is not supported).
            attention_mask: optional ``[B, past + T]``; zeros mark padding (left or right,
                see the module doc).
            cache: a :class:`~lapse.hf.LapseCache` from an earlier call, which this call
                appends to; ``None`` starts a new one when ``use_cache``; or an
                :class:`~lapse.hf.EvictingCache` (a paged store under an eviction policy).
            labels: ``[B, T]`` unshifted targets (``labels[:, t + 1]`` is the target of
                position ``t``), ``-100`` left out: the mean cross-entropy is ``loss``.
            use_cache: return the cache, as the output's ``cache`` (transformers >= 5.24;
                ``past_key_values`` before: :func:`lapse.hf.compat.output_cache` reads
                either), ``config.use_cache`` by default.
            return_dict: ``False`` returns a tuple.
            past_key_values: ``cache`` under its name before transformers 5.24 (what
                ``generate`` passes there); giving both as two different caches raises
                ``ValueError``.
            kwargs: other ``generate`` inputs, ignored.
        """
        if input_ids is None:
            raise ValueError("LapseForCausalLM needs input_ids (inputs_embeds is not supported)")
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("LapseForCausalLM does not take inputs_embeds; pass input_ids")
        cache = either_cache(cache, past_key_values)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is None and use_cache:
            cache = LapseCache(self.config.n_layers)
        evicting = isinstance(cache, EvictingCache)
        fresh = cache is None or cache.get_seq_length() == 0
        start, lengths = padding_runs(attention_mask, input_ids.shape[1], fresh)
        shifted = None
        if labels is not None:
            shifted = F.pad(labels[:, 1:], (0, 1), value=-100)  # [B, T]: the target of every position
        if start is not None:  # padded rows, their tokens first (a ragged batch)
            input_ids = roll_rows(input_ids, start)
            shifted = None if shifted is None else roll_rows(shifted, start)
            if shifted is not None:  # the targets of padding positions are left out
                shifted = shifted.masked_fill(
                    torch.arange(shifted.shape[1], device=shifted.device) >= lengths[:, None], -100
                )
        store = cache
        if evicting:  # its paged store, evicted on the policy's schedule before this forward
            store = cache.lapse_store(self, *input_ids.shape)
        logits, loss = self.model(input_ids, shifted, cache=store, lengths=lengths)  # [B, T, V]
        if evicting:
            cache.end_forward(input_ids.shape[1])
        if start is not None:
            logits = roll_rows(logits, -start)  # back where the tokens were
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_ARG: cache if use_cache else None})
        return out if return_dict is not False else out.to_tuple()

    def prepare_inputs_for_generation(
        self, input_ids: Tensor, *args, cache=None, past_key_values=None, **kwargs
    ) -> dict:
        """``transformers``' own preparation (it slices ``input_ids`` to the new tokens when
        a cache is passed), after checking that a given cache (under either name, see
        :meth:`forward`) is a lapse one; it gets the cache under the installed name."""
        cache = either_cache(cache, past_key_values)
        if cache is not None and not isinstance(cache, (LapseCache, EvictingCache)):
            raise TypeError(
                f"the cache ({CACHE_ARG}=) must be a lapse.hf.LapseCache or EvictingCache, got "
                f"{type(cache).__name__}"
            )
        return super().prepare_inputs_for_generation(input_ids, *args, **{CACHE_ARG: cache}, **kwargs)


def register() -> None:
    """Lets ``AutoConfig`` / ``AutoModelForCausalLM`` load ``model_type: "lapse"`` folders
    (``import lapse.hf`` calls it; idempotent)."""
    AutoConfig.register(LapseConfig.model_type, LapseConfig, exist_ok=True)
    AutoModelForCausalLM.register(LapseConfig, LapseForCausalLM, exist_ok=True)
