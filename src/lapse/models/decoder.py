"""Decoder-only language models: FoX and Transformer, LLaMA and Pro blocks (SPEC section 2).

One file, read top-down: the pieces (RMSNorm, SwiGLU, RoPE, KV-shift), the attention
layer, the block, the model, then small named functions for init, parameter count,
optimizer groups and FLOPs. Every forward mirrors SPEC section 2; a comment names the
equation where it is not obvious.

Shapes: a trailing comment on each line that makes a new shape. Legend: B batch, T time,
C d_model, H query heads, K key/value heads, D head dim, F SwiGLU hidden width, V vocab.

Layers take whole sequences; incremental decoding will add an optional per-layer state
(the keys and values, ``c_j`` for FoX, the previous pre-shift projections for KV-shift:
:func:`kv_shift` already takes the last one as ``prev``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lapse.ops import AttentionStats, forgetting_attention

from .config import ModelConfig


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float32 for half-precision inputs, the input's own dtype for float32/float64."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed in float32.

    ``shape`` is the weight's shape: ``(C,)`` for the block norms, ``(H, D)`` for the
    per-head norms (QK-norm, output norm), which normalise each head's ``D`` channels
    with that head's own per-channel gains.
    """

    def __init__(self, shape: int | tuple[int, ...], eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shape))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(_compute_dtype(x))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)


class SwiGLU(nn.Module):
    """``W_down (silu(W_gate x) * W_up x)``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(config.d_model, config.mlp_hidden, bias=False)
        self.w_up = nn.Linear(config.d_model, config.mlp_hidden, bias=False)
        self.w_down = nn.Linear(config.mlp_hidden, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))  # [B, T, F] -> [B, T, C]


def rope(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotary position embedding, the rotate-half convention (LLaMA in Hugging Face, fla).

    Channel ``i < D/2`` is paired with channel ``i + D/2`` and the pair is rotated by the
    angle ``position * base^(-2i/D)``. x: ``[B, T, H, D]``; positions: ``[T]``.
    """
    d = x.shape[-1]
    dtype = _compute_dtype(x)
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=dtype) / d)  # [D/2]
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = angles.cos()[None, :, None, :]  # [1, T, 1, D/2]
    sin = angles.sin()[None, :, None, :]
    x1, x2 = x.to(dtype).chunk(2, dim=-1)  # [B, T, H, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def kv_shift(x: Tensor, alpha: Tensor, prev: Tensor | None = None) -> Tensor:
    """KV-shift: ``y_t = alpha_t * x_{t-1} + (1 - alpha_t) * x_t`` per head (SPEC section 2).

    x: ``[B, T, K, D]`` the pre-shift projections; alpha: ``[B, T, K]`` in (0, 1);
    prev: ``[B, 1, K, D]`` the projection before the first token (zeros when ``None``:
    ``x_0 = 0`` at the start of a sequence; a decoding cache passes the last one).
    """
    if prev is None:
        prev = torch.zeros_like(x[:, :1])
    x_prev = torch.cat([prev, x[:, :-1]], dim=1)  # [B, T, K, D]
    a = alpha[..., None]  # [B, T, K, 1]
    return (a * x_prev + (1 - a) * x).to(x.dtype)


class Attention(nn.Module):
    """One attention layer of any of the four architectures.

    FoX: forget gate ``log f_t = logsigmoid(W_f x_t + b_f)`` per head, no RoPE,
    :func:`lapse.ops.forgetting_attention`. Transformer: RoPE on q and k, causal SDPA.
    Pro adds KV-shift (keys and values separately), QK-norm and the output norm and gate
    ``out = W_o [RMSNorm_head(o) * sigmoid(W_g x)]``.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        c, h, k, d = config.d_model, config.n_heads, config.kv_heads, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, k, d
        self.scale = 1.0 / math.sqrt(d)
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, k * d, bias=False)
        self.v_proj = nn.Linear(c, k * d, bias=False)
        self.o_proj = nn.Linear(h * d, c, bias=False)
        if config.forget_gate:
            self.fgate = nn.Linear(c, h, bias=True)
        if config.pro:
            self.k_shift = nn.Linear(c, k, bias=False)  # alpha_t = sigmoid(w_shift . x_t), no bias
            self.v_shift = nn.Linear(c, k, bias=False)
            self.q_norm = RMSNorm((h, d), config.qk_norm_eps)
            self.k_norm = RMSNorm((k, d), config.qk_norm_eps)
            self.o_norm = RMSNorm((h, d), config.norm_eps)
            self.o_gate = nn.Linear(c, h * d, bias=False)  # W_g, full width
        # ACP statistics of the last forward, kept when collect_stats is set (FoX only)
        self.collect_stats = False
        self.last_stats: AttentionStats | None = None

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h, k, d = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(b, t, h, d)  # [B, T, H, D]
        key = self.k_proj(x).view(b, t, k, d)  # [B, T, K, D]
        val = self.v_proj(x).view(b, t, k, d)  # [B, T, K, D]
        if self.config.pro:
            key = kv_shift(key, torch.sigmoid(self.k_shift(x).to(_compute_dtype(x))))
            val = kv_shift(val, torch.sigmoid(self.v_shift(x).to(_compute_dtype(x))))
            q, key = self.q_norm(q), self.k_norm(key)  # QK-norm on q and the shifted k
        if self.config.forget_gate:
            o = self._forgetting_attention(x, q, key, val)  # [B, T, H, D]
        else:
            positions = torch.arange(t, device=x.device)
            q = rope(q, positions, self.config.rope_base)
            key = rope(key, positions, self.config.rope_base)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), key.transpose(1, 2), val.transpose(1, 2),
                is_causal=True, scale=self.scale, enable_gqa=h != k,
            ).transpose(1, 2)  # [B, T, H, D]
        if self.config.pro:
            o = self.o_norm(o).reshape(b, t, h * d) * torch.sigmoid(self.o_gate(x))  # [B, T, H*D]
        else:
            o = o.reshape(b, t, h * d)  # [B, T, H*D]
        return self.o_proj(o)  # [B, T, C]

    def _forgetting_attention(self, x: Tensor, q: Tensor, key: Tensor, val: Tensor) -> Tensor:
        # log gates in float32 (SPEC section 1), float64 when the model runs in float64
        log_fgate = F.logsigmoid(self.fgate(x).to(_compute_dtype(x)))  # [B, T, H]
        out = forgetting_attention(
            q, key, val, log_fgate,
            scale=self.scale,
            acp=self.acp_bound(),
            acp_eps=self.config.acp_eps,
            return_stats=self.collect_stats,
            backend=self.config.attn_backend,
        )
        if not self.collect_stats:
            return out
        o, stats = out
        self.last_stats = stats
        return o

    @torch.no_grad()
    def acp_bound(self) -> Tensor | str | None:
        """The ACP bound ``U >= max |scale q.k|`` per query head (SPEC section 3).

        Pro: from the QK-norm gains, ``U_h = max|g_q,h| * max|g_k,h| * D * scale``; an
        RMS-normalised vector with gains g has norm at most ``max|g| sqrt(D)``, so no
        pass over the data is needed. LLaMA (no QK-norm): ``"auto"``, the op takes the
        largest query and key norms. ``None`` when ACP is off.
        """
        if not self.config.acp:
            return None
        if not self.config.pro:
            return "auto"
        g_q = self.q_norm.weight.abs().amax(-1).float()  # [H]
        g_k = self.k_norm.weight.abs().amax(-1).float()  # [K]
        g_k = g_k.repeat_interleave(self.n_heads // self.n_kv_heads)  # [H]
        return g_q * g_k * self.head_dim * self.scale  # [H]


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """The language model: embedding, ``n_layers`` blocks, final RMSNorm, untied head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self, config.init_std)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits and, with ``labels``, the mean cross-entropy.

        Args:
            input_ids: ``[B, T]`` integer token ids.
            labels: ``[B, T]`` the target of every position, already shifted (the token
                that follows ``input_ids[:, t]``); ``-100`` marks positions left out of
                the loss.

        Returns:
            ``(logits, loss)``: logits ``[B, T, V]`` in the model's dtype, loss a float32
            scalar (``None`` without labels).
        """
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            if isinstance(input_ids, Tensor):
                got = f"shape {tuple(input_ids.shape)}, dtype {input_ids.dtype}"
            else:
                got = type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer tensor [batch, time], got {got}")
        if labels is not None and tuple(labels.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}"
            )
        x = self.embed(input_ids)  # [B, T, C]
        for block in self.blocks:
            x = block(x)  # [B, T, C]
        logits = self.lm_head(self.norm(x))  # [B, T, V]
        if labels is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return logits, loss

    def set_collect_stats(self, enabled: bool) -> None:
        """Keep each FoX layer's ACP statistics of the next forwards in ``attn.last_stats``."""
        for block in self.blocks:
            block.attn.collect_stats = enabled
            block.attn.last_stats = None

    def pruned_fractions(self) -> Tensor | None:
        """ACP pruned fraction of the last forward per layer and head, averaged over the
        batch: ``[n_layers, H]`` float32, or ``None`` where no statistics were collected."""
        stats = [block.attn.last_stats for block in self.blocks]
        if any(s is None for s in stats):
            return None
        return torch.stack([s.pruned_fraction.float().mean(0) for s in stats])  # [n_layers, H]


def init_weights(model: nn.Module, std: float) -> None:
    """Every Linear and embedding weight ~ N(0, std), biases 0, norm gains 1 (SPEC section 2)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


def param_count(model: nn.Module, non_embedding: bool = True) -> int:
    """Number of parameters; ``non_embedding`` leaves out the input embedding table.

    The embedding is a lookup that costs no FLOPs; the untied output head is a matmul and
    is counted, so ``6 * param_count(model)`` is the training FLOPs per token outside
    attention. The presets' nominal sizes follow this count (see :mod:`.config`).
    """
    total = sum(p.numel() for p in model.parameters())
    if non_embedding and isinstance(model, Decoder):
        total -= model.embed.weight.numel()
    return total


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: decay on Linear and embedding weights; none on norm gains
    and biases (SPEC section 2). A parameter shared by several modules appears once."""
    decay: dict[int, nn.Parameter] = {}
    no_decay: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, RMSNorm) or name == "bias":
                no_decay[id(p)] = p
            else:
                decay[id(p)] = p
    return [
        {"params": list(decay.values()), "weight_decay": weight_decay},
        {"params": [p for i, p in no_decay.items() if i not in decay], "weight_decay": 0.0},
    ]


def flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) for MFU, attention counted as dense.

    ``6 N`` for the matmuls (``N`` = :func:`param_count` with ``non_embedding``) plus the
    attention scores and values: ``QK^T`` and ``PV`` cost ``2 * 2 * T * H * D`` per token
    and layer for full attention, half of it causal, times 3 for forward and backward:
    ``6 * n_layers * H * D * T``. ACP's skipped tiles are counted as done, so MFU compares
    runs with and without pruning on the same work. ``seq_len`` defaults to ``max_seq_len``.
    """
    t = config.max_seq_len if seq_len is None else seq_len
    with torch.device("meta"):
        n = param_count(Decoder(config), non_embedding=True)
    attention = 6 * config.n_layers * config.n_heads * config.head_dim * t
    return float(6 * n + attention)
