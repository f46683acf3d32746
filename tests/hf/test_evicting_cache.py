"""``lapse.hf.EvictingCache`` on tiny random LLaMA-family models (GQA, fp32, CPU).

With nothing evicted it must give ``DynamicCache``'s generation token for token; with a
policy on, the store never holds more than the budget after an eviction, a sink + window
policy equals Hugging Face's own decoding under the matching mask, a left-padded batch
equals each prompt alone, and over the lapse adapter it equals lapse's own ``generate``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402  # noqa: E402
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lapse.generation import A2SF, H2O, ACPBoundary, Dense, SinkWindow, generate  # noqa: E402
from lapse.hf import ATTENTION, CACHE_ARG, EvictingCache, LapseConfig, LapseForCausalLM  # noqa: E402
from lapse.models import preset  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 96
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def _pair(family: str = "llama", **overrides):
    """Two copies of one tiny random model: the reference on ``sdpa`` and one on
    ``lapse_paged`` (GQA: 4 query heads over 2 kv heads; init 0.1: no near-ties)."""
    config_class, model_class = FAMILIES[family]
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    if family == "mistral":
        fields["sliding_window"] = None
    torch.manual_seed(0)
    ref = model_class(config_class(**fields, **overrides, attn_implementation="sdpa")).eval()
    ours = model_class(config_class(**fields, **overrides, attn_implementation="sdpa")).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _padded_batch(lengths=(12, 7, 10), seed: int = 1):
    """Left-padded prompts of ``lengths`` tokens: ``ids``, ``mask`` ``[B, max]``."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), t), generator=g)
    mask = (torch.arange(t) >= t - torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


GREEDY = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 0}


class Watched(EvictingCache):
    """Notes the most tokens any head holds right after each eviction pass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.after_evictions: list[int] = []

    def _before_step(self) -> None:
        super()._before_step()
        if self._steps % self.policy.every == 0:
            self.after_evictions.append(max(int(n.max()) for n in self.store.lengths))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dense_equals_dynamic_cache_with_left_padding(family):
    ref, ours = _pair(family)
    ids, mask = _padded_batch()
    expected = ref.generate(ids, attention_mask=mask, **{CACHE_ARG: DynamicCache()}, **GREEDY)
    cache = EvictingCache(Dense(), model=ours, max_context=64)
    assert ours.config._attn_implementation == ATTENTION
    got = ours.generate(ids, attention_mask=mask, **{CACHE_ARG: cache}, **GREEDY)
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == ids.shape[1] + GREEDY["max_new_tokens"] - 1
    assert cache.store.lengths[0][:, 0].tolist() == [n + 15 for n in (12, 7, 10)]  # no padding held


def test_lapse_paged_without_evicting_cache_is_sdpa():
    ref, ours = _pair()
    EvictingCache(Dense(), model=ours)  # switches the model
    ids, mask = _padded_batch()
    assert torch.equal(
        ours.generate(ids, attention_mask=mask, **GREEDY), ref.generate(ids, attention_mask=mask, **GREEDY)
    )


@pytest.mark.parametrize(
    "policy",
    [H2O(budget=64, recent=4), A2SF(budget=64, recent=4, alpha=0.5, every=3), SinkWindow(sinks=2, window=64)],
    ids=["h2o", "a2sf", "window"],
)
def test_budget_never_reached_equals_dense(policy):
    ref, ours = _pair()
    ids, mask = _padded_batch()
    expected = ref.generate(ids, attention_mask=mask, **GREEDY)
    got = ours.generate(
        ids, attention_mask=mask, **{CACHE_ARG: EvictingCache(policy, model=ours, max_context=64)}, **GREEDY
    )
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "policy",
    [
        H2O(budget=6, recent=2),
        A2SF(budget=0.5, recent=2, alpha=0.9, every=4),
        H2O(budget=5, recent=1, per="layer"),
    ],
    ids=["h2o", "a2sf-share-every4", "h2o-per-layer"],
)
def test_h2o_a2sf_never_exceed_the_budget(policy):
    _, ours = _pair()
    ids, mask = _padded_batch()
    cache = Watched(policy, model=ours)
    out = ours.generate(ids, attention_mask=mask, **{CACHE_ARG: cache}, **GREEDY)
    assert out.shape == (3, 12 + 16)
    budget = policy.tokens(12)  # a share of the longest prompt at most
    assert len(cache.after_evictions) == -(-15 // policy.every)
    assert max(cache.after_evictions) <= budget
    assert all(int(n.max()) <= budget + policy.every for n in cache.store.lengths)
    assert cache.store.bytes_held() < cache.store.bytes_if_dense()


def test_the_prompt_is_cut_as_its_forward_ends():
    """The prompt's cut runs as the prompt's forward ends (so a timed prefill includes it,
    as kvpress's compression is inside its prefill): right after that forward, before any
    decode step, no head holds more than the budget."""
    _, ours = _pair()
    ids, mask = _padded_batch()
    policy = H2O(budget=5, recent=2, every=4)
    cache = EvictingCache(policy, model=ours)
    with torch.no_grad():
        ours(input_ids=ids, attention_mask=mask, **{CACHE_ARG: cache}, use_cache=True)
    assert cache._steps == 0
    assert max(int(n.max()) for n in cache.store.lengths) == 5


def test_the_store_of_a_cut_prompt_holds_the_budget_not_the_prompt():
    """The prompt goes into the store cut, so its pool is sized for the budget plus the
    steps between evictions (1 page of 16 per head), not for the 40-token prompt (3)."""
    _, ours = _pair()
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    cache = EvictingCache(H2O(budget=5, recent=2, every=4), model=ours)
    with torch.no_grad():
        ours(input_ids=ids, **{CACHE_ARG: cache}, use_cache=True)
    assert all(pool.shape[0] - 1 == 2 * 2 * 1 for pool in cache.store.k)  # B x kv heads x 1 page
    assert all(int(n.max()) == 5 for n in cache.store.lengths)


def test_no_pass_in_the_prompt_and_none_for_a_policy_that_keeps_everything(policy_passes):
    """A Hugging Face model's prompt is cut before it is stored (``PagedStore.prefill_cut``):
    no eviction pass over the layers in its forward, for any policy. Decoding, ``Dense``
    (keeps every token) runs none either; the others run theirs on schedule."""
    others = (H2O(budget=4, recent=2), A2SF(budget=4, recent=2, alpha=0.5), SinkWindow(window=4))
    assert Dense().keeps_all and not any(p.keeps_all for p in others)
    _, ours = _pair()
    ids, mask = _padded_batch()
    for policy, passes in (
        (Dense(every=1), 0), (SinkWindow(window=4, every=1), 2), (H2O(budget=4, recent=2), 2)
    ):
        policy_passes.clear()
        cache = EvictingCache(policy, model=ours)
        with torch.no_grad():
            ours(input_ids=ids, attention_mask=mask, **{CACHE_ARG: cache}, use_cache=True)
        assert not policy_passes, policy
        # three decode forwards: a pass before the second and the third (every=1)
        ours.generate(ids, attention_mask=mask, **{CACHE_ARG: EvictingCache(policy, model=ours)},
                      max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert len(policy_passes) == passes, policy


def test_sampling_runs_under_a_policy_and_dense_samples_as_dynamic_cache():
    ref, ours = _pair()
    ids, mask = _padded_batch()
    sample = {"max_new_tokens": 12, "do_sample": True, "top_k": 20, "pad_token_id": 0}
    torch.manual_seed(3)
    expected = ref.generate(ids, attention_mask=mask, **sample)
    torch.manual_seed(3)
    got = ours.generate(
        ids, attention_mask=mask, **{CACHE_ARG: EvictingCache(Dense(), model=ours)}, **sample
    )
    assert torch.equal(got, expected)
    cache = Watched(H2O(budget=6, recent=2), model=ours)
    out = ours.generate(ids, attention_mask=mask, **{CACHE_ARG: cache}, **sample)
    assert out.shape == (3, 24) and max(cache.after_evictions) <= 6


def test_mask_sizes_from_a_query_length_or_a_cache_position():
    """``get_mask_sizes`` takes the forward's new positions as a count (transformers 5.3 and
    later) or as its ``cache_position`` tensor (5.0-5.2, which kvpress 0.5.5 also accepts):
    the same sizes either way, before and after the prompt."""
    _, ours = _pair()
    ids, mask = _padded_batch()
    cache = EvictingCache(H2O(budget=4, recent=2), model=ours)
    assert cache.get_mask_sizes(7) == cache.get_mask_sizes(torch.arange(7)) == (7, 0)
    with torch.no_grad():
        ours(input_ids=ids, attention_mask=mask, **{CACHE_ARG: cache}, use_cache=True)
    t = ids.shape[1]
    assert cache.get_mask_sizes(1) == cache.get_mask_sizes(torch.arange(t, t + 1)) == (t + 1, 0)


def test_sink_window_equals_decoding_under_the_matching_mask():
    """SinkWindow(sinks=s, window=w, every=1): the query at position p sees positions < s and
    [p - w, p]; the reference is HF's own decoding over a DynamicCache with that 4D mask."""
    ref, ours = _pair()
    s, w, new = 2, 5, 14
    ids = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    got = ours.generate(
        ids, **{CACHE_ARG: EvictingCache(SinkWindow(sinks=s, window=w, every=1), model=ours)}, **GREEDY
    )
    cache, tokens = DynamicCache(), [ids]
    with torch.no_grad():
        logits = ref(ids, **{CACHE_ARG: cache}).logits[:, -1]
        for _ in range(new - 1):
            tokens.append(logits.argmax(-1, keepdim=True))
            p = cache.get_seq_length()
            keys = torch.arange(p + 1)
            visible = (keys < s) | (keys >= p - w)  # [p + 1]
            mask = visible.expand(2, 1, 1, p + 1)
            logits = ref(
                tokens[-1], **{CACHE_ARG: cache}, attention_mask=mask, position_ids=torch.full((2, 1), p)
            ).logits[:, -1]
        tokens.append(logits.argmax(-1, keepdim=True))
    assert torch.equal(got[:, : 11 + new], torch.cat(tokens, 1))


def test_ragged_batch_equals_each_prompt_alone():
    _, ours = _pair()
    lengths = (12, 7, 10)
    ids, mask = _padded_batch(lengths)
    policy = A2SF(budget=0.5, recent=2, alpha=0.9, every=2)  # a share: each prompt's own budget
    batch = ours.generate(
        ids, attention_mask=mask, **{CACHE_ARG: EvictingCache(policy, model=ours)}, **GREEDY
    )
    for b, n in enumerate(lengths):
        alone = ours.generate(
            ids[b : b + 1, -n:], **{CACHE_ARG: EvictingCache(policy, model=ours)}, **GREEDY
        )
        assert torch.equal(batch[b, -(n + 16) :], alone[0])


@pytest.mark.parametrize("arch", ["fox-pro", "transformer-llama", "castle", "castle-swl"])
def test_lapse_adapter_equals_lapse_generate_under_policies(arch):
    torch.manual_seed(0)
    model = LapseForCausalLM(
        LapseConfig.from_model_config(preset("tiny", arch, init_std=0.1, n_kv_heads=2))
    ).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    policies = [Dense(), H2O(budget=8, recent=2), A2SF(budget=0.5, recent=2, alpha=0.5, every=3),
                SinkWindow(sinks=2, window=6, every=2)]
    if arch == "fox-pro":
        policies.append(ACPBoundary(eps=1e-3, every=4))
    for policy in policies:
        out = model.generate(
            ids, **{CACHE_ARG: EvictingCache(policy, model=model)}, max_new_tokens=12, do_sample=False
        )
        assert torch.equal(out, generate(model.model, ids, 12, policy=policy)), policy
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    policy = H2O(budget=8, recent=2)
    out = model.generate(
        ids,
        attention_mask=mask,
        **{CACHE_ARG: EvictingCache(policy, model=model)},
        max_new_tokens=10,
        do_sample=False,
    )
    assert torch.equal(out[0, 5:], generate(model.model, ids[:1, 5:], 10, policy=policy)[0])


def test_bad_input():
    ref, ours = _pair()
    ids, mask = _padded_batch()
    with pytest.raises(ValueError, match="ACPBoundary .* llama model"):
        EvictingCache(ACPBoundary(), model=ours)
    with pytest.raises(ValueError, match="budget must be a positive"):
        H2O(budget=0)
    with pytest.raises(ValueError, match="budget must be a positive"):
        A2SF(budget=-0.5)
    with pytest.raises(TypeError, match="policy"):
        EvictingCache("h2o")
    with pytest.raises(ValueError, match="max_context"):
        EvictingCache(Dense(), max_context=0)
    with pytest.raises(RuntimeError, match="did not go through 'lapse_paged'"):
        ref.generate(ids, attention_mask=mask, **{CACHE_ARG: EvictingCache(Dense())}, **GREEDY)
    with pytest.raises(ValueError, match="leaves no room"):
        ours.generate(
            ids,
            attention_mask=mask,
            **{CACHE_ARG: EvictingCache(Dense(), model=ours, max_context=12)},
            **GREEDY,
        )
    with pytest.raises(NotImplementedError, match="beam search"):
        ours.generate(
            ids,
            attention_mask=mask,
            **{CACHE_ARG: EvictingCache(Dense(), model=ours)},
            num_beams=2,
            max_new_tokens=4,
            pad_token_id=0,
        )
    _, sliding = _pair("mistral")
    sliding.config.sliding_window = 16
    with pytest.raises(ValueError, match="sliding window of 16"):
        sliding.generate(
            ids, attention_mask=mask, **{CACHE_ARG: EvictingCache(Dense(), model=sliding)}, **GREEDY
        )
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="got a gpt2 model"):
        EvictingCache(H2O(budget=8, recent=2), model=gpt2)


@pytest.mark.gpu
def test_dense_equals_dynamic_cache_on_cuda():
    """The Triton paged decode op under Hugging Face's generate (float32, left padding)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ref, ours = (m.cuda() for m in _pair())
    ids, mask = (x.cuda() for x in _padded_batch())
    expected = ref.generate(ids, attention_mask=mask, **GREEDY)
    got = ours.generate(
        ids, attention_mask=mask, **{CACHE_ARG: EvictingCache(Dense(), model=ours)}, **GREEDY
    )
    assert torch.equal(got, expected)
    cache = Watched(H2O(budget=6, recent=2), model=ours)
    ours.generate(ids, attention_mask=mask, **{CACHE_ARG: cache}, **GREEDY)
    assert max(cache.after_evictions) <= 6
