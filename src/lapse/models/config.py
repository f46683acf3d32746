"""The typed configuration of the decoder language models, and named presets.

SPEC section 2. One :class:`ModelConfig` describes all four architectures the FoX paper
compares, and CASTLE's (SPEC section 5); the presets are functions that derive from each
other (``360m`` is ``125m`` made wider and deeper, ``tiny`` is ``small`` made smaller),
and :func:`preset` looks one up by name and applies field overrides (what the CLI does).

Sizes. The nominal sizes (125M, 360M, 760M) match :func:`lapse.models.param_count` with
``non_embedding=True`` (every parameter except the input embedding table, which is a
lookup and costs no FLOPs; the untied output head is counted) at the GPT-2-sized
vocabulary of those presets (50,304): 123.6-124.0M, 359.8-367.4M and 756.8-759.6M over
the four architectures (the Pro MLP rounds up to a slightly larger width at 360M).

CASTLE at matched parameters. A CASTLE head has 7 ``d_model x D`` matrices against 4 for
a softmax head (``CastleAttention.matrices_per_head``), so the aliases ``castle`` and
``castle-swl`` keep the head dim and give ``round(4/7 n_heads)`` heads (at least 1; SPEC
section 5: 14 -> 8, 16 -> 9; here 12 -> 7, 16 -> 9, 24 -> 14, 8 -> 5, 4 -> 2), which puts
``preset(name, "castle")`` within 4% of ``preset(name, "transformer-llama")`` in
non-embedding parameters at every preset (tests/models/test_castle_model.py). The heads
then no longer tile ``d_model``: ``attn_head_dim`` holds the head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Literal, get_args

from .kinds import ATTENTION_TRAITS, BLOCK_KINDS, attention_traits

AttentionKind = Literal["softmax", "forgetting", "dcp", "castle"]
BlockKindName = Literal["llama", "pro"]
FoxArch = Literal["fox-llama", "fox-pro", "transformer-llama", "transformer-pro"]
CastleArch = Literal["castle", "castle-swl"]
Arch = Literal[FoxArch, CastleArch]
AttentionBackend = Literal["auto", "triton", "torch", "naive"]

ARCHS: tuple[str, ...] = get_args(FoxArch)
"""The four architectures of the FoX paper (what the kind-generic tests run over)."""
CASTLE_ARCHS: tuple[str, ...] = get_args(CastleArch)
"""CASTLE and CASTLE-SWL (SPEC section 5): the LLaMA block, 4/7 of the heads."""
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
ARCH_ALIASES: dict[str, tuple[str, str]] = {
    "fox-llama": ("forgetting", "llama"),
    "fox-pro": ("forgetting", "pro"),
    "transformer-llama": ("softmax", "llama"),
    "transformer-pro": ("softmax", "pro"),
    "castle": ("castle", "llama"),
    "castle-swl": ("castle", "llama"),
}
"""Every architecture name as (attention kind, block kind)."""
WINDOWED_ARCHS: tuple[str, ...] = ("castle-swl",)
"""Aliases that also set ``castle_window`` (when unset) to :func:`default_castle_window`."""


def default_castle_window(d_model: int) -> int:
    """CASTLE-SWL's window for a model of width ``d_model``: the paper's 128 at S (896
    wide) and 512 at M, L and XL (1024 and wider), so 128 below 1024 and 512 from it."""
    return 128 if d_model < 1024 else 512

assert set(get_args(AttentionKind)) == set(ATTENTION_TRAITS)
assert set(get_args(BlockKindName)) == set(BLOCK_KINDS)


@dataclass(kw_only=True)
class ModelConfig:
    """A decoder-only language model: an attention kind in a block kind (SPEC section 2)."""

    attention: AttentionKind = "forgetting"
    """``forgetting``: forgetting attention (FoX), no positional encoding; ``softmax``:
    softmax attention with RoPE (the Transformer); ``dcp``: softmax attention with RoPE under
    Dynamic Context Pruning's learned keep mask (SPEC section 6; ``dcp_r``, ``dcp_beta_init``),
    usually fine-tuned from a softmax checkpoint (``lapse train --init-from``); ``castle``:
    causal attention with lookahead keys and RoPE (SPEC section 5; ``castle_window``)."""

    block: BlockKindName = "pro"
    """``llama``: the LLaMA block; ``pro``: plus KV-shift, QK-norm, output norm and output gate."""

    arch: Arch | None = None
    """An alias that sets ``attention`` and ``block`` together: ``fox-llama``, ``fox-pro``,
    ``transformer-llama``, ``transformer-pro``, ``castle``, ``castle-swl`` (it wins over
    them, then reads ``None``; ``name`` gives the alias of a config). Configs written
    before the two fields existed hold only this. ``castle`` and ``castle-swl`` also match
    parameters: ``n_heads`` is read as the Transformer's, and the model gets
    ``round(4/7 n_heads)`` heads of the same head dim (``attn_head_dim``; see the module
    doc); ``castle-swl`` sets ``castle_window`` to ``default_castle_window`` when unset."""

    vocab_size: int = 50304
    """Rows of the embedding and of the (untied) output head. Trainers set it from the
    tokenizer; 50,304 (GPT-2's 50,257 rounded up to a multiple of 64) gives the nominal
    preset sizes."""

    d_model: int = 768
    """Width of the residual stream."""

    n_layers: int = 12
    """Number of decoder blocks."""

    n_heads: int = 12
    """Query heads per attention layer; must divide ``d_model`` (head dim = d_model / n_heads)
    unless ``attn_head_dim`` is set."""

    attn_head_dim: int | None = None
    """Channels per attention head when the heads do not tile ``d_model`` (the layer's
    inner width is then ``n_heads * attn_head_dim``); ``None``: ``d_model / n_heads``.
    Parameter-matched CASTLE sets it (the ``castle`` aliases). Read ``head_dim``."""

    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); must divide ``n_heads``. ``None``: as
    many as ``n_heads`` (plain multi-head attention). Read ``kv_heads`` for the value."""

    mlp_ratio: float | None = None
    """SwiGLU size as a multiple of ``d_model`` counted the LLaMA way: the hidden width is
    ``2/3 * mlp_ratio * d_model`` rounded up to ``mlp_multiple_of``, so the MLP has about
    ``3 * 2/3 * mlp_ratio = 2 * mlp_ratio`` times ``d_model^2`` weights. ``None``: 4 for
    the ``llama`` block and 3.5 for ``pro`` (SPEC section 2; the smaller MLP pays for the
    output gate, so the two have the same size). Read ``mlp_hidden`` for the width."""

    mlp_multiple_of: int = 256
    """The SwiGLU hidden width is rounded up to a multiple of this (matmul-friendly sizes)."""

    mlp_hidden_size: int | None = None
    """The SwiGLU hidden width given outright, for weights made elsewhere (``lapse import``
    takes a pretrained model's ``intermediate_size``); ``None``: from ``mlp_ratio`` and
    ``mlp_multiple_of``. Read ``mlp_hidden`` for the width."""

    rope_base: float = 500000.0
    """RoPE base (theta) of the Transformer architectures; unused by FoX."""

    norm_eps: float = 1e-6
    """Epsilon of the block RMSNorms, the final norm and the per-head output norm."""

    qk_norm_eps: float = 1e-5
    """Epsilon of the per-head QK-norm (``*-pro``)."""

    acp: bool = False
    """Adaptive Computation Pruning in the FoX layers (SPEC section 3). The bound ``U``
    comes from the QK-norm gains for ``fox-pro`` (no pass over the data) and from the
    largest query and key norms for ``fox-llama`` (one extra pass)."""

    acp_eps: float = math.exp(-10)
    """ACP tolerance: the attention mass pruned from any row is below this."""

    max_seq_len: int = 16384
    """Training context length (the FoX paper's 16k). The model does not enforce it
    (FoX has no positional table and RoPE is computed on the fly); FLOP estimates and
    trainers use it as their default."""

    dcp_r: int = 64
    """DCP: width of the interaction projections ``W_Qint, W_Kint: d_model -> r`` of each
    layer (``attention="dcp"`` only)."""

    dcp_beta_init: float = 2.0
    """DCP: initial value of each layer's scalar offset ``beta`` of the interaction logits
    (``z = q_int . k_int / sqrt(r) + beta``; positive: keep at first)."""

    castle_window: int | None = None
    """CASTLE: the lookahead window ``W`` of CASTLE-SWL (``u^t_s`` sums the tokens ``s <
    j <= min(t, s + W)``), ``None`` for CASTLE without a window (``attention="castle"`` only)."""

    castle_fold_every: int | None = None
    """CASTLE decoding: ``None`` (each step adds the new token into every held ``u_s``) or
    ``M >= 1``, the deferred update that writes ``u`` back every ``M`` steps
    (``lapse.layers.CastleAttention``'s ``fold_every``; same outputs up to float32
    summation order). Slower on an H100 (197-324 against 112 us per layer at 8 x 4096,
    M = 4-16, ``ops/castle/README.md``), so off by default."""

    init_std: float = 0.02
    """Standard deviation of the normal init of every Linear and embedding weight."""

    attn_backend: AttentionBackend = "auto"
    """Backend of ``lapse.ops.forgetting_attention`` in the forgetting layers and of
    ``lapse.ops.castle.castle_attention`` in the CASTLE layers (``auto``: Triton on
    CUDA, the chunked PyTorch path otherwise). Softmax layers always use
    ``torch.nn.functional.scaled_dot_product_attention``."""

    def __post_init__(self) -> None:
        given_head_dim = self.attn_head_dim is not None  # (an alias's matched heads set it too)
        if self.arch is not None:
            if self.arch not in ARCH_ALIASES:
                raise ValueError(f"arch must be one of {ARCHS} (or None), got {self.arch!r}")
            self.attention, self.block = ARCH_ALIASES[self.arch]
            if self.arch in WINDOWED_ARCHS and self.castle_window is None:
                self.castle_window = default_castle_window(self.d_model)
            self._match_heads()
            self.arch = None
        kind = attention_traits(self.attention)
        if self.block not in BLOCK_KINDS:
            raise ValueError(f"block must be one of {tuple(BLOCK_KINDS)}, got {self.block!r}")
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attn_backend must be one of {ATTENTION_BACKENDS}, got {self.attn_backend!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.attn_head_dim is not None:
            if not _is_count(self.attn_head_dim):
                raise ValueError(
                    f"attn_head_dim must be a positive integer or None, got {self.attn_head_dim!r}"
                )
        elif self.d_model % self.n_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must divide d_model ({self.d_model}): the head dim is "
                "d_model / n_heads"
            )
        if self.n_kv_heads is not None:
            if not isinstance(self.n_kv_heads, int) or self.n_kv_heads < 1:
                raise ValueError(f"n_kv_heads must be a positive integer or None, got {self.n_kv_heads!r}")
            if self.n_heads % self.n_kv_heads != 0:
                raise ValueError(
                    f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}) "
                    "(grouped-query attention)"
                )
        where = "attn_head_dim" if given_head_dim else "d_model / n_heads"
        if self.head_dim > 256:
            fix = "a smaller attn_head_dim" if given_head_dim else "more heads"
            raise ValueError(
                f"head dim {where} = {self.head_dim} is above 256, the largest the attention kernels "
                f"take; use {fix}"
            )
        if self.head_dim % 2 != 0 and kind.needs_even_head_dim:
            raise ValueError(f"RoPE needs an even head dim, got {where} = {self.head_dim}")
        if self.mlp_ratio is not None and not (self.mlp_ratio > 0 and math.isfinite(self.mlp_ratio)):
            raise ValueError(f"mlp_ratio must be a positive number or None, got {self.mlp_ratio!r}")
        if self.mlp_hidden_size is not None and not _is_count(self.mlp_hidden_size):
            raise ValueError(
                f"mlp_hidden_size must be a positive integer or None, got {self.mlp_hidden_size!r}"
            )
        for name in ("norm_eps", "qk_norm_eps", "acp_eps"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value!r}")
        if not self.rope_base > 1:
            raise ValueError(f"rope_base must be greater than 1, got {self.rope_base!r}")
        if not isinstance(self.dcp_r, int) or isinstance(self.dcp_r, bool) or self.dcp_r < 1:
            raise ValueError(
                f"dcp_r (the DCP interaction dim) must be a positive integer, got {self.dcp_r!r}"
            )
        if not math.isfinite(self.dcp_beta_init):
            raise ValueError(f"dcp_beta_init must be a finite number, got {self.dcp_beta_init!r}")
        if self.castle_window is not None and not _is_count(self.castle_window):
            raise ValueError(
                f"castle_window (CASTLE-SWL's lookahead window) must be a positive integer or None, "
                f"got {self.castle_window!r}"
            )
        if self.castle_window is not None and self.attention != "castle":
            raise ValueError(
                f"castle_window is CASTLE-SWL's lookahead window; {self.attention} attention has none: "
                "leave it unset (--model.castle-window)"
            )
        if self.castle_fold_every is not None and not _is_count(self.castle_fold_every):
            raise ValueError(
                f"castle_fold_every must be a positive integer or None, got {self.castle_fold_every!r}"
            )
        if not self.init_std > 0:
            raise ValueError(f"init_std must be positive, got {self.init_std!r}")
        if self.acp and not kind.supports_acp:
            raise ValueError(
                f"acp=True needs a forget gate (attention kind forgetting); "
                f"{self.attention} attention has none to prune with: turn ACP off (--model.no-acp)"
            )

    def _match_heads(self) -> None:
        """What an alias does to the heads: a kind with ``m`` weight matrices per head
        (``matrices_per_head``, 4 for softmax attention) gets ``round(4/m n_heads)`` heads
        (at least 1) of the same head dim, so it has about the parameters of the
        Transformer with ``n_heads``; ``n_kv_heads`` stays as given."""
        per_head = attention_traits(self.attention).matrices_per_head
        if per_head == 4 or not (_is_count(self.n_heads) and _is_count(self.d_model)):
            return  # (bad sizes: the checks below say so)
        if self.attn_head_dim is None and self.d_model % self.n_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must divide d_model ({self.d_model}): {self.arch} keeps "
                "the head dim d_model / n_heads of the Transformer it matches"
            )
        self.attn_head_dim = self.head_dim
        self.n_heads = max(1, round(self.n_heads * 4 / per_head))

    @property
    def name(self) -> str:
        """The architecture's name: its alias (``fox-pro``, ``castle-swl``, ...) or
        ``<attention>-<block>``."""
        for alias, kinds in ARCH_ALIASES.items():
            if kinds == (self.attention, self.block) and (alias in WINDOWED_ARCHS) == (
                self.castle_window is not None
            ):
                return alias
        return f"{self.attention}-{self.block}"

    @property
    def head_dim(self) -> int:
        """Channels per attention head: ``attn_head_dim``, else ``d_model / n_heads``."""
        return self.d_model // self.n_heads if self.attn_head_dim is None else self.attn_head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def mlp_hidden(self) -> int:
        """SwiGLU hidden width: ``mlp_hidden_size`` when set, else ``2/3 * ratio * d_model``
        rounded up to ``mlp_multiple_of``."""
        if self.mlp_hidden_size is not None:
            return self.mlp_hidden_size
        ratio = self.mlp_ratio if self.mlp_ratio is not None else BLOCK_KINDS[self.block].mlp_ratio
        hidden = int(2 * ratio * self.d_model / 3)
        return self.mlp_multiple_of * -(-hidden // self.mlp_multiple_of)


def _is_count(value: object) -> bool:
    """A positive int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def preset_125m(arch: Arch = "fox-pro") -> ModelConfig:
    """12 layers x 768, 12 heads of 64 (SPEC section 2; CASTLE: 7)."""
    return ModelConfig(arch=arch, d_model=768, n_layers=12, n_heads=12)


# The presets derive from each other on the FoX (Pro) shape and apply ``arch`` last: an
# alias reads the shape it is given (CASTLE's 4/7 heads, CASTLE-SWL's window by width).


def preset_360m(arch: Arch = "fox-pro") -> ModelConfig:
    """24 layers x 1024, 16 heads of 64 (CASTLE: 9)."""
    return replace(preset_125m(), arch=arch, d_model=1024, n_layers=24, n_heads=16)


def preset_760m(arch: Arch = "fox-pro") -> ModelConfig:
    """24 layers x 1536, 24 heads of 64 (CASTLE: 14)."""
    return replace(preset_360m(), arch=arch, d_model=1536, n_heads=24)


def preset_gpu_20m(arch: Arch = "fox-pro") -> ModelConfig:
    """5 layers x 512, 8 heads of 64 (CASTLE: 5), context 2048, vocabulary 8192 (a locally
    trained BPE): about 21M parameters without the embedding, for quick runs on one GPU."""
    return replace(
        preset_125m(), arch=arch, d_model=512, n_layers=5, n_heads=8, vocab_size=8192, max_seq_len=2048
    )


def preset_small(arch: Arch = "fox-pro") -> ModelConfig:
    """4 layers x 256, 4 heads of 64 (CASTLE: 2), context 512, vocabulary 512 (room for the
    byte-level tokenizer's 256 + specials): a few minutes of training on a laptop CPU."""
    return replace(
        preset_gpu_20m(), arch=arch, d_model=256, n_layers=4, n_heads=4, vocab_size=512,
        max_seq_len=512, mlp_multiple_of=64,
    )


def preset_tiny(arch: Arch = "fox-pro") -> ModelConfig:
    """2 layers x 64, 4 heads of 16 (CASTLE: 2), vocabulary 128: for tests."""
    return replace(
        preset_small(), arch=arch, d_model=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=256
    )


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "tiny": preset_tiny,
    "small": preset_small,
    "gpu-20m": preset_gpu_20m,
    "125m": preset_125m,
    "360m": preset_360m,
    "760m": preset_760m,
}


def preset(name: str, arch: Arch = "fox-pro", **overrides) -> ModelConfig:
    """The preset ``name`` for architecture ``arch``, with fields replaced by ``overrides``.

    Raises ``ValueError`` naming the valid presets (or fields) on an unknown name; the
    overridden config is validated again.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    valid = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown}; valid fields: {', '.join(sorted(valid))}")
    return replace(PRESETS[name](arch), **overrides)
