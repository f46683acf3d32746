"""DCP models (attention="dcp" in a llama or pro block): config and registry, cached
generation against recomputation, the compiled decode step, and starting DCP from a
softmax checkpoint.

Tolerances as in tests/generation/test_generate.py (measured there for the same tiny
models): 2e-5 on float32 logits, cached against full recomputation; here the largest
difference measured was 2.1e-6 (beta 0: 70-85% of the context dropped)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lapse.generation import generate
from lapse.layers import DCPAttention
from lapse.models import ATTENTION_KINDS, Decoder, ModelConfig, preset
from lapse.models.checkpoint import dcp_parameter_names, load_weights

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL32 = 2e-5


def _model(block: str, dtype=torch.float32, **overrides) -> Decoder:
    """A tiny DCP model (init_std 0.1) with beta 0: the step mask drops most of the context."""
    torch.manual_seed(0)
    overrides = {"init_std": 0.1, "dcp_beta_init": 0.0, **overrides}
    return Decoder(preset("tiny", attention="dcp", block=block, **overrides)).to(dtype).eval()


@torch.no_grad()
def _uncached_greedy(model: Decoder, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    steps = []
    for _ in range(n):
        logits, _ = model(ids)
        steps.append(logits[:, -1])
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids, torch.stack(steps, dim=1)


def _dropped(model: Decoder, ids: torch.Tensor) -> float:
    model.set_collect_stats(True)
    with torch.no_grad():
        model(ids)
    share = torch.stack([b.attn.last_stats.dropped[:, 1:].mean() for b in model.blocks]).mean().item()
    model.set_collect_stats(False)
    return share


def test_config_and_registry():
    config = preset("tiny", attention="dcp", block="pro", dcp_r=12, dcp_beta_init=1.5)
    assert config.name == "dcp-pro" and ATTENTION_KINDS["dcp"] is DCPAttention
    layer = Decoder(config).blocks[1].attn
    assert isinstance(layer, DCPAttention) and layer.layer_idx == 1 and layer.k_shift is not None
    assert layer.qint_proj.weight.shape == (12, 64) and layer.beta.item() == 1.5
    assert ModelConfig().dcp_r == 64 and ModelConfig().dcp_beta_init == 2.0
    for r in (0, -1, 2.0):
        with pytest.raises(ValueError, match="dcp_r .* must be a positive integer"):
            preset("tiny", attention="dcp", dcp_r=r)
    with pytest.raises(ValueError, match="acp=True needs a forget gate"):
        ModelConfig(attention="dcp", acp=True)


@pytest.mark.parametrize("prompt_len", [1, 7], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA2"])
@pytest.mark.parametrize("block", ["llama", "pro"])
def test_cached_greedy_equals_uncached(block, kv_heads, prompt_len):
    """20 new tokens, batch 2, in eval mode (the step mask) with most of the context
    dropped: the cache's in-place keep flags give what recomputing the mask gives."""
    model = _model(block, n_kv_heads=kv_heads)
    ids = torch.randint(0, model.config.vocab_size, (2, prompt_len))
    out, logits = generate(model, ids, 20, return_logits=True)
    ref_out, ref_logits = _uncached_greedy(model, ids, 20)
    top2 = ref_logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-4, "near-tie: the test would be fragile"
    assert torch.equal(out, ref_out)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL32, rtol=0)
    assert _dropped(model, ref_out) > 0.3


def test_ragged_prompts_equal_each_alone():
    model = _model("pro", n_kv_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    out = generate(model, ids, 8, lengths=[9, 4])
    assert torch.equal(out[0], generate(model, ids[:1], 8)[0])
    assert torch.equal(out[1, :12], generate(model, ids[1:, :4], 8)[0])


@pytest.mark.parametrize("block", ["llama", "pro"])
def test_compiled_decode_step_equals_eager(block, compiled_step_matches_eager):
    """The DCP decode step (in-place keep flags over every slot) traces whole."""
    model = _model(block, n_kv_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    eager, compiled = compiled_step_matches_eager(model, ids, 5, capacity=12, atol=ATOL32)
    for i in range(2):
        assert torch.equal(compiled.extras[i]["log_keep"][:, :11], eager.extras[i]["log_keep"][:, :11])


def _checkpoint(model: Decoder, folder: Path) -> Path:
    """A checkpoint folder as the trainer's readers accept it (weights; no manifest)."""
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    (folder / "trainer_state.pt").write_bytes(b"")
    return folder


@pytest.mark.parametrize("block", ["llama", "pro"])
def test_softmax_checkpoint_into_dcp_equals_the_dense_model_when_nothing_drops(block, tmp_path):
    """A Transformer checkpoint loaded into a DCP model (init_dcp): the softmax weights
    load, the interaction parameters stay at their init; with W_int = 0 and beta = 100
    nothing drops and the DCP model is the Transformer, bit for bit, in training (alpha
    1 and 2) and in eval mode."""
    torch.manual_seed(1)
    dense = Decoder(preset("tiny", attention="softmax", block=block, acp=False))
    folder = _checkpoint(dense, tmp_path / "checkpoint-0000001")
    dcp = Decoder(preset("tiny", attention="dcp", block=block, acp=False, dcp_beta_init=100.0))
    init = {n: p.detach().clone() for n, p in dcp.named_parameters() if n in dcp_parameter_names(dcp)}
    load_weights(folder, dcp, init_dcp=True)
    assert len(init) == 3 * dcp.config.n_layers
    for name, p in dcp.named_parameters():
        if name in init:
            assert torch.equal(p, init[name]), name  # left at init
        else:
            assert torch.equal(p, dense.get_parameter(name)), name
    with torch.no_grad():
        for block_ in dcp.blocks:
            block_.attn.qint_proj.weight.zero_()
            block_.attn.kint_proj.weight.zero_()
    ids = torch.randint(0, dcp.config.vocab_size, (2, 17))
    with torch.no_grad():
        for train, alpha in ((False, 1.0), (True, 1.0), (True, 2.0)):
            dense.train(train), dcp.train(train)
            for b in dcp.blocks:
                b.attn.alpha = alpha
            assert torch.equal(dcp(ids)[0], dense(ids)[0])
        dense.eval(), dcp.eval()
        assert torch.equal(generate(dcp, ids[:, :5], 8), generate(dense, ids[:, :5], 8))


def test_a_checkpoint_without_dcp_parameters_is_refused(tmp_path):
    dense = Decoder(preset("tiny", attention="softmax", block="llama", acp=False))
    folder = _checkpoint(dense, tmp_path / "checkpoint-0000001")
    dcp = Decoder(preset("tiny", attention="dcp", block="llama", acp=False))
    before = {k: v.clone() for k, v in dcp.state_dict().items()}
    with pytest.raises(ValueError, match="has no DCP parameters .* trained without DCP"):
        load_weights(folder, dcp)
    assert all(torch.equal(v, before[k]) for k, v in dcp.state_dict().items())  # untouched
    # a DCP checkpoint loads without the flag (and with it)
    folder2 = _checkpoint(dcp, tmp_path / "checkpoint-0000002")
    load_weights(folder2, Decoder(dcp.config))
    load_weights(folder2, Decoder(dcp.config), init_dcp=True)
    # a checkpoint of another architecture is no softmax model to start from
    fox = Decoder(preset("tiny", "fox-llama"))
    with pytest.raises(ValueError, match="does not fit the model"):
        load_weights(_checkpoint(fox, tmp_path / "checkpoint-0000003"), Decoder(dcp.config), init_dcp=True)
