"""``lapse.hf.generate``: a Hugging Face model's prefill through ``EvictingCache``, then
lapse's own decode loop on the converted decoder over the same store. On a tiny random
LLaMA (GQA, fp32, a left-padded batch) it must give ``model.generate`` with the same cache's
tokens exactly, under every policy (the same eviction schedule), eager and compiled."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers")

from test_evicting_cache import GREEDY, _padded_batch, _pair  # noqa: E402

from lapse.generation import A2SF, H2O, Dense, SinkWindow, compiled_decode_one_token  # noqa: E402
from lapse.hf import CACHE_ARG, EvictingCache, decoder_from_hf, generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
generation = importlib.import_module("lapse.generation.generate")  # the module, not the function

POLICIES = [Dense(), H2O(budget=6, recent=2), A2SF(budget=0.5, recent=2, alpha=0.9, every=2),
            SinkWindow(sinks=2, window=4, every=3)]


def _expected(model, ids, mask, policy) -> torch.Tensor:
    cache = EvictingCache(policy, model=model)
    return model.generate(ids, attention_mask=mask, **{CACHE_ARG: cache}, **GREEDY)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
def test_equals_hugging_face_generate_with_the_same_cache(policy):
    _, model = _pair()
    ids, mask = _padded_batch()
    decoder = decoder_from_hf(model).eval()
    got = generate(model, ids, GREEDY["max_new_tokens"], policy, attention_mask=mask, decoder=decoder)
    assert torch.equal(got, _expected(model, ids, mask, policy))
    # made here when not given; without a mask: an unpadded batch
    assert torch.equal(generate(model, ids[:1, -12:], 5, policy)[:, :17],
                       _expected(model, ids[:1, -12:], None, policy)[:, :17])


def test_compiled_steps_give_the_same_tokens(monkeypatch):
    """``compile=True``: the decode step compiled whole (``aot_eager`` on the CPU: the
    trace, not inductor's code) and the passes compiled, as on a GPU."""
    traced = compiled_decode_one_token(mode=None, backend="aot_eager")
    monkeypatch.setattr(generation, "compiled_decode_one_token", lambda: traced)
    _, model = _pair()
    ids, mask = _padded_batch()
    decoder = decoder_from_hf(model).eval()
    policy = H2O(budget=6, recent=2, every=4)
    got = generate(model, ids, GREEDY["max_new_tokens"], policy, attention_mask=mask, decoder=decoder,
                   compile=True)
    assert torch.equal(got, _expected(model, ids, mask, policy))


def test_prefilled_needs_a_filled_cache():
    _, model = _pair()
    decoder = decoder_from_hf(model).eval()
    ids = torch.randint(1, 90, (1, 5))
    with pytest.raises(ValueError, match="prefilled logits continue a cache that holds the prompts"):
        generation.generate(decoder, ids, 3, prefilled=torch.zeros(1, 96))


@pytest.mark.gpu
def test_compiled_on_cuda_equals_hugging_face_generate():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, model = _pair()
    model = model.cuda()
    ids, mask = (x.cuda() for x in _padded_batch())
    for decoder in (decoder_from_hf(model).cuda().eval(), decoder_from_hf(model, share=True)):
        for policy in POLICIES:
            got = generate(model, ids, GREEDY["max_new_tokens"], policy, attention_mask=mask, decoder=decoder,
                           compile=True)
            assert torch.equal(got, _expected(model, ids, mask, policy)), policy


def test_rope_tables_are_made_before_the_compiled_step(monkeypatch):
    """After a Hugging Face prefill the converted decoder has run no eager forward, so its
    RoPE tables must be made on the host before the first compiled step: made inside, they
    would be an output of the step's CUDA graph, overwritten by the next replay (on an H100:
    "accessing tensor output of CUDAGraphs that has been overwritten")."""
    from lapse.layers.rotary import RotaryEmbedding

    traced = compiled_decode_one_token(mode=None, backend="aot_eager")
    monkeypatch.setattr(generation, "compiled_decode_one_token", lambda: traced)
    made_while_compiling = []
    original = RotaryEmbedding._tables

    def spied(self, max_positions, device):
        tables = self._tables_by_key.get((self.head_dim, self.base, str(device)))
        if tables is None or tables[0].shape[0] < max_positions:
            made_while_compiling.append(torch.compiler.is_compiling())
        return original(self, max_positions, device)

    monkeypatch.setattr(RotaryEmbedding, "_tables", spied)
    monkeypatch.setattr(RotaryEmbedding, "_tables_by_key", {})
    _, model = _pair()
    ids, mask = _padded_batch()
    generate(model, ids, 4, Dense(), attention_mask=mask, decoder=decoder_from_hf(model).eval(), compile=True)
    assert made_while_compiling == [False]


def test_a_shared_decoder_holds_no_copy_of_the_weights():
    """``decoder_from_hf(model, share=True)`` (what ``generate`` makes when given no decoder)
    uses the model's own tensors: no second copy of the weights, the same logits as the
    float32 copy ``lapse import`` makes."""
    _, model = _pair()
    shared, copied = decoder_from_hf(model, share=True), decoder_from_hf(model)
    theirs = {t.data_ptr() for t in model.parameters()}
    assert all(p.data_ptr() in theirs for p in shared.parameters())
    assert not any(p.data_ptr() in theirs for p in copied.parameters())
    ids = torch.randint(1, 90, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(shared(ids)[0], copied(ids)[0], rtol=0, atol=0)
