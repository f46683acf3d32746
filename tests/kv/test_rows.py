"""Row-slot mode of the paged store (``PagedStore(rows=N)``): sequences prefilled in stores
of their own join a fixed batch between steps (:meth:`PagedStore.admit`) and leave it
(:meth:`PagedStore.release`). A row decodes exactly as its own store would, a free row owns
no page, and every page comes back."""

from __future__ import annotations

import pytest
import torch

from lapse.generation import H2O, Dense, decode_one_token, evict, paged_store_for, prefill
from lapse.kv import PagedStore
from lapse.kv.extras import GateState, LookaheadRing
from lapse.models import Decoder, preset

pytestmark = pytest.mark.usefixtures("one_thread")
ROWS, PAGES = 3, 24


@pytest.fixture(scope="module")
def model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(preset("tiny", "fox-pro", init_std=0.1, n_kv_heads=2)).double().eval()


def _own_store(model: Decoder, prompt: torch.Tensor, n_new: int, policy=None):
    """A prompt prefilled alone (what ``generate`` builds), with pages for ``n_new`` steps;
    returns the store and the prompt's last logits."""
    store = paged_store_for(model, 1, len(prompt), n_new, policy or Dense())
    logits = prefill(model, prompt[None], store)
    store.reserve(n_new)
    return store, logits


def _rows_store(model: Decoder, score_decay=None) -> PagedStore:
    return PagedStore(model.config.n_layers, max_context=64, pages=PAGES, score_decay=score_decay, rows=ROWS)


def _free_pages(store: PagedStore) -> list[int]:
    store.settle()
    return [len(store._free[i]) for i in range(store.n_layers)]


def _check_free_rows(store: PagedStore) -> None:
    """Free rows own no page and hold one token on the scratch page."""
    free = ~store._active
    for i in range(store.n_layers):
        assert (store._count[i][free] == 0).all()
        table = store.page_table[i][torch.from_numpy(free)]
        assert (table[:, :, 0] == store.k[i].shape[0] - 1).all() and (table[:, :, 1:] == -1).all()
        assert (store.lengths[i][torch.from_numpy(free)] == 1).all()


def test_rows_decode_as_their_own_stores_and_give_every_page_back(model):
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in (11, 5, 20)]
    feed = torch.randint(0, vocab, (3, 12), generator=gen)  # the tokens each row is fed, step by step
    store = _rows_store(model)
    own: dict[int, tuple] = {}  # row -> (its own store, sequence index, steps taken)

    def join(row: int, seq: int) -> None:
        sub, logits = _own_store(model, prompts[seq], 12)
        store.admit(row, sub, max_tokens=len(prompts[seq]) + 12)
        own[row] = (sub, seq, 0)

    def step() -> None:
        tokens = torch.zeros(ROWS, 1, dtype=torch.long)
        for row, (_, seq, i) in own.items():
            tokens[row, 0] = feed[seq, i]
        logits = decode_one_token(model, tokens, store)  # [rows, V]
        for row, (sub, seq, i) in list(own.items()):
            alone = decode_one_token(model, feed[seq, i : i + 1][None], sub)  # [1, V]
            torch.testing.assert_close(logits[row], alone[0], atol=1e-12, rtol=0)
            own[row] = (sub, seq, i + 1)

    join(1, 0)
    _check_free_rows(store)
    step()
    step()
    join(0, 1)  # joins between steps, into a lower row
    step()
    _check_free_rows(store)
    store.release(1)
    del own[1]
    _check_free_rows(store)
    step()
    join(2, 2)
    join(1, 0)  # a released row taken again: its states and pages are the new sequence's
    for _ in range(3):
        step()
        _check_free_rows(store)
    for row in list(own):
        store.release(row)
    assert _free_pages(store) == [PAGES] * model.config.n_layers
    assert all((c == 0).all() for c in store._count)
    _check_free_rows(store)


def test_admit_copies_states_and_refuses_what_does_not_fit(model):
    prompt = torch.arange(1, 18)
    sub, _ = _own_store(model, prompt, 4)
    store = _rows_store(model)
    store.admit(2, sub)
    for i in range(model.config.n_layers):
        mine, theirs = store.states[i]["GateState"], sub.states[i]["GateState"]
        assert mine.c_last.shape[0] == ROWS
        assert torch.equal(mine.c_last[2], theirs.c_last[0]) and (mine.c_last[:2] == 0).all()
        assert torch.equal(store.states[i]["ShiftState"].k_prev[2], sub.states[i]["ShiftState"].k_prev[0])
    assert int(store.seqlens[2]) == 17 and int(store.prompt_lens[2]) == 17
    with pytest.raises(ValueError, match="free row"):
        store.admit(2, sub)
    small = PagedStore(model.config.n_layers, max_context=64, pages=1, rows=2)
    with pytest.raises(RuntimeError, match="free pages"):
        small.admit(0, sub)
    assert [len(f) for f in small._free] == [1] * model.config.n_layers  # nothing granted
    assert not small._active.any()
    with pytest.raises(ValueError, match="occupied row"):
        store.release(0)


def test_free_rows_take_no_pages_through_reserve_and_trim(model):
    sub, _ = _own_store(model, torch.arange(1, 40), 8)
    store = _rows_store(model)
    store.admit(1, sub, max_tokens=48)
    store.reserve(8)
    _check_free_rows(store)
    assert (store._count[0][1] == 3).all()  # 39 + 8 tokens: 3 pages of 16 per head
    store.reserve(30)  # capped at the row's max_tokens: 48 tokens
    assert (store._count[0][1] == 3).all()
    store.trim()  # pages past the tokens back; the free rows' scratch column stays
    _check_free_rows(store)
    assert (store._count[0][1] == 3).all()  # 39 tokens fill 3 pages


def test_eviction_passes_only_the_due_rows_each_to_its_budget(model):
    policy = H2O(budget=6, recent=2, sinks=1)
    store = _rows_store(model, score_decay=policy.score_decay)
    subs = []
    for row, n in ((0, 20), (2, 25)):
        sub, _ = _own_store(model, torch.arange(1, n + 1), 4, policy)
        store.admit(row, sub, budget=8)
        subs.append(sub)
    before = [store.lengths[i].clone() for i in range(model.config.n_layers)]
    store.row_due[2] = True
    evict(model, store, policy)
    for i in range(model.config.n_layers):
        assert torch.equal(store.lengths[i][0], before[i][0])  # not due: keeps all
        assert (store.lengths[i][2] == 8).all()  # its own budget, not the policy's 6
        assert (store.lengths[i][1] == 1).all()
    store.release(0)
    store.release(2)
    assert _free_pages(store) == [PAGES] * model.config.n_layers


def test_row_state_helpers():
    ring = LookaheadRing()
    ring.ensure(torch.zeros(1, 1, 2, 4), 3)
    ring.pos.fill_(5)
    rows = LookaheadRing.alloc_rows(ring, 4)
    assert rows.k.shape == (4, 3, 2, 4) and (rows.pos == -1).all()
    rows.copy_row(2, ring, 0)
    assert (rows.pos[2] == 5).all() and (rows.pos[[0, 1, 3]] == -1).all()
    rows.reset_rows([2])
    assert (rows.pos == -1).all()
    gate = GateState()
    gate.ensure(1, 3, torch.device("cpu")).fill_(-2.0)
    many = GateState.alloc_rows(gate, 2)
    many.copy_row(1, gate, 0)
    assert many.c_last.dtype == torch.float64 and many.c_last[1].eq(-2).all() and many.c_last[0].eq(0).all()
