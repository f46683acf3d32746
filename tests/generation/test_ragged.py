"""Ragged batches: prompts of different lengths in one batch, right-padded, with
``lengths``. Each sequence must come out exactly as it would alone,
over the dense store and the paged one, for every architecture and policy (CPU).
"""

from __future__ import annotations

import pytest
import torch

from lapse.generation import A2SF, H2O, ACPBoundary, Dense, SinkWindow, generate, paged_store_for
from lapse.kv import DenseStore
from lapse.models import ARCHS, Decoder, preset

pytestmark = pytest.mark.usefixtures("one_thread")
ATOL32 = 2e-5  # as tests/generation/test_generate.py: the same math, batched differently
LENGTHS = [9, 3, 14, 1]  # the longest not first, a one-token prompt


def _model(arch: str, **overrides) -> Decoder:
    torch.manual_seed(0)
    return Decoder(preset("tiny", arch, init_std=0.1, n_kv_heads=2, **overrides)).eval()


def _ragged(vocab: int, pad: int = 7) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]
    ids = torch.full((len(LENGTHS), max(LENGTHS)), pad)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    return ids, prompts


def _check_rows_equal_alone(model, policy=None, n_new=12, **kw):
    ids, prompts = _ragged(model.config.vocab_size)
    out, logits = generate(model, ids, n_new, lengths=LENGTHS, return_logits=True, policy=policy, **kw)
    assert out.shape == (len(LENGTHS), max(LENGTHS) + n_new)
    for b, p in enumerate(prompts):
        alone, alone_logits = generate(model, p[None], n_new, return_logits=True, policy=policy, **kw)
        n = len(p) + n_new
        assert torch.equal(out[b, :n], alone[0]), f"row {b} differs from its prompt generated alone"
        assert (out[b, n:] == 0).all(), "the padding after a row is pad_token_id (0)"
        torch.testing.assert_close(logits[b], alone_logits[0], atol=ATOL32, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_equals_each_prompt_alone_dense_store(arch):
    _check_rows_equal_alone(_model(arch))


@pytest.mark.parametrize(
    "arch,policy",
    [
        ("transformer-llama", Dense()),
        ("fox-pro", SinkWindow(sinks=2, window=6, every=2)),
        ("transformer-pro", H2O(budget=5, recent=2, sinks=1)),
        ("fox-llama", A2SF(budget=0.5, recent=2, alpha=0.8)),  # a share: each prompt its own budget
        ("fox-pro", ACPBoundary(every=3)),
        ("castle-swl", H2O(budget=5, recent=2, sinks=1)),  # CASTLE's own prompt scores
    ],
    ids=["dense", "window", "h2o", "a2sf-share", "acp", "castle-h2o"],
)
def test_ragged_batch_equals_each_prompt_alone_paged_store(arch, policy):
    model = _model(arch, acp=True) if isinstance(policy, ACPBoundary) else _model(arch)
    _check_rows_equal_alone(model, policy)


def test_ragged_prefill_holds_no_padding():
    model = _model("fox-pro")
    ids, _ = _ragged(model.config.vocab_size)
    policy = SinkWindow(sinks=1, window=64)
    store = paged_store_for(model, len(LENGTHS), max(LENGTHS), 4, policy)
    generate(model, ids, 4, lengths=LENGTHS, policy=policy, cache=store)
    # 3 tokens generated after each prompt, the 4th drawn but never appended
    assert store.seqlens.tolist() == [n + 3 for n in LENGTHS]
    for i in range(model.config.n_layers):
        assert store.lengths[i].tolist() == [[n + 3] * 2 for n in LENGTHS]
    snap = store.snapshot(0)
    for b, n in enumerate(LENGTHS):
        assert torch.equal(snap.positions[b, 0][snap.valid[b, 0]], torch.arange(n + 3))
    dense = DenseStore(model.config.n_layers)
    generate(model, ids, 4, lengths=LENGTHS, cache=dense)
    assert dense.seqlens.tolist() == [n + 3 for n in LENGTHS]


def test_ragged_errors_are_one_clear_line():
    model = _model("transformer-llama")
    ids, _ = _ragged(model.config.vocab_size)
    with pytest.raises(ValueError, match=r"lengths must be 4 integers in \[1, 14\]"):
        generate(model, ids, 2, lengths=[9, 3, 15, 1])
    with pytest.raises(ValueError, match="lengths must be 4 integers"):
        generate(model, ids, 2, lengths=[9, 3])
    store = DenseStore(model.config.n_layers)
    generate(model, ids, 2, lengths=LENGTHS, cache=store)
    with pytest.raises(ValueError, match="taken by the first forward only"):
        model(ids[:, :2], cache=store, lengths=torch.tensor([1, 2, 1, 2]))


def test_castle_generates_over_the_paged_store():
    """CASTLE's lookahead keys change after they are written; its paged step updates them
    in their pages: a ragged batch under the dense policy and under a window it never
    fills gives the DenseStore's tokens."""
    model = _model("castle", acp=False)
    ids, _ = _ragged(model.config.vocab_size)
    out = generate(model, ids, 6, lengths=LENGTHS)
    assert torch.equal(generate(model, ids, 6, lengths=LENGTHS, policy=Dense()), out)
    assert torch.equal(generate(model, ids, 6, lengths=LENGTHS, policy=SinkWindow(sinks=1, window=64)), out)
