"""The decoder models against a plain re-statement of SPEC section 2 (CPU, float64).

The reference below shares no code with ``lapse.models``: it reads the model's weights
and recomputes everything with explicit loops and materialised matrices (KV-shift as a
loop over time, QK-norm head by head, FoX attention as
``softmax(scale QK^T + c_i - c_j) V``, RoPE pair by pair).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lapse.models import (
    ARCHS,
    Decoder,
    ModelConfig,
    RMSNorm,
    flops_per_token,
    optimizer_groups,
    param_count,
    preset,
)

FOX_ARCHS = [a for a in ARCHS if a.startswith("fox")]


def _rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _shift_loop(x_tilde, alpha):
    """k_t = alpha_t k~_{t-1} + (1 - alpha_t) k~_t with k~_0 = 0, one step at a time."""
    out = torch.empty_like(x_tilde)
    prev = torch.zeros_like(x_tilde[:, 0])
    for t in range(x_tilde.shape[1]):
        a = alpha[:, t, :, None]
        out[:, t] = a * prev + (1 - a) * x_tilde[:, t]
        prev = x_tilde[:, t]
    return out


def _rope_pairs(x, base):
    """Channel i and i + D/2 rotated by angle t * base^(-2i/D), pair by pair."""
    t_len, d = x.shape[1], x.shape[-1]
    out = x.clone()
    t = torch.arange(t_len, dtype=x.dtype)[None, :, None]
    for i in range(d // 2):
        angle = t * base ** (-2 * i / d)
        a, b = x[..., i], x[..., i + d // 2]
        out[..., i] = a * torch.cos(angle) - b * torch.sin(angle)
        out[..., i + d // 2] = a * torch.sin(angle) + b * torch.cos(angle)
    return out


def reference_attention(layer, cfg, x):
    b, t, _ = x.shape
    h, k, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    scale = 1 / math.sqrt(d)
    q = (x @ layer.q_proj.weight.T).view(b, t, h, d)
    key = (x @ layer.k_proj.weight.T).view(b, t, k, d)
    val = (x @ layer.v_proj.weight.T).view(b, t, k, d)
    if cfg.block == "pro":
        key = _shift_loop(key, torch.sigmoid(x @ layer.k_shift.weight.T))
        val = _shift_loop(val, torch.sigmoid(x @ layer.v_shift.weight.T))
        q = torch.stack([_rms(q[:, :, i], layer.q_norm.weight[i], 1e-5) for i in range(h)], dim=2)
        key = torch.stack([_rms(key[:, :, i], layer.k_norm.weight[i], 1e-5) for i in range(k)], dim=2)
    if cfg.attention == "forgetting":
        c = torch.cumsum(F.logsigmoid(x @ layer.fgate.weight.T + layer.fgate.bias), dim=1)  # [B, T, H]
    else:
        q, key = _rope_pairs(q, 500000.0), _rope_pairs(key, 500000.0)
        c = torch.zeros(b, t, h, dtype=x.dtype)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    heads = []
    for i in range(h):
        j = i // (h // k)  # the key/value head of query head i
        s = q[:, :, i] @ key[:, :, j].transpose(1, 2) * scale + c[:, :, i, None] - c[:, None, :, i]
        s = s.masked_fill(~causal, float("-inf"))
        heads.append(torch.softmax(s, dim=-1) @ val[:, :, j])
    o = torch.stack(heads, dim=2)  # [B, T, H, D]
    if cfg.block == "pro":
        o = torch.stack([_rms(o[:, :, i], layer.o_norm.weight[i], 1e-6) for i in range(h)], dim=2)
        o = o.reshape(b, t, h * d) * torch.sigmoid(x @ layer.o_gate.weight.T)
    else:
        o = o.reshape(b, t, h * d)
    return o @ layer.o_proj.weight.T


def reference_logits(model, ids):
    x = model.embed.weight[ids]
    for blk in model.blocks:
        x = x + reference_attention(blk.attn, model.config, _rms(x, blk.attn_norm.weight, 1e-6))
        y = _rms(x, blk.mlp_norm.weight, 1e-6)
        x = x + (F.silu(y @ blk.mlp.w_gate.weight.T) * (y @ blk.mlp.w_up.weight.T)) @ blk.mlp.w_down.weight.T
    return _rms(x, model.norm.weight, 1e-6) @ model.lm_head.weight.T


def _randomised(model):
    """Weights large enough for peaked attention and gains away from 1, so that a
    missing per-channel gain, head mix-up or shift error shows."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "norm." in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_matches_spec_restatement(arch, kv_heads):
    torch.manual_seed(0)
    model = _randomised(Decoder(preset("tiny", arch, n_kv_heads=kv_heads)).double())
    ids = torch.randint(0, model.config.vocab_size, (2, 100))  # crosses a 64-block boundary
    logits, _ = model(ids)
    ref = reference_logits(model, ids)
    torch.testing.assert_close(logits, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_backward_finite(arch):
    torch.manual_seed(0)
    model = Decoder(preset("tiny", arch))
    ids = torch.randint(0, model.config.vocab_size, (2, 96))
    logits, loss = model(ids, labels=ids.roll(-1, dims=1))
    assert logits.shape == (2, 96, model.config.vocab_size)
    assert torch.isfinite(loss) and abs(loss.item() - math.log(model.config.vocab_size)) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_labels_ignore_index():
    model = Decoder(preset("tiny", "fox-pro"))
    ids = torch.randint(0, 128, (1, 16))
    labels = ids.clone()
    labels[:, 8:] = -100
    logits, loss = model(ids, labels)
    torch.testing.assert_close(loss, F.cross_entropy(logits[0, :8].float(), labels[0, :8]))


@pytest.mark.parametrize("arch", FOX_ARCHS)
def test_acp_changes_loss_by_less_than_eps_and_collects_stats(arch):
    torch.manual_seed(0)
    dense = Decoder(preset("tiny", arch))
    pruned = Decoder(preset("tiny", arch, acp=True))
    pruned.load_state_dict(dense.state_dict())
    ids = torch.randint(0, 128, (2, 256))
    pruned.set_collect_stats(True)
    _, loss_dense = dense(ids, ids)
    _, loss_pruned = pruned(ids, ids)
    fractions = pruned.pruned_fractions()
    print(f"{arch}: loss {loss_dense.item():.6f} dense, {loss_pruned.item():.6f} ACP; pruned {fractions}")
    assert fractions.shape == (2, 4)
    # gates near 0.5 at init decay fast: the oldest key blocks of the later query blocks go
    assert (fractions > 0.1).all()
    assert abs(loss_pruned.item() - loss_dense.item()) < 1e-4
    pruned.set_collect_stats(False)
    pruned(ids)
    assert pruned.pruned_fractions() is None


def test_acp_bound_from_qk_norm_gains_bounds_the_logits():
    torch.manual_seed(0)
    model = _randomised(Decoder(preset("tiny", "fox-pro", acp=True, n_kv_heads=2)))
    layer = model.blocks[0].attn
    seen = {}
    layer.q_norm.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o))
    layer.k_norm.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o))
    model(torch.randint(0, 128, (2, 64)))
    q, k = seen["q"], seen["k"].repeat_interleave(2, dim=2)  # [B, T, H, D]
    logits = torch.einsum("bihd,bjhd->bhij", q, k) * layer.scale
    g_q = layer.q_norm.weight.abs().amax(-1)
    g_k = layer.k_norm.weight.abs().amax(-1).repeat_interleave(2)
    bound = layer.acp_bound()
    # sqrt(D) for the default scale, and a factor for 16-bit rounding of q and k
    torch.testing.assert_close(bound, g_q * g_k * math.sqrt(layer.head_dim) * (1 + 2**-8) ** 4)
    assert (logits.abs().amax(dim=(0, 2, 3)) <= bound).all()


def test_optimizer_groups_exclude_norms_and_biases():
    model = Decoder(preset("tiny", "fox-pro"))
    decay, no_decay = optimizer_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay_names | no_decay_names == set(names.values())
    assert not decay_names & no_decay_names
    norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    biases = {n for n in names.values() if n.endswith(".bias")}
    assert norms and biases and no_decay_names == norms | biases
    assert "blocks.0.attn.q_norm.weight" in no_decay_names  # 2-D gains, still a norm
    assert {"embed.weight", "lm_head.weight", "blocks.0.attn.o_gate.weight"} <= decay_names
    torch.optim.AdamW([decay, no_decay], lr=1e-3, betas=(0.9, 0.95))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": 100, "n_heads": 12}, "must divide d_model"),
        ({"arch": "fox-gpt"}, "arch must be one of"),
        ({"n_heads": 4, "d_model": 64, "n_kv_heads": 3}, "must divide n_heads"),
        ({"arch": "transformer-pro", "acp": True}, "needs a forget gate.*turn ACP off .--model.no-acp"),
        ({"attention": "mamba"}, "unknown attention kind 'mamba'; valid kinds: softmax, forgetting"),
        ({"block": "gpt"}, "block must be one of"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"acp_eps": 2.0}, r"acp_eps must be in \(0, 1\)"),
        ({"attn_backend": "cuda"}, "attn_backend must be one of"),
        ({"d_model": 1024, "n_heads": 2}, "above 256"),
    ],
    ids=["heads-width", "arch", "kv-heads", "acp-transformer", "kind", "block", "vocab", "acp-eps", "backend",
         "head-dim"],
)
def test_bad_config_raises(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**overrides)


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_alias_sets_attention_and_block(arch):
    """The four architecture names are aliases of (attention kind, block kind): a config
    written before the two fields existed (``{"arch": ...}``) builds the same model."""
    old = ModelConfig(arch=arch)
    new = ModelConfig(attention=old.attention, block=old.block)
    assert old == new and old.arch is None and old.name == arch
    assert (old.attention, old.block) == {
        "fox-llama": ("forgetting", "llama"), "fox-pro": ("forgetting", "pro"),
        "transformer-llama": ("softmax", "llama"), "transformer-pro": ("softmax", "pro"),
    }[arch]


def test_unknown_preset_and_field_raise():
    with pytest.raises(ValueError, match="valid presets: tiny, small, gpu-20m, 125m, 360m, 760m"):
        preset("1b")
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        preset("tiny", d_modle=64)
    with pytest.raises(ValueError, match="arch must be one of"):
        preset("tiny", "mamba")
    with pytest.raises(ValueError, match="must divide d_model"):
        preset("tiny", n_heads=5)


def test_bad_input_ids_raise():
    model = Decoder(preset("tiny", "fox-llama"))
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        model(torch.randn(2, 8))
    with pytest.raises(ValueError, match="labels must have the shape"):
        model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))


def test_presets_derive_and_mlp_widths():
    assert preset("360m").n_layers == 24 and preset("760m").n_layers == 24
    assert preset("760m").head_dim == preset("125m").head_dim == 64
    assert preset("125m", "fox-llama").mlp_hidden == 2048  # 2/3 * 4 * 768
    assert preset("125m", "fox-pro").mlp_hidden == 1792  # 2/3 * 3.5 * 768
    assert preset("tiny").kv_heads == 4 and preset("tiny", n_kv_heads=2).kv_heads == 2


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("name", "nominal"), [("125m", 125e6), ("360m", 360e6), ("760m", 760e6)])
def test_paper_preset_sizes(name, nominal, arch):
    config = preset(name, arch)
    with torch.device("meta"):
        model = Decoder(config)
    n = param_count(model, non_embedding=True)
    total = param_count(model, non_embedding=False)
    print(f"{arch} {name}: {n / 1e6:.1f}M without the input embedding, {total / 1e6:.1f}M in all")
    assert abs(n - nominal) <= 0.2 * nominal
    assert total - n == config.vocab_size * config.d_model
    attention = 6 * config.n_layers * config.d_model * 4096
    assert flops_per_token(config, 4096) == 6 * n + attention


def test_flops_leave_out_the_pruned_tiles_by_hand():
    """T = 128 is two ACP blocks of 64: causal pairs 128^2 / 2 = 8192 (the dense count),
    causal tiles 64 * 64 + 64 * 128 = 12288. The one tile before the second block's diagonal
    (64 * 64 = 4096 pairs, a third of the tiles) pruned in every layer and head leaves 4096
    pairs: half the attention FLOPs, 12 * L * H * D * 4096 / T = 12 * 2 * 4 * 16 * 32 a token."""
    config = preset("tiny", "fox-pro", acp=True)
    assert (config.n_layers, config.n_heads, config.head_dim) == (2, 4, 16)
    dense = flops_per_token(config, 128)
    assert dense - flops_per_token(config, 128, pruned=1 / 3) == 12 * 2 * 4 * 16 * 32
    assert flops_per_token(config, 128, pruned=0.0) == dense
    with pytest.raises(ValueError, match="more than ACP can prune"):
        flops_per_token(config, 128, pruned=0.34)  # the diagonal tiles are always kept
    with pytest.raises(ValueError, match="without ACP"):
        flops_per_token(preset("tiny", "transformer-pro"), 128, pruned=0.1)


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200, 257, 1024])
def test_counted_attention_is_within_the_tiles_computed(t):
    """MFU stays at most 100% by construction: for any boundaries ACP can choose (each query
    block keeps its diagonal key block), the attention pairs counted from the op's own
    pruned fraction are at least 0 and at most the area of the tiles a kernel computes
    (kept tiles whole, the diagonal ones too), and never more than the dense count."""
    from lapse.ops.forgetting.common import ACP_BLOCK, Problem, pruned_fraction

    config = preset("tiny", "fox-pro", acp=True)
    dense = flops_per_token(config, t)
    matmuls = flops_per_token(config, t) - 6 * config.n_layers * config.n_heads * config.head_dim * t
    per_pair = 12 * config.n_layers * config.n_heads * config.head_dim  # one pair, all layers and heads
    m_blocks = -(-t // ACP_BLOCK)
    problem = Problem(batch=1, tq=t, tk=t, hq=1, h=1, d=config.head_dim, scale=1.0, cu_seqlens=None,
                      seqlens=None)
    g = torch.Generator().manual_seed(t)
    m = torch.arange(m_blocks)
    for block_start in (torch.zeros(m_blocks, dtype=torch.int32), m.int(),
                        *((torch.rand(m_blocks, generator=g) * (m + 1)).int() for _ in range(5))):
        fraction = float(pruned_fraction(block_start[None, None], problem))
        rows = (t - m * ACP_BLOCK).clamp(max=ACP_BLOCK)  # [M]
        kept_cols = torch.minimum((m + 1) * ACP_BLOCK, torch.tensor(t)) - block_start * ACP_BLOCK  # [M]
        computed = int((rows * kept_cols).sum())
        counted = (flops_per_token(config, t, pruned=fraction) - matmuls) * t / per_pair
        assert 0 < counted <= computed + 1e-6, (block_start.tolist(), counted, computed)
        assert flops_per_token(config, t, pruned=fraction) <= dense
