"""CASTLE and CASTLE-SWL models decoding over the paged store, under eviction policies.

- ``Dense`` over a PagedStore gives the DenseStore's tokens and logits (the same float32
  math up to summation order: measured below 1e-6 here; held to ATOL32, the tolerance of
  cached against uncached logits in tests/generation/test_generate.py), ragged batches too.
- ``SinkWindow``: an evicted slot is no longer attended to and takes no more lookahead
  updates, while a kept slot was held at every earlier step, so its ``u`` is the full
  sum ``u^t_j = sum_{j < m <= t} ...`` over every later token, evicted ones included.
  Generation with eviction before every step therefore equals one uncached forward over
  the generated sequence whose attention (not lookahead) mask drops, for each query
  past the prompt, the keys outside the sinks and the window: the reference below, the
  parallel form (SPEC section 5, Theorem 1) with that mask, written here in float64. The
  bytes held stop growing once the window is full.
- H2O / A2SF run with CASTLE's own prompt scores and keep their budget; ACPBoundary and
  DCPDrop refuse CASTLE in one line; the paged step compiles whole (aot_eager).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lapse.generation import (
    A2SF,
    H2O,
    ACPBoundary,
    DCPDrop,
    Dense,
    SinkWindow,
    decode_one_token,
    evict,
    generate,
    paged_store_for,
    prefill,
)
from lapse.models import Decoder, preset

pytestmark = pytest.mark.usefixtures("one_thread")
ATOL32 = 2e-5

CASES = {
    "castle": ("castle", {}),
    "castle-gqa": ("castle", {"n_heads": 4, "n_kv_heads": 2}),
    "swl": ("castle-swl", {"castle_window": 3}),
    "swl-gqa": ("castle-swl", {"castle_window": 5, "n_heads": 4, "n_kv_heads": 2}),
}


def _model(name: str) -> Decoder:
    arch, overrides = CASES[name]
    torch.manual_seed(0)
    return Decoder(preset("tiny", arch, init_std=0.1, **overrides)).eval()


def _ids(model: Decoder, b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CASES)
def test_dense_policy_over_the_paged_store_equals_the_dense_store(name):
    model = _model(name)
    ids = _ids(model, 2, 9)
    out, logits = generate(model, ids, 16, return_logits=True)
    store = paged_store_for(model, 2, 9, 16, Dense())
    got, got_logits = generate(model, ids, 16, return_logits=True, policy=Dense(), cache=store)
    assert store.k[0] is not None and "u" in store.extras[0] and "q_u" in store.extras[0]
    assert torch.equal(got, out)
    torch.testing.assert_close(got_logits, logits, atol=ATOL32, rtol=0)


def test_ragged_batch_over_the_paged_store_equals_the_dense_store():
    model = _model("swl-gqa")
    lengths = [7, 2, 5]
    ids = _ids(model, 3, 7)
    out, logits = generate(model, ids, 8, lengths=lengths, return_logits=True)
    got, got_logits = generate(model, ids, 8, lengths=lengths, return_logits=True, policy=Dense())
    assert torch.equal(got, out)
    torch.testing.assert_close(got_logits, logits, atol=ATOL32, rtol=0)


def _masked_castle(q_c, k_c, v_c, q_u, k_u, v_u, scale, window, mask):
    """CASTLE's parallel form (Theorem 1) with an extra attention mask ``[T, T]`` on the
    causal softmax, float64: the lookahead sums run over every later token."""
    h, dtype = q_c.shape[2], q_c.dtype
    qc, kc, vc, qu, ku, vu = (x.repeat_interleave(h // x.shape[2], dim=2).transpose(1, 2).double()
                              for x in (q_c, k_c, v_c, q_u, k_u, v_u))  # [B, H, T, D]
    t = qc.shape[2]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    look = i < j  # rows s, columns m: s < m
    if window is not None:
        look = look & (j <= i + window)
    a = torch.where(i >= j, qc @ vu.transpose(-1, -2) * scale, 0.0)  # [B, H, T(query), T(m)]
    g = torch.where(look, torch.sigmoid(qu @ ku.transpose(-1, -2) * scale), 0.0)  # [B, H, T(s), T(m)]
    s_u = a @ g.transpose(-1, -2)  # [B, H, T(query), T(s)]
    z = qc @ kc.transpose(-1, -2) * scale - F.silu(s_u)
    z = z.masked_fill(~((j <= i) & mask), float("-inf"))
    return (torch.softmax(z, -1) @ vc).transpose(1, 2).to(dtype)


@pytest.mark.parametrize("name", CASES)
def test_sink_window_equals_full_castle_with_the_matching_mask(name):
    model = _model(name)
    t, n, sinks, window = 12, 14, 2, 5
    ids = _ids(model, 2, t, seed=3)
    policy = SinkWindow(sinks=sinks, window=window, every=1)
    out, logits = generate(model, ids, n, return_logits=True, policy=policy)
    length = t + n - 1
    p, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    mask = (p < t) | (j < sinks) | (j >= p - window)  # what eviction before every step leaves
    with torch.no_grad():
        unmasked, _ = model(out[:, :-1])
        for block in model.blocks:
            attn = block.attn
            attn._full = lambda *xs, attn=attn: _masked_castle(*xs, attn.scale, attn.window, mask)
        ref, _ = model(out[:, :-1])
    torch.testing.assert_close(logits, ref[:, t - 1 :], atol=ATOL32, rtol=0)
    assert (logits - unmasked[:, t - 1 :]).abs().max() > 100 * ATOL32  # the eviction mattered


def test_sink_window_bounds_the_memory():
    model = _model("castle-gqa")
    policy = SinkWindow(sinks=2, window=8, every=4)
    ids = _ids(model, 2, 20)
    store = paged_store_for(model, 2, 20, 48, policy)
    token = prefill(model, ids, store).argmax(-1, keepdim=True)
    held = []
    for i in range(47):
        if i % policy.every == 0:
            evict(model, store, policy)
            store.reserve(policy.every)
            held.append(store.bytes_held())
        token = decode_one_token(model, token, store).argmax(-1, keepdim=True)
    assert max(held[1:]) == held[1] < store.bytes_if_dense() / 3  # flat after the prompt's cut
    assert int(store.lengths[0].max()) <= 2 + 8 + policy.every


@pytest.mark.parametrize("policy", [H2O(budget=10, recent=3, sinks=1), A2SF(budget=0.5, recent=2, alpha=0.8)],
                         ids=["h2o", "a2sf"])
def test_h2o_and_a2sf_run_within_their_budget(policy):
    model = _model("swl-gqa")
    ids = _ids(model, 2, 20)
    store = paged_store_for(model, 2, 20, 12, policy)
    prefill(model, ids, store)
    scores = store.snapshot(0).scores  # the prompt's CASTLE scores, before any cut
    g = model.config.n_heads // model.config.kv_heads
    weights = policy.alpha ** torch.arange(19, -1, -1, dtype=torch.float64)
    total = torch.full((2, 2), g * float(weights.sum()), dtype=torch.float64)  # every row sums to 1
    torch.testing.assert_close(scores.sum(-1).double(), total, rtol=1e-5, atol=1e-5)
    out = generate(model, ids, 12, policy=policy)
    assert out.shape == (2, 32)
    store = paged_store_for(model, 2, 20, 12, policy)
    generate(model, ids, 12, policy=policy, cache=store)
    assert int(store.lengths[0].max()) <= policy.tokens(20) + policy.every


def test_acp_and_dcp_policies_refuse_castle():
    model = _model("castle")
    ids = _ids(model, 1, 6)
    with pytest.raises(ValueError, match="ACPBoundary needs forgetting attention"):
        generate(model, ids, 2, policy=ACPBoundary())
    with pytest.raises(ValueError, match="DCPDrop needs DCP attention"):
        generate(model, ids, 2, policy=DCPDrop())


@pytest.mark.parametrize("name", ["castle-gqa", "swl"])
def test_compiled_paged_step_equals_eager(name, compiled_paged_steps_match_eager):
    """The paged CASTLE step traces whole (fullgraph), eviction between steps."""
    model = _model(name)
    compiled_paged_steps_match_eager(model, _ids(model, 2, 16), SinkWindow(sinks=2, window=8, every=4), 11,
                                     atol=ATOL32)


def test_fold_every_runs_the_immediate_update_over_the_paged_store():
    """The deferred update is a DenseStore feature: over a PagedStore the layer adds each
    token into every held ``u`` at once (the same outputs up to summation order)."""
    torch.manual_seed(0)
    model = Decoder(preset("tiny", "castle", init_std=0.1, castle_fold_every=4)).eval()
    ids = _ids(model, 2, 9)
    out, logits = generate(model, ids, 12, return_logits=True)  # deferred, DenseStore
    got, got_logits = generate(model, ids, 12, return_logits=True, policy=Dense())
    assert torch.equal(got, out)
    torch.testing.assert_close(got_logits, logits, atol=ATOL32, rtol=0)
