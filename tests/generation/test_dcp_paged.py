"""DCP served from the paged store: the layer flags the slots its step
mask drops and ignores them from that step on, the ``DCPDrop`` policy frees them, and the
tokens and logits equal DCP over the dense store, where nothing is ever freed (CPU)."""

from __future__ import annotations

import pytest
import torch

from lapse.generation import H2O, DCPDrop, Dense, SinkWindow, generate, paged_store_for
from lapse.models import Decoder, preset

pytestmark = pytest.mark.usefixtures("one_thread")
ATOL32 = 2e-5  # as tests/generation/test_generate.py


def _dcp_model(block: str = "llama", kv_heads: int = 2, beta: float = 0.3) -> Decoder:
    """A tiny DCP model whose interaction logits sit near 0, so the step mask drops a good
    share of the context (beta moves the share)."""
    torch.manual_seed(0)
    model = Decoder(
        preset("tiny", f"transformer-{block}", attention="dcp", acp=False, n_kv_heads=kv_heads, init_std=0.1)
    ).eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.beta.fill_(beta)
    return model


@pytest.mark.parametrize("block", ["llama", "pro"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA2"])
@pytest.mark.parametrize("every", [1, 5])
def test_paged_dcp_equals_dcp_over_the_dense_store_and_frees_memory(block, kv_heads, every):
    model = _dcp_model(block, kv_heads)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    ref, ref_logits = generate(model, ids, 24, return_logits=True)  # DenseStore: exact DCP
    policy = DCPDrop(every=every)
    store = paged_store_for(model, 2, 40, 24, policy)
    out, logits = generate(model, ids, 24, return_logits=True, policy=policy, cache=store)
    assert torch.equal(out, ref)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL32, rtol=0)
    held = [int(store.lengths[i].max()) for i in range(model.config.n_layers)]
    assert max(held) < 40 + 23, "the mask dropped nothing: the test would not test freeing"
    assert store.bytes_held() < 0.8 * store.bytes_if_dense()
    for i in range(model.config.n_layers):  # one layer-wide decision: every head the same slots
        lengths = store.lengths[i]
        assert (lengths == lengths[:, :1]).all()


def test_dense_policy_and_ragged_batches():
    model = _dcp_model()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (17, 5, 30)]
    ids = torch.zeros(3, 30, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    out = generate(model, ids, 10, lengths=[17, 5, 30], policy=DCPDrop(every=1))  # a pass every step
    for b, p in enumerate(prompts):
        alone = generate(model, p[None], 10)  # DenseStore
        assert torch.equal(out[b, : len(p) + 10], alone[0])
    assert torch.equal(generate(model, ids[:1], 10, policy=Dense()), generate(model, ids[:1], 10))
    window = generate(
        model, ids[:1], 10, policy=SinkWindow(sinks=1, window=8, every=1)
    )  # layer-wide: allowed
    assert window.shape == (1, 40)


def test_dcp_policy_errors():
    model = _dcp_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    # H2O/A2SF rank tokens by scores DCP's layers do not record (every token scored 0: they kept
    # the first and the recent tokens under the policy's name); refused per layer and per head,
    # in generate and through the evaluations' EvictingCache alike
    from lapse.eval.policy import as_causal_lm, next_logits, policy_cache
    from lapse.generation import A2SF

    for policy in (H2O(budget=6, recent=2), H2O(budget=6, recent=2, per="layer"),
                   A2SF(budget=6, recent=2, alpha=0.5, per="layer")):
        with pytest.raises(ValueError, match="ranks tokens by their attention scores, which a dcp"):
            generate(model, ids, 4, policy=policy)
        with pytest.raises(ValueError, match="ranks tokens by their attention scores, which a dcp"):
            next_logits(as_causal_lm(model), ids, policy_cache(as_causal_lm(model), policy, 16))
    fox = Decoder(preset("tiny", "fox-pro")).eval()
    with pytest.raises(ValueError, match="DCPDrop needs DCP attention"):
        generate(fox, ids, 4, policy=DCPDrop())
    model.train()
    with pytest.raises(ValueError, match="step mask: call model.eval"):
        generate(model, ids, 4, policy=DCPDrop())
