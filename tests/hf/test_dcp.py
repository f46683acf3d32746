"""DCP on Hugging Face LLaMA-family models (``lapse.hf.add_dcp``), tiny random configs, fp32.

With interaction weights such that nothing drops the wrapped model equals the unwrapped
one exactly; the training path (alpha-sigmoid bias through SDPA) equals the materialised
reference forward and backward; generation through ``EvictingCache(DCPDrop())`` drops
tokens for good and equals full attention under the step mask, recomputed from scratch at
every step, token by token.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from lapse.generation import H2O, DCPDrop, Dense  # noqa: E402
from lapse.hf import CACHE_ARG, EvictingCache, add_dcp, dcp_modules  # noqa: E402
from lapse.ops.dcp import dcp_sparsity_loss  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 96


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, pad_token_id=0,
        bos_token_id=1, eos_token_id=None, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def _pair(r: int = 8, beta_init: float = 2.0) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    ref, ours = _llama(), _llama()
    add_dcp(ours, r=r, beta_init=beta_init)
    return ref, ours


def _ids(b: int = 2, t: int = 14, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _dropping(model, scale: float = 1.0, seed: int = 2) -> None:
    """Interaction weights that make the step mask drop a good share of the pairs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for dcp in dcp_modules(model):
            for w in (dcp.qint_proj.weight, dcp.kint_proj.weight):
                w.copy_(scale * torch.randn(w.shape, generator=g))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_nothing_dropped_equals_the_unwrapped_model_exactly(mode):
    ref, ours = _pair()
    for dcp in dcp_modules(ours):
        torch.nn.init.zeros_(dcp.qint_proj.weight)  # z = beta = 2: every factor is 1 (step and alpha = 4)
        dcp.alpha = 4.0
    ref.train(mode == "train")
    ours.train(mode == "train")
    ids = _ids()
    if mode == "eval":
        assert torch.equal(ours(ids).logits, ref(ids).logits)
    else:  # SDPA takes a float bias on this path (HF's: a causal flag), summed in another order on CPU
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=5e-6)


def test_training_path_equals_the_materialised_reference_forward_and_backward():
    _, ours = _pair(beta_init=0.3)
    _dropping(ours, scale=0.3)
    refd = _llama()
    add_dcp(refd, r=8, beta_init=0.3)
    refd.load_state_dict(ours.state_dict())
    for m in (ours, refd):
        m.double().train()
        for dcp in dcp_modules(m):
            dcp.alpha, dcp.keep_log_mask = 3.0, True
    for dcp in dcp_modules(refd):
        dcp.attn_backend = "naive"  # materialised [B, H, T, T] scores, explicit causal mask
    ids = _ids()
    out = []
    for m in (ours, refd):
        lm = m(ids, labels=ids).loss
        loss = lm + 0.5 * torch.stack([dcp_sparsity_loss(d.take_log_mask()) for d in dcp_modules(m)]).mean()
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (la, ga), (lb, gb) = out
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=0)
    assert any("dcp" in n for n in ga) and all(ga[n] is not None for n in ga if "dcp" in n)
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-10, atol=1e-12)


def _reference_generate(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding by a full forward over the whole sequence at each step: attention
    under the step mask over every token so far, nothing cached."""
    for _ in range(steps):
        with torch.no_grad():
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def test_generation_through_the_store_drops_and_equals_masked_full_attention():
    _, ours = _pair(beta_init=0.5)
    _dropping(ours)
    ids = _ids(t=20)
    expected = _reference_generate(ours, ids, 12)
    cache = EvictingCache(DCPDrop(every=1), model=ours, max_context=64)
    got = ours.generate(ids, **{CACHE_ARG: cache}, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    held = [int(n.max()) for n in cache.store.lengths]
    assert max(held) < got.shape[1] - 1  # tokens were dropped and their slots freed


def test_left_padded_batch_through_the_store_equals_each_prompt_alone():
    _, ours = _pair(beta_init=0.5)
    _dropping(ours)
    lengths, t = (16, 9), 16
    ids = _ids(b=2, t=t, seed=3)
    mask = (torch.arange(t) >= t - torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    policy = DCPDrop(every=1)  # a compaction before every step, ragged rows included
    got = ours.generate(ids, attention_mask=mask, **{CACHE_ARG: EvictingCache(policy, model=ours)}, **kw)
    for b, n in enumerate(lengths):
        cache = EvictingCache(policy, model=ours)
        alone = ours.generate(ids[b : b + 1, t - n :], **{CACHE_ARG: cache}, **kw)
        assert torch.equal(got[b, t:], alone[0, n:])


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match="r \\(the DCP interaction dim\\)"):
        add_dcp(_llama(), r=0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="gpt2"):
        add_dcp(gpt2)
    with pytest.raises(ValueError, match="DCPDrop needs DCP parameters"):
        EvictingCache(DCPDrop(), model=_llama())
    _, ours = _pair()
    with pytest.raises(ValueError, match="has DCP layers already"):
        add_dcp(ours)
    with pytest.raises(ValueError, match="attention scores"):
        EvictingCache(H2O(budget=64, recent=16), model=ours)
    with pytest.raises(ValueError, match="EvictingCache"):  # HF's DynamicCache holds no interaction keys
        ours.generate(_ids(), max_new_tokens=2, do_sample=False, pad_token_id=0)
    EvictingCache(Dense(), model=ours)  # a DCP model under Dense: the layers still drop, nothing is freed
