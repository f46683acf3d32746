"""The paged store on its own: writes through the page table, compaction on eviction,
pages returned to the pool and reused by another sequence, clear errors when full."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numpy import array as np_array
from numpy import full as np_full
from torch.utils._python_dispatch import TorchDispatchMode

from lapse.generation import A2SF, H2O, SinkWindow
from lapse.kv import KVCache, PagedStore
from lapse.kv.paged import _slots


def _fill(store: PagedStore, b: int, t: int, start: int) -> None:
    """Appends t tokens to layer 0 whose every key entry is its position (h and b encoded too)."""
    store.begin(b, t, torch.device("cpu"))
    pos = torch.arange(start, start + t, dtype=torch.float32)
    k = (
        pos[None, :, None, None]
        + 1000 * torch.arange(2.0)[None, None, :, None]
        + 10000 * torch.arange(b * 1.0)[:, None, None, None]
    )
    k = k.expand(b, t, 2, 4).clone()
    c = -pos[None, :, None].expand(b, t, 4).double()  # [B, T, HQ = 4]: G = 2 per kv head
    store.append(0, k, -k, c=c)
    store.advance()


def _held(store: PagedStore) -> torch.Tensor:
    snap = store.snapshot(0)
    return snap.positions, snap.valid


def _filled_holes(positions: torch.Tensor, keep: torch.Tensor) -> list[int]:
    """What a head holds after a compaction, written out plainly: the kept slots below the
    new length stay; the k-th kept slot past it goes to the k-th dropped slot below it."""
    held = positions.tolist()
    kept = [i for i, k in enumerate(keep.tolist()) if k]
    n = len(kept)
    holes = [i for i in range(n) if i not in kept]
    movers = [i for i in kept if i >= n]
    out = held[:n]
    for hole, mover in zip(holes, movers, strict=True):
        out[hole] = held[mover]
    return out


def test_paged_store_writes_through_the_table_and_compacts_on_eviction():
    store = PagedStore(1, max_context=200, page_size=16)
    assert isinstance(store, KVCache)
    _fill(store, 2, 40, 0)
    _fill(store, 2, 1, 40)
    view = store.view(0)
    assert view.lengths.tolist() == [[41, 41], [41, 41]] and view.seqlens.tolist() == [41, 41]
    positions, valid = _held(store)
    assert torch.equal(positions[valid].view(2, 2, 41), torch.arange(41).expand(2, 2, 41))
    keep = (positions % 3 == 0) & valid
    keep[1, 1] = valid[1, 1] & (positions[1, 1] >= 30)  # heads keep different numbers of tokens
    free_before = len(store._free[0])
    expected = [[_filled_holes(positions[b, h], keep[b, h]) for h in range(2)] for b in range(2)]
    store.evict(0, keep)
    assert store.lengths[0].tolist() == [[14, 14], [14, 11]]
    positions, valid = _held(store)
    assert positions[0, 0, :14].tolist() == expected[0][0]
    assert sorted(expected[0][0]) == list(range(0, 41, 3))
    assert positions[1, 1, :11].tolist() == expected[1][1] == list(range(30, 41))  # moved in order
    # keys and FoX c moved with their positions
    pages, offsets, _ = _slots(store._tensors(0), *store._meta(0)[:2])
    k = store.k[0][pages, offsets][..., 0]  # [B, H, W]
    assert k[1, 1, :11].tolist() == [p + 1000 + 10000 for p in range(30, 41)]
    assert k[0, 1, :14].tolist() == [p + 1000 for p in expected[0][1]]
    c = store.extras[0]["c"][pages, offsets]  # [B, H, W, G]
    assert c[0, 1, :14, 1].tolist() == [-float(p) for p in expected[0][1]]
    assert len(store._free[0]) == free_before  # the host's lists catch up when settled
    store.settle()
    assert len(store._free[0]) == free_before + 2 * 2 * 2  # 3 pages per head before, 1 after
    assert store.bytes_held() < store.bytes_if_dense()


def test_a_store_that_evicted_nothing_holds_all_of_a_dense_one():
    """bytes_if_dense counts whole pages, as bytes_held does: 41 tokens fill 3 pages a head on
    both sides (against the 41 tokens alone, keeping everything read 117%); pages reserved for
    coming steps count until they are given back."""
    store = PagedStore(1, max_context=200, page_size=16)
    _fill(store, 2, 40, 0)
    _fill(store, 2, 1, 40)
    per_slot = sum(pool[0, 0].numel() * pool.element_size()
                   for pool in (store.k[0], store.v[0], *store.extras[0].values()))
    assert store.bytes_if_dense() == store.bytes_held() == per_slot * 2 * 2 * 3 * 16  # B, H, pages, slots
    store.reserve(30)
    assert store.bytes_held() > store.bytes_if_dense()
    store.trim()
    assert store.bytes_held() == store.bytes_if_dense()


def test_freed_pages_are_reused_and_a_full_pool_says_so():
    store = PagedStore(1, max_context=1000, max_tokens=64, pages=6, page_size=16)
    _fill(store, 1, 48, 0)  # 2 heads x 3 pages: the whole pool
    positions, valid = _held(store)
    store.evict(0, valid & (positions >= 40))
    store.settle()
    assert len(store._free[0]) == 4
    for start in range(48, 48 + 40):  # 40 more tokens in pages the eviction freed
        _fill(store, 1, 1, start)
    positions, valid = _held(store)
    assert positions[0, 0, : int(store.lengths[0][0, 0])].tolist() == list(range(40, 88))
    with pytest.raises(RuntimeError, match="page pool of layer 0 is full"):
        _fill(store, 1, 1, 88)  # a 4th page per head: none is free


def test_store_errors():
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        PagedStore(1, max_context=10, page_size=24)
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        PagedStore(1, max_context=10, max_tokens=20)
    store = PagedStore(1, max_context=32, max_tokens=16)
    with pytest.raises(ValueError, match="more than max_tokens = 16"):
        _fill(store, 1, 20, 0)
    with pytest.raises(ValueError, match="exceed the store's max_context"):
        _fill(PagedStore(1, max_context=8), 1, 9, 0)


def test_whole_page_eviction_drops_leading_pages_without_moving_tokens():
    """A suffix keep: each head loses the leading pages that keep nothing (the table shifts,
    no token moves); the page that holds the boundary stays whole; the pages go back to
    the pool and are reused."""
    store = PagedStore(1, max_context=200, page_size=16)
    _fill(store, 2, 70, 0)  # 5 pages per head, the last one partly filled
    positions, valid = _held(store)
    k_before = store.k[0].clone()
    boundary = torch.tensor([[0, 20], [33, 69]])  # [B, H]: keep positions >= boundary
    store.evict(0, valid & (positions >= boundary[..., None]), whole_pages=True)
    lengths = store.lengths[0]
    assert lengths.tolist() == [[70, 54], [38, 6]]  # 0, 1, 2 and 4 whole pages dropped
    positions, valid = _held(store)
    for b in range(2):
        for h in range(2):
            n = int(lengths[b, h])
            first = int(boundary[b, h]) // 16 * 16
            assert positions[b, h, :n].tolist() == list(range(first, 70))
    assert torch.equal(store.k[0], k_before)  # nothing moved
    store.settle()
    assert len(store._free[0]) == 0 + 1 + 2 + 4 + (store.k[0].shape[0] - 1 - 4 * 5)
    count, pages = store._count[0], store._pages[0]
    owned = [p for b in range(2) for h in range(2) for p in pages[b, h, : count[b, h]].tolist()]
    assert owned == store.page_table[0][store.page_table[0] >= 0].tolist()  # the host mirrors the table
    assert len(owned) == len(set(owned)) == 5 + 4 + 3 + 1
    for start in range(70, 90):  # later tokens land in reused pages after the kept ones
        _fill(store, 2, 1, start)
    positions, valid = _held(store)
    assert positions[1, 1, : int(store.lengths[0][1, 1])].tolist() == list(range(64, 90))


def test_two_whole_page_evictions_before_a_settle_free_both_fronts():
    """Each pass shifts the device table by the pages it drops; the host's lists catch up
    at the next settle by the sum of both shifts (the second pass's drops were lost, and
    its pages both owned and free, when it replaced the first's)."""
    store = PagedStore(1, max_context=200, page_size=16)
    _fill(store, 2, 70, 0)
    for boundary in (20, 40):  # 1 page dropped, then 1 more (of the shifted table)
        positions, valid = _held(store)
        store.evict(0, valid & (positions >= boundary), whole_pages=True)
    assert store.lengths[0].tolist() == [[38, 38], [38, 38]]
    _check_accounting(store)
    assert len(store._free[0]) == store.k[0].shape[0] - 1 - 4 * 3


def test_the_free_page_stack_pops_what_a_list_would_and_refuses_a_double_free():
    from lapse.kv.paged import _PageStack

    stack, plain = _PageStack(6), list(range(5, -1, -1))
    for n, freed in ((2, [9]), (3, []), (1, [7, 8])):
        got = stack.pop(n)
        want = plain[-n:][::-1]
        del plain[-n:]
        assert got.tolist() == want
        stack.push(np_array(freed))
        plain.extend(freed)
        assert stack.tolist() == plain
    with pytest.raises(RuntimeError, match="asked of"):
        stack.pop(len(stack) + 1)
    full = _PageStack(2)
    with pytest.raises(RuntimeError, match="freed twice"):
        full.push(np_array([5]))
    assert full.tolist() == [1, 0] and (full == _PageStack(2)) and full.__eq__([1, 0]) is NotImplemented


def test_whole_page_eviction_after_a_compaction_says_the_order_is_lost():
    store = PagedStore(1, max_context=200, page_size=16)
    _fill(store, 1, 40, 0)
    positions, valid = _held(store)
    store.evict(0, valid & (positions % 2 == 0))
    with pytest.raises(ValueError, match="was compacted"):
        store.evict(0, valid, whole_pages=True)


def _check_accounting(store: PagedStore) -> None:
    """The host's page lists mirror the device table, and every page of the pool (but
    the scratch page) is either free or owned by exactly one (sequence, head)."""
    store.settle()
    count, pages, table = store._count[0], store._pages[0], store.page_table[0]
    b, h, width = table.shape
    for i in range(b):
        for j in range(h):
            n = int(count[i, j])
            assert table[i, j, :n].tolist() == pages[i, j, :n].tolist()
            assert (table[i, j, n:] == -1).all()
            assert n == -(-int(store.lengths[0][i, j]) // store.page_size)
    owned = table[table >= 0].tolist()
    assert sorted(owned + store._free[0].tolist()) == list(range(store.k[0].shape[0] - 1))


@pytest.mark.parametrize("whole_pages", [False, True], ids=["compact", "whole-pages"])
def test_host_page_accounting_follows_random_evictions(whole_pages):
    """Ragged random evictions (per head) and growth, many rounds: the vectorised host
    accounting (settle, reserve) stays the device table's mirror, no page lost or shared."""
    g = torch.Generator().manual_seed(5)
    store = PagedStore(1, max_context=400, page_size=16, pages=3 * 2 * 10)
    _fill(store, 3, 37, 0)
    _check_accounting(store)
    start = 37
    for _ in range(12):
        snap = store.snapshot(0)
        if whole_pages:  # a suffix from a random boundary per head
            cut = torch.randint(0, 40, snap.valid.shape[:2], generator=g)
            keep = snap.positions >= (snap.seqlens[:, None, None] - cut[..., None])
        else:
            keep = torch.rand(snap.valid.shape, generator=g) < 0.6
        k_before = store.k[0].clone()
        expected = [[_filled_holes(snap.positions[i, j], keep[i, j] & snap.valid[i, j]) for j in range(2)]
                    for i in range(3)]
        store.evict(0, keep, whole_pages=whole_pages)
        _check_accounting(store)
        if not whole_pages:  # the fewest moves: one row written per hole, nothing else touched
            held, valid = _held(store)
            for i in range(3):
                for j in range(2):
                    assert held[i, j][valid[i, j]].tolist() == expected[i][j]
            n_kept = (keep & snap.valid).sum(-1, keepdim=True)
            holes = (torch.arange(keep.shape[-1]) < n_kept) & ~keep
            assert int((store.k[0] != k_before).any(-1).sum()) == int(holes.sum()) > 0
        store.reserve(7)
        for _ in range(7):
            _fill(store, 3, 1, start)
            start += 1
        _check_accounting(store)


@pytest.mark.parametrize("ragged", [False, True])
def test_a_prompt_written_without_indices_equals_the_general_write(monkeypatch, ragged):
    """The prompt's fast path (each head's pages in order, one copy per buffer) leaves the
    store exactly as the general grant and indexed write do: pools (keys, values, an extra,
    positions, scores), table, lengths and the host's lists; then a decode step on both."""
    b, t, h = 3, 37, 2
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(b, t, h, 8, generator=g), torch.randn(b, t, h, 8, generator=g)
    c = torch.randn(b, t, 2 * h, generator=g).double()
    lengths = torch.tensor([37, 5, 20]) if ragged else None

    def filled(general: bool) -> PagedStore:
        store = PagedStore(2, max_context=64, page_size=16, score_decay=0.5)
        if general:  # the grant every later step takes, then the indexed write
            monkeypatch.setattr(
                store, "_grant_prompt", lambda i, n, table_made: store._grant(i, np_full((b, h), n))
            )
        store.begin(b, t, torch.device("cpu"), lengths)
        for i in range(2):
            store.append(i, k, v, c=c)
        store.advance()
        assert store._prompt_pages == ([0, 0] if general else [3, 3])  # 37 tokens: 3 pages of 16
        store.begin(b, 1, torch.device("cpu"))
        for i in range(2):
            store.append(i, k[:, :1] + 1, v[:, :1] - 1, c=c[:, :1])
        store.advance()
        return store

    fast, general = filled(False), filled(True)
    # the second layer took the first's table, positions and lengths as copies
    assert fast._prompt_like[1] == 0  # the first layer is the one copied from
    assert fast.extras[1]["pos"] is not fast.extras[0]["pos"]
    for i in range(2):
        assert torch.equal(fast.page_table[i], general.page_table[i])
        assert torch.equal(fast.lengths[i], general.lengths[i])
        assert torch.equal(fast.k[i], general.k[i]) and torch.equal(fast.v[i], general.v[i])
        assert fast.extras[i].keys() == general.extras[i].keys() == {"c", "pos", "score"}
        for name in fast.extras[i]:
            assert torch.equal(fast.extras[i][name], general.extras[i][name]), name
        assert (fast._count[i] == general._count[i]).all() and (fast._pages[i] == general._pages[i]).all()
        assert fast._free[i] == general._free[i]


def _held_by_head(store: PagedStore, i: int) -> dict:
    """``(b, h) -> sorted [(position, k row, v row, score)]`` of the valid slots of layer ``i``."""
    pages, offsets, valid = _slots(store._tensors(i), *store._meta(i)[:2])
    k, v = store.k[i][pages, offsets], store.v[i][pages, offsets]  # [B, H, W, D]
    pos = store.extras[i]["pos"][pages, offsets]
    score = store.extras[i]["score"][pages, offsets] if "score" in store.extras[i] else torch.zeros_like(pos)
    held = {}
    for b, h in np.ndindex(*valid.shape[:2]):
        rows = valid[b, h].nonzero()[:, 0].tolist()
        held[b, h] = sorted(
            (int(pos[b, h, j]), k[b, h, j].tolist(), v[b, h, j].tolist(), float(score[b, h, j])) for j in rows
        )
    return held


@pytest.mark.parametrize(
    "policy",
    [
        None,
        H2O(budget=6, recent=2),
        A2SF(budget=0.5, recent=1, alpha=0.9, sinks=1),
        H2O(budget=5, recent=1, per="layer"),
        SinkWindow(sinks=2, window=3),
    ],
    ids=["keep-all", "h2o", "a2sf-share", "h2o-per-layer", "window"],
)
@pytest.mark.parametrize("ragged", [False, True])
def test_a_prompt_cut_before_it_is_stored_equals_append_then_evict(policy, ragged):
    """``prefill_cut`` (every layer's keep in one call, only the kept tokens written, from
    Hugging Face's heads-first layout with left padding) leaves each head holding what
    ``append`` of the whole prompt and a pass of the policy leave: the same tokens with
    their keys, values, positions and scores; and the host's pages after a settle."""
    b, t, h, d, layers = 3, 21, 2, 8, 3
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(layers, b, t, h, d, generator=g), torch.randn(layers, b, t, h, d, generator=g)
    scores = torch.rand(layers, b, t, h, generator=g)  # [L, B, T, H]: each row's tokens first
    lengths = torch.tensor([21, 6, 13]) if ragged else None
    start = None if lengths is None else t - lengths  # left padding: row b's tokens at start[b]

    def store() -> PagedStore:
        made = PagedStore(layers, max_context=40, page_size=16, score_decay=0.5)
        made.begin(b, t, torch.device("cpu"), lengths)
        return made

    general = store()
    for i in range(layers):
        general.append(i, k[i], v[i])
        general.record_prefill_scores(i, scores[i])
    general.advance()
    for i in range(layers * (policy is not None)):  # the cut after the forward, as EvictingCache ran it
        general.apply_policy(i, policy.keep)
    padded = [x.clone() for x in (k, v)]  # Hugging Face's layout: [B, H, T, D], rows left-padded
    if start is not None:
        for x in padded:
            for row, s in enumerate(start.tolist()):
                x[:, row] = torch.roll(x[:, row], s, dims=1)
    keys, values = (x.transpose(2, 3) for x in padded)  # [L, B, H, T, D]
    cut = store()
    cut.prefill_cut(
        range(layers), list(keys), list(values), None if policy is None else policy.keep, list(scores),
        start, None if policy is None else policy.max_tokens(t),
    )
    cut.advance()
    for i in range(layers):
        assert _held_by_head(cut, i) == _held_by_head(general, i)
        cut.settle(), general.settle()
        assert (cut._count[i] == -(-cut.lengths[i].numpy() // 16)).all()  # the pages its tokens fill
        if policy is not None:  # (keeping all, the general path keeps a short row's spare pages)
            assert (cut._count[i] == general._count[i]).all()
            assert len(cut._free[i]) == len(general._free[i])


class _Dispatched(TorchDispatchMode):
    """The aten operations dispatched meanwhile, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("policy", [None, SinkWindow(sinks=2, window=3)], ids=["keep-all", "window"])
def test_a_plan_shared_by_every_layer_writes_each_later_layer_with_its_keys_and_values_only(policy, layers):
    """``write_cut`` of every layer from one plan (the very same ``index`` and ``counts``, as
    ``EvictingCache`` passes a plan without scores): the first call allocates every layer and
    writes the plan's positions and lengths into each; a later layer then dispatches one
    operation per buffer that launches work (a gather, or a copy for a whole prompt), nothing
    else. The store equals ``prefill_cut``'s (a plan per layer), and no two layers' buffers
    share memory (a compiled step takes them as separate static inputs)."""
    b, t, h, d = 2, 21, 2, 8
    g = torch.Generator().manual_seed(4)
    keys, values = torch.randn(layers, b, h, t, d, generator=g), torch.randn(layers, b, h, t, d, generator=g)
    keep = None if policy is None else policy.keep
    m = None if policy is None else policy.max_tokens(t)

    def store() -> PagedStore:
        made = PagedStore(layers, max_context=40, page_size=16)
        made.begin(b, t, torch.device("cpu"))
        return made

    reference = store()
    reference.prefill_cut(range(layers), list(keys), list(values), keep, None, None, m)
    reference.advance()
    shared = store()
    index, counts = shared.plan_cut(keep, (b, h, t), torch.device("cpu"), None, 1, m)
    plan = None if index is None else index[0], counts[0]
    shared.write_cut(0, keys[0], values[0], *plan)
    for i in range(1, layers):
        key, value = keys[i], values[i]
        with _Dispatched() as seen:
            shared.write_cut(i, key, value, *plan)
        work = [op for op in seen.ops if op.split(".")[0] not in ("view", "slice", "expand", "unsqueeze")]
        assert work == (["copy_.default"] * 2 if policy is None else ["gather.out"] * 2), work
    shared.advance()
    for i in range(layers):
        assert _held_by_head(shared, i) == _held_by_head(reference, i)
        assert torch.equal(shared.page_table[i], reference.page_table[i])
    buffers = [(x.untyped_storage().data_ptr(), name) for name in ("k", "v", "page_table", "lengths")
               for x in getattr(shared, name)]
    buffers += [(x.untyped_storage().data_ptr(), "extras") for e in shared.extras for x in e.values()]
    assert len({ptr for ptr, _ in buffers}) == len(buffers)


def test_a_layer_of_other_shapes_than_the_first_gets_buffers_of_its_own():
    """``write_cut`` allocates every layer at the first call, shaped as the first layer; a
    layer whose keys differ (here its head dim) is allocated anew and holds its own tokens."""
    b, t, h = 1, 18, 2
    g = torch.Generator().manual_seed(5)
    store = PagedStore(2, max_context=32, page_size=16)
    store.begin(b, t, torch.device("cpu"))
    index, counts = store.plan_cut(None, (b, h, t), torch.device("cpu"))
    small, wide = torch.randn(b, h, t, 4, generator=g), torch.randn(b, h, t, 8, generator=g)
    store.write_cut(0, small, -small, index, counts[0])
    store.write_cut(1, wide, -wide, index, counts[0])
    store.advance()
    assert store.k[0].shape[-1] == 4 and store.k[1].shape[-1] == 8
    for i, x in enumerate((small, wide)):
        pages, offsets, valid = _slots(store._tensors(i), *store._meta(i)[:2])
        assert valid[:, :, :t].all() and not valid[:, :, t:].any()
        assert torch.equal(store.k[i][pages, offsets][:, :, :t], x)
    with pytest.raises(ValueError, match="not yet written"):
        store.write_cut(1, wide, -wide, index, counts[0])


@pytest.mark.parametrize("trim", [False, True], ids=["reserved", "trimmed"])
def test_trim_gives_back_reserved_pages_and_clears_their_columns(trim):
    """``trim`` frees the pages :meth:`reserve` gave past each head's tokens, and sets their
    table columns back to -1: with a column left pointing at a page a later reserve hands to
    another column, a write through every column (``record_scores``) reached that page twice
    and lost an update (slot 32's score came out 0, not 1)."""
    b, h, d, s = 2, 1, 8, 16
    torch.manual_seed(0)
    store = PagedStore(1, max_context=128, page_size=s, score_decay=1.0)

    def step(t: int) -> None:
        store.begin(b, t, torch.device("cpu"))
        store.append(0, torch.randn(b, t, h, d), torch.randn(b, t, h, d))
        store.advance()

    step(20)
    store.reserve(40)  # what generate reserves for the steps ahead
    pages_before = int(store._count[0].sum())
    if trim:
        store.trim()  # the generation stopped early
        assert int(store._count[0].sum()) == b * h * 2 < pages_before  # 20 tokens: two pages a head
        table = store.page_table[0]
        assert (table[..., 2:] == -1).all() and (table[..., :2] >= 0).all()
    store.reserve(17)  # a generation that goes on
    for _ in range(13):  # lengths 20 -> 33
        step(1)
    store.record_scores(0, torch.ones(b, h, store.width))
    snap = store.snapshot(0)
    held = snap.valid[..., :33]
    assert held.all() and (snap.scores[..., :33][held] == 1.0).all()
