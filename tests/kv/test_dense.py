"""The dense store on its own: the protocol, writes by index, growth, reorder, misuse."""

from __future__ import annotations

import pytest
import torch

from lapse.kv import DenseStore, GateState, KVCache


def _tokens(b, t, start, k=2, d=4):
    """Keys whose every entry is its position: what sits in a slot is easy to read."""
    pos = torch.arange(start, start + t, dtype=torch.float32)
    return pos[None, :, None, None].expand(b, t, k, d).clone()


def test_store_follows_the_protocol_and_writes_at_the_lengths():
    store = DenseStore(2, capacity=8)
    assert isinstance(store, KVCache) and store.length == 0 and store.batch_size is None
    for start, t in ((0, 3), (3, 1), (4, 2)):
        positions = store.begin(2, t, torch.device("cpu"))
        assert positions.tolist() == [list(range(start, start + t))] * 2
        k = _tokens(2, t, start)
        for layer in range(2):
            store.append(layer, k, -k, c=k[..., 0, :1])
            view = store.view(layer)
            assert view.seqlens.tolist() == [start + t] * 2
        store.advance()
    assert store.length == 6 and store.seqlens.tolist() == [6, 6] and store.capacity == 8
    k = store.view(0).k
    assert torch.equal(k[:, :6, 0, 0], torch.arange(6.0).expand(2, 6))
    assert torch.equal(store.view(1).v[:, :6], -k[:, :6])
    assert store.view(0).extras["c"].shape == (2, 8, 1)


def test_store_grows_outside_compiled_code_and_keeps_what_it_held():
    store = DenseStore(1, capacity=2)
    start = 0
    for t in (2, 1, 4):
        store.begin(1, t, torch.device("cpu"))
        store.append(0, _tokens(1, t, start), _tokens(1, t, start))
        store.advance()
        start += t
    assert store.capacity >= 7 and torch.equal(store.view(0).k[0, :7, 1, 2], torch.arange(7.0))


def test_reorder_moves_rows_of_buffers_and_states():
    store = DenseStore(1, capacity=4)
    store.begin(3, 2, torch.device("cpu"))
    k = torch.arange(3.0)[:, None, None, None].expand(3, 2, 2, 4).clone()
    store.append(0, k, k)
    state = store.state(0, GateState)
    state.ensure(3, 2, torch.device("cpu")).copy_(torch.arange(3.0)[:, None].expand(3, 2))
    store.advance()
    store.reorder(torch.tensor([2, 2, 0]))
    assert store.view(0).k[:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0]
    assert store.state(0, GateState).c_last[:, 0].tolist() == [2.0, 2.0, 0.0]
    assert store.seqlens.tolist() == [2, 2, 2]


def test_misuse_raises_one_clear_error():
    with pytest.raises(ValueError, match="capacity must be a non-negative integer"):
        DenseStore(2, capacity=-1)
    store = DenseStore(1)
    store.begin(2, 1, torch.device("cpu"))
    store.append(0, _tokens(2, 1, 0), _tokens(2, 1, 0))
    store.advance()
    with pytest.raises(ValueError, match="holds 2 sequences but input_ids has 3"):
        store.begin(3, 1, torch.device("cpu"))
    store.begin(2, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="use a fresh cache for a new model"):
        store.append(0, _tokens(2, 1, 1, d=8), _tokens(2, 1, 1, d=8))
