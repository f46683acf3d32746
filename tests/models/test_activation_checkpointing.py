"""Activation checkpointing (``prepare_blocks(activation_checkpointing=True)``) for every
attention kind, eager and compiled: the recomputed blocks give the gradients of the
blocks that kept their activations, at a length past the preset's ``max_seq_len`` and on
the first step of the process at that length (the RoPE tables not yet made). On CPU at a
tiny size; on CUDA at lengths where the Triton kernels take their long-sequence tiles."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lapse.layers import DCPAttention, RotaryEmbedding
from lapse.models import Decoder, ModelConfig, prepare_blocks, preset

KINDS = {
    "softmax": lambda **kw: preset("tiny", "transformer-pro", **kw),
    "forgetting": lambda **kw: preset("tiny", "fox-pro", **kw),
    "forgetting-acp": lambda **kw: preset("tiny", "fox-pro", acp=True, **kw),
    "castle": lambda **kw: preset("tiny", "castle", **kw),
    "dcp": lambda **kw: preset("tiny", "transformer-llama", attention="dcp", dcp_r=4, **kw),
}
DCP_ALPHA = 4.0  # the alpha-sigmoid's bisection, not the closed forms of alpha 1 and 2


def _grads(
    cfg: ModelConfig, ids: torch.Tensor, *, checkpointed: bool, compile: bool | str, dtype: torch.dtype | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one forward and backward of a fresh model (seed 0) on ``ids``
    ``[B, T + 1]``, with no RoPE table made yet. ``compile``: ``True`` as ``prepare_blocks``
    compiles (inductor), a string: that ``torch.compile`` backend per block; ``dtype``: of
    autocast (``None``: float32, no autocast)."""
    torch.manual_seed(0)
    model = Decoder(cfg).to(ids.device)
    for layer in model.modules():
        if isinstance(layer, DCPAttention):
            layer.alpha = DCP_ALPHA
    prepare_blocks(model, activation_checkpointing=checkpointed, compile=compile is True)
    if isinstance(compile, str):
        for block in model.blocks:
            block.compile(backend=compile)
    RotaryEmbedding._tables_by_key.clear()
    autocast = contextlib.nullcontext() if dtype is None else torch.autocast(ids.device.type, dtype=dtype)
    with autocast:
        _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_checkpointed_blocks_give_the_same_gradients_past_max_seq_len(kind, backend, monkeypatch):
    cfg = KINDS[kind]()
    t = cfg.max_seq_len + 64
    ids = torch.randint(0, cfg.vocab_size, (2, t + 1), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(RotaryEmbedding, "_tables_by_key", {})
    torch._dynamo.reset()
    loss_c, grads_c = _grads(cfg, ids, checkpointed=True, compile=backend or False, dtype=torch.bfloat16)
    loss, grads = _grads(cfg, ids, checkpointed=False, compile=backend or False, dtype=torch.bfloat16)
    assert torch.equal(loss_c, loss)
    for name, g in grads.items():
        assert g is not None and torch.equal(grads_c[name], g), name


# CUDA: T 65536, where the FoX kernels take their long-sequence tiles (D 64 bf16: 128-row
# dense tiles from 8192 keys on, ACP's ROUTE from 16384 with at least 2^18 query rows, B x
# H x T = 4 x 65536); DCP at 16384, as its mask is [B, T, T] float32 (17 GB a layer at 65536).
GPU_LENGTHS = {"softmax": 65536, "forgetting": 65536, "forgetting-acp": 65536, "castle": 65536, "dcp": 16384}


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_checkpointed_blocks_give_the_same_gradients_on_cuda(kind, compiled, monkeypatch):
    """Two layers of 256 (4 heads of 64; CASTLE 2), one row of ``GPU_LENGTHS[kind]`` tokens,
    bf16 autocast, blocks compiled by inductor or eager. The checkpointed gradients are
    finite and within 3x the bf16 error of the plain ones (each parameter's largest
    difference against the float32 eager run): the kernels may accumulate in another order
    (atomics) and inductor may fuse the recompute otherwise, but a recompute that saw other
    inputs (a RoPE table, ACP boundaries) would be off by the gradient's own size."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    heads = {"castle": dict(n_heads=2, attn_head_dim=64)}.get(kind, dict(n_heads=4))
    cfg = KINDS[kind](d_model=256, **heads)
    assert cfg.head_dim == 64
    t = GPU_LENGTHS[kind]
    assert t > cfg.max_seq_len
    ids = torch.randint(0, cfg.vocab_size, (1, t + 1), generator=torch.Generator().manual_seed(0)).cuda()
    monkeypatch.setattr(RotaryEmbedding, "_tables_by_key", {})
    torch._dynamo.reset()
    loss_c, grads_c = _grads(cfg, ids, checkpointed=True, compile=compiled, dtype=torch.bfloat16)
    loss, grads = _grads(cfg, ids, checkpointed=False, compile=compiled, dtype=torch.bfloat16)
    loss_ref, reference = _grads(cfg, ids, checkpointed=False, compile=False, dtype=None)
    assert torch.isfinite(loss_c) and (loss_c - loss).abs() <= 3 * (loss - loss_ref).abs() + 1e-6
    for name, g in grads.items():
        assert g is not None and torch.isfinite(grads_c[name]).all(), name
        error = (grads_c[name].float() - g.float()).abs().max().item()
        bf16 = (g.float() - reference[name].float()).abs().max().item()
        print(f"{kind} {name}: checkpointed vs plain {error:.3g}, plain bf16 vs float32 {bf16:.3g}")
        assert error <= 3 * bf16 + 1e-6 * reference[name].abs().max().item(), name
