"""Activation checkpointing (``prepare_blocks(activation_checkpointing=True)``) for every
attention kind, eager and compiled: the recomputed blocks give the gradients of the
blocks that kept their activations, at a length past the preset's ``max_seq_len`` and on
the first step of the process at that length (the RoPE tables not yet made)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lapse.layers import RotaryEmbedding
from lapse.models import Decoder, ModelConfig, prepare_blocks, preset

KINDS = {
    "softmax": lambda: preset("tiny", "transformer-pro"),
    "forgetting": lambda: preset("tiny", "fox-pro", acp=True),
    "castle": lambda: preset("tiny", "castle"),
    "dcp": lambda: preset("tiny", "transformer-llama", attention="dcp", dcp_r=4),
}


def _grads(
    cfg: ModelConfig, ids: torch.Tensor, *, checkpointed: bool, backend: str | None, dtype: torch.dtype
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one forward and backward of a fresh model (seed 0) on ``ids``
    ``[B, T + 1]``; ``backend``: ``torch.compile``'s, per block as ``prepare_blocks`` does
    (``None``: eager)."""
    torch.manual_seed(0)
    model = Decoder(cfg).to(ids.device)
    prepare_blocks(model, activation_checkpointing=checkpointed)
    if backend is not None:
        for block in model.blocks:
            block.compile(backend=backend)
    with torch.autocast(ids.device.type, dtype=dtype):
        _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_checkpointed_blocks_give_the_same_gradients_past_max_seq_len(kind, backend, monkeypatch):
    cfg = KINDS[kind]()
    assert cfg.attention == kind
    t = cfg.max_seq_len + 64
    ids = torch.randint(0, cfg.vocab_size, (2, t + 1), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    runs = {}
    for checkpointed in (True, False):  # checkpointed first: the first forward at this length
        monkeypatch.setattr(RotaryEmbedding, "_tables_by_key", {})
        runs[checkpointed] = _grads(cfg, ids, checkpointed=checkpointed, backend=backend, dtype=torch.bfloat16)
    (loss_c, grads_c), (loss, grads) = runs[True], runs[False]
    assert torch.equal(loss_c, loss)
    assert grads_c.keys() == grads.keys() and len(grads) == len(list(Decoder(cfg).parameters()))
    for name, g in grads.items():
        assert torch.equal(grads_c[name], g), name
