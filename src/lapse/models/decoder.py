"""Decoder-only language models: FoX and Transformer, LLaMA and Pro blocks (SPEC section 2).

One file, read top-down: the pieces (RMSNorm, SwiGLU, RoPE, KV-shift), the attention
layer, the block, the model, then small named functions for init, parameter count,
optimizer groups and FLOPs. Every forward mirrors SPEC section 2; a comment names the
equation where it is not obvious.

Shapes: a trailing comment on each line that makes a new shape. Legend: B batch, T time,
C d_model, H query heads, K key/value heads, D head dim, F SwiGLU hidden width, V vocab.

Incremental decoding: every layer takes an optional :class:`~lapse.generation.LayerCache`
(``Decoder.forward(..., cache=DenseCache(...))``). A call with a cache appends its tokens'
keys and values (and ``c_j`` for FoX, the last pre-shift projections for KV-shift) and
attends to everything cached: a first call (prefill) runs the same attention as without
a cache, one new token runs the decode op, a chunk of several tokens after a prefix runs
a plain masked attention with the queries aligned to the end of the keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lapse.generation.cache import DenseCache, LayerCache
from lapse.ops import AttentionStats, forgetting_attention
from lapse.ops.forgetting import LOG_GATE_FLOOR, forgetting_attention_decode

from .config import ModelConfig


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float32 for half-precision inputs, the input's own dtype for float32/float64."""
    return torch.promote_types(x.dtype, torch.float32)


def _causal_mask(tq: int, tk: int, device: torch.device) -> Tensor:
    """``[Tq, Tk]`` bool, True where query ``i`` (at key position ``i + Tk - Tq``) may read key ``j``."""
    rows = torch.arange(tq, device=device)[:, None] + (tk - tq)
    return torch.arange(tk, device=device)[None, :] <= rows


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

    def forward(self, x: Tensor, cache: LayerCache | None = None) -> Tensor:
        b, t, _ = x.shape
        h, k, d = self.n_heads, self.n_kv_heads, self.head_dim
        past = 0 if cache is None else cache.length  # positions before x's first token
        q = self.q_proj(x).view(b, t, h, d)  # [B, T, H, D]
        key = self.k_proj(x).view(b, t, k, d)  # [B, T, K, D]
        val = self.v_proj(x).view(b, t, k, d)  # [B, T, K, D]
        if self.config.pro:
            # KV-shift continues from the cached last pre-shift projections (x_0 = 0 at the start)
            k_prev, v_prev = (cache.k_prev, cache.v_prev) if past else (None, None)
            if cache is not None:
                cache.k_prev, cache.v_prev = key[:, -1:].clone(), val[:, -1:].clone()  # [B, 1, K, D]
            key = kv_shift(key, torch.sigmoid(self.k_shift(x).to(_compute_dtype(x))), k_prev)
            val = kv_shift(val, torch.sigmoid(self.v_shift(x).to(_compute_dtype(x))), v_prev)
            q, key = self.q_norm(q), self.k_norm(key)  # QK-norm on q and the shifted k
        if self.config.forget_gate:
            # log gates in float32 (SPEC section 1), float64 when the model runs in float64
            log_fgate = F.logsigmoid(self.fgate(x).to(_compute_dtype(x)))  # [B, T, H]
            if cache is None or past == 0:
                o = self._forgetting_attention(q, key, val, log_fgate)  # [B, T, H, D]
                if cache is not None:
                    cache.append(key, val, self._cumulative_log_gates(log_fgate, None))
            else:
                cache.append(key, val, self._cumulative_log_gates(log_fgate, cache.c_last))
                o = self._cached_forgetting_attention(q, cache)  # [B, T, H, D]
        else:
            positions = torch.arange(past, past + t, device=x.device)
            q = rope(q, positions, self.config.rope_base)
            key = rope(key, positions, self.config.rope_base)
            if cache is not None:
                cache.append(key, val)
            o = self._softmax_attention(q, key, val, cache)  # [B, T, H, D]
        if self.config.pro:
            o = self.o_norm(o).reshape(b, t, h * d) * torch.sigmoid(self.o_gate(x))  # [B, T, H*D]
        else:
            o = o.reshape(b, t, h * d)  # [B, T, H*D]
        return self.o_proj(o)  # [B, T, C]

    # torch.compile leaves the op eager: Inductor re-compiles user Triton kernels itself and
    # fails on the nested @triton.jit helpers of the forward kernel (Triton 3.6, torch 2.11).
    @torch.compiler.disable
    def _forgetting_attention(self, q: Tensor, key: Tensor, val: Tensor, log_fgate: Tensor) -> Tensor:
        """FoX attention over the whole sequence (training, or the first call with a cache)."""
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

    @staticmethod
    def _cumulative_log_gates(log_fgate: Tensor, c_last: Tensor | None) -> Tensor:
        """``c`` of the new positions in float64, continued from ``c_last`` ([B, H];
        ``None``: from 0), each gate floored at ``LOG_GATE_FLOOR`` as the attention op does.

        Float64, as the full-sequence op keeps it: ``c`` grows large and negative and a
        float32 ``c_t - c_j`` cancels digits (SPEC section 1, Numerics); the decode op
        takes that difference in float64. On the tiny test models a float32 ``c`` already
        doubled the cached logits' error after 27 tokens.
        """
        c = torch.cumsum(log_fgate.to(torch.float64).clamp_min(LOG_GATE_FLOOR), dim=1)  # [B, T, H]
        return c if c_last is None else c + c_last[:, None]

    def _cached_forgetting_attention(self, q: Tensor, cache: LayerCache) -> Tensor:
        """FoX attention of ``T`` new queries over the cache, which already holds them.

        One token: :func:`forgetting_attention_decode` over the preallocated buffers.
        Several: ``softmax(scale q k^T + c_i - c_j)`` materialised, query ``i`` at key
        position ``i + past`` (aligned to the end), the bias taken in float64 and the
        rest in float32 (float64 for a float64 model). Dense either way: ACP prunes only
        in the full-sequence op.
        """
        t, h = q.shape[1], q.shape[2]
        n = cache.length
        if t == 1:
            backend = "torch" if self.config.attn_backend == "naive" else self.config.attn_backend
            o = forgetting_attention_decode(
                q[:, 0], cache.k, cache.v, cache.c, cache.seqlens(),
                scale=self.scale, check_values=False, backend=backend,
            )  # [B, H, D]
            return o[:, None]  # [B, 1, H, D]
        acc = _compute_dtype(q)
        group = h // self.n_kv_heads
        key = cache.k[:, :n].repeat_interleave(group, dim=2).to(acc)  # [B, N, H, D]
        val = cache.v[:, :n].repeat_interleave(group, dim=2).to(acc)  # [B, N, H, D]
        c = cache.c[:, :n].transpose(1, 2)  # [B, H, N] float64
        bias = (c[:, :, n - t :, None] - c[:, :, None, :]).to(acc)  # [B, H, T, N]
        logits = torch.einsum("bthd,bnhd->bhtn", q.to(acc), key) * self.scale + bias
        allowed = _causal_mask(t, n, q.device)  # [T, N]
        p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)  # [B, H, T, N]
        return torch.einsum("bhtn,bnhd->bthd", p, val).to(q.dtype)  # [B, T, H, D]

    def _softmax_attention(self, q: Tensor, key: Tensor, val: Tensor, cache: LayerCache | None) -> Tensor:
        """Causal SDPA; with a cache the queries attend to every cached key, aligned to the end."""
        t = q.shape[1]
        mask = None
        if cache is not None and cache.length > t:
            n = cache.length
            key, val = cache.k[:, :n], cache.v[:, :n]  # [B, N, K, D]
            mask = _causal_mask(t, n, q.device)  # [T, N]
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), key.transpose(1, 2), val.transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
            enable_gqa=self.n_heads != self.n_kv_heads,
        ).transpose(1, 2)  # [B, T, H, D]

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

    def forward(self, x: Tensor, cache: LayerCache | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cache)
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

    def forward(
        self, input_ids: Tensor, labels: Tensor | None = None, *, cache: DenseCache | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Logits and, with ``labels``, the mean cross-entropy.

        Args:
            input_ids: ``[B, T]`` integer token ids.
            labels: ``[B, T]`` the target of every position, already shifted (the token
                that follows ``input_ids[:, t]``); ``-100`` marks positions left out of
                the loss.
            cache: a :class:`~lapse.generation.DenseCache` with one layer per block.
                ``input_ids`` continue the sequences it holds: their keys and values are
                appended to it and they attend to everything cached (for a Transformer,
                their RoPE positions start at ``cache.length``). Empty at first: the
                first call is the prefill.

        Returns:
            ``(logits, loss)``: logits ``[B, T, V]`` in the model's dtype, loss a float32
            scalar (``None`` without labels).
        """
        shape = tuple(getattr(input_ids, "shape", ()))
        if labels is not None and (not isinstance(labels, Tensor) or tuple(labels.shape) != shape):
            raise ValueError(
                f"labels must have the shape of input_ids {shape}, got {tuple(getattr(labels, 'shape', ()))}"
            )
        logits = self.lm_head(self.hidden_states(input_ids, cache=cache))  # [B, T, V]
        if labels is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return logits, loss

    def hidden_states(self, input_ids: Tensor, *, cache: DenseCache | None = None) -> Tensor:
        """The final-norm output ``[B, T, C]``, the input of ``lm_head`` (what
        :meth:`forward` turns into logits; evaluations that must not hold ``[B, T, V]``
        logits project it a chunk of positions at a time). ``cache`` as in :meth:`forward`."""
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            if isinstance(input_ids, Tensor):
                got = f"shape {tuple(input_ids.shape)}, dtype {input_ids.dtype}"
            else:
                got = type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer tensor [batch, time], got {got}")
        if cache is not None:
            if not isinstance(cache, DenseCache):
                raise TypeError(f"cache must be a lapse.generation.DenseCache, got {type(cache).__name__}")
            if len(cache.layers) != len(self.blocks):
                raise ValueError(
                    f"the cache has {len(cache.layers)} layers but the model has {len(self.blocks)}: "
                    "make it with DenseCache(config.n_layers)"
                )
            if cache.batch_size not in (None, input_ids.shape[0]):
                raise ValueError(
                    f"the cache holds {cache.batch_size} sequences but input_ids has {input_ids.shape[0]}: "
                    "use a fresh cache for a new batch"
                )
        x = self.embed(input_ids)  # [B, T, C]
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache.layers[i])  # [B, T, C]
        return self.norm(x)  # [B, T, C]

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
