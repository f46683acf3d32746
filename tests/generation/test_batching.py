"""Continuous batching (:class:`lapse.generation.RowBatcher`): requests of different
lengths join a running batch at different steps and leave it when done; each one's tokens
are exactly those ``generate`` draws for its prompt alone with the same seed and policy
(float64, so that batching changes no draw), and every page comes back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lapse.generation import (
    A2SF,
    H2O,
    ACPBoundary,
    DCPDrop,
    Dense,
    RowBatcher,
    RowRequest,
    SinkWindow,
    generate,
)
from lapse.models import Decoder, preset

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:budget .* below recent"),  # short prompts under a share
]

# (prompt length, new tokens, the step it arrives at): six requests through three rows,
# so some wait for a row, and rows are taken again after a release
ARRIVALS = [(9, 7, 0), (3, 12, 0), (21, 5, 1), (1, 9, 2), (14, 6, 4), (6, 8, 4)]


@pytest.fixture(scope="module")
def model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(preset("tiny", "fox-pro", init_std=0.1, n_kv_heads=2)).double().eval()


def _requests(vocab: int, budgets=None) -> list[tuple[int, RowRequest]]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for i, (t, n, at) in enumerate(ARRIVALS):
        prompt = torch.randint(0, vocab, (t,), generator=gen).tolist()
        budget = None if budgets is None else budgets[i]
        out.append((at, RowRequest(prompt, n, temperature=1.0, seed=100 + i, budget=budget)))
    return out


def _serve(batcher: RowBatcher, requests: list[tuple[int, RowRequest]]) -> list[list[int]]:
    """What a server's engine loop does: admits the arrived requests in order while they fit,
    steps, releases each row when it has its tokens."""
    waiting = list(enumerate(requests))
    out: dict[int, list[int]] = {}
    owner: dict[int, int] = {}  # row -> request index
    step = 0
    while waiting or owner:
        while waiting and waiting[0][1][0] <= step and batcher.can_admit(waiting[0][1][1]):
            i, (_, req) = waiting.pop(0)
            row, first = batcher.admit(req)
            owner[row], out[i] = i, [first]
        for row, i in list(owner.items()):
            if len(out[i]) == requests[i][1].max_new_tokens:
                batcher.release(row)
                del owner[row]
        if owner:
            for row, token in batcher.step().items():
                out[owner[row]].append(token)
        step += 1
    return [out[i] for i in range(len(requests))]


def _alone(model: Decoder, req: RowRequest, policy) -> list[int]:
    ids = torch.tensor([req.prompt])
    gen = torch.Generator().manual_seed(req.seed)
    out = generate(model, ids, req.max_new_tokens, temperature=req.temperature, generator=gen, policy=policy)
    return out[0, len(req.prompt) :].tolist()


def _policy_of(policy, req: RowRequest):
    if req.budget is None:
        return policy
    if isinstance(policy, SinkWindow):
        return dataclasses.replace(policy, window=req.budget)
    return dataclasses.replace(policy, budget=req.budget)


@pytest.mark.parametrize(
    "policy,budgets",
    [
        (None, None),
        (SinkWindow(sinks=2, window=6, every=4), None),
        (SinkWindow(sinks=2, window=6, every=4), [4, None, 9, 3, None, 5]),
        (H2O(budget=0.5, recent=2, sinks=1), None),
        (H2O(budget=6, recent=2, sinks=1), [3, 0.4, None, 8, 0.8, 4]),
        (A2SF(budget=8, recent=2, alpha=0.8, every=3), None),
    ],
    ids=["dense", "window", "window-budgets", "h2o", "h2o-budgets", "a2sf"],
)
def test_rows_joining_and_leaving_equal_each_request_alone(model, policy, budgets):
    requests = _requests(model.config.vocab_size, budgets)
    batcher = RowBatcher(model, policy, rows=3, max_context=40)
    with model.fused_projections():  # as generate decodes
        got = _serve(batcher, requests)
    for i, (_, req) in enumerate(requests):
        want = _alone(model, req, _policy_of(policy or Dense(), req))
        assert got[i] == want, f"request {i} differs from its prompt generated alone"
    assert batcher.pages_used() == 0 and batcher.pages_free() == batcher.pages_total()
    assert all(len(f) == batcher.store.pages for f in batcher.store._free)
    assert batcher.free_rows() == 3 and batcher.active_rows() == []


def test_requests_of_other_kinds_in_one_batch_equal_each_alone(model):
    """An H2O batcher's rows under their own policies (dense, windows of two sizes, H2O with
    other settings, the batcher's): each row's tokens are those of its prompt generated alone
    under its policy; the window rows share one pass (they differ in the window only)."""
    kinds = [Dense(), SinkWindow(sinks=2, window=6, every=4), None, H2O(budget=4, recent=1, sinks=2, every=2),
             SinkWindow(sinks=2, window=9, every=4), None]
    requests = [(at, dataclasses.replace(req, policy=kind))
                for (at, req), kind in zip(_requests(model.config.vocab_size), kinds, strict=True)]
    server = H2O(budget=0.5, recent=2, sinks=1)
    batcher = RowBatcher(model, server, rows=3, max_context=40)
    with model.fused_projections():
        got = _serve(batcher, requests)
    for i, (_, req) in enumerate(requests):
        assert got[i] == _alone(model, req, req.policy or server), f"request {i}"
    windows = [key for key in batcher._passes if key[0] is SinkWindow]
    assert len(windows) == 1
    assert batcher.pages_used() == 0 and batcher.pages_free() == batcher.pages_total()


def test_a_request_policy_the_store_cannot_run_is_refused(model):
    window = RowBatcher(model, SinkWindow(sinks=2, window=6), rows=2, max_context=40)
    with pytest.raises(ValueError, match="H2O ranks tokens by attention scores with decay 1.0, and the "
                                         "shared KV store records no attention scores"):
        window.check(RowRequest([1, 2, 3], 2, policy=H2O(budget=0.5)))
    h2o = RowBatcher(model, H2O(budget=0.5), rows=2, max_context=40)
    with pytest.raises(ValueError, match="decay 0.8, and the shared KV store records scores with decay 1.0"):
        h2o.check(RowRequest([1, 2, 3], 2, policy=A2SF(budget=0.5, alpha=0.8)))
    with pytest.raises(ValueError, match="DCP"):
        h2o.check(RowRequest([1, 2, 3], 2, policy=DCPDrop()))
    with pytest.raises(ValueError, match="policy must be a Policy"):
        RowRequest([1], 2, policy="h2o")
    h2o.check(RowRequest([1, 2, 3], 2, policy=SinkWindow(sinks=1, window=4)))  # no scores needed


@pytest.mark.parametrize(
    "arch,overrides,policy",
    [
        ("castle-swl", {}, H2O(budget=5, recent=2, sinks=1)),  # a lookahead ring per row
        ("fox-llama", {}, A2SF(budget=0.5, recent=2, alpha=0.8, per="layer")),
        ("transformer-llama", {}, SinkWindow(sinks=1, window=5, every=3)),  # no gate state
        ("transformer-pro", {"attention": "dcp", "acp": False}, DCPDrop(every=2)),
    ],
    ids=["castle-h2o", "fox-llama-a2sf-layer", "llama-window", "dcp"],
)
def test_other_kinds_equal_each_request_alone(arch, overrides, policy):
    torch.manual_seed(0)
    model = Decoder(preset("tiny", arch, init_std=0.1, **{"n_kv_heads": 2, **overrides})).double().eval()
    requests = _requests(model.config.vocab_size)
    batcher = RowBatcher(model, policy, rows=3, max_context=40)
    with model.fused_projections():
        got = _serve(batcher, requests)
    assert got == [_alone(model, req, policy) for _, req in requests]
    assert batcher.pages_used() == 0


def test_acp_rows_give_their_pages_back():
    """ACP's boundary reads the store's max_context (the shared store's, not T + N as in
    ``generate``), so its passes may keep other tokens than a request alone: pages only."""
    torch.manual_seed(0)
    model = Decoder(preset("tiny", "fox-pro", init_std=0.1, n_kv_heads=2, acp=True)).double().eval()
    policy = ACPBoundary(every=3)
    batcher = RowBatcher(model, policy, rows=3, max_context=40)
    requests = _requests(model.config.vocab_size)
    got = _serve(batcher, requests)
    assert [len(g) for g in got] == [req.max_new_tokens for _, req in requests]
    dense = RowBatcher(model, None, rows=3, max_context=40)
    assert all(batcher.pages_needed(req) <= dense.pages_needed(req) for _, req in requests)
    assert batcher.pages_used() == 0 and batcher.pages_free() == batcher.pages_total()


def test_admission_reserves_the_worst_case_and_refuses_what_never_fits(model):
    policy = H2O(budget=6, recent=2, sinks=1)
    layers, heads = model.config.n_layers, model.config.kv_heads
    batcher = RowBatcher(model, policy, rows=2, pages=6, max_context=64)
    long = RowRequest(list(range(40)), 10)
    assert batcher.pages_needed(long) == layers * heads * 1  # 6 kept + 1 step: one page of 16
    assert batcher.pages_needed(RowRequest([1, 2], 3)) == layers * heads  # 5 tokens
    dense = RowBatcher(model, None, rows=2, pages=6, max_context=64)
    assert dense.pages_needed(long) == layers * heads * 4  # 50 tokens: 4 pages per head
    assert dense.pages_total() == layers * 6
    with pytest.raises(ValueError, match="more than the"):
        dense.admit(long)
    with pytest.raises(ValueError, match="exceed the context of 64"):
        batcher.admit(RowRequest(list(range(60)), 5))
    with pytest.raises(ValueError, match="token ids"):
        batcher.admit(RowRequest([1, 999], 5))
    with pytest.raises(ValueError, match="budget"):
        batcher.admit(RowRequest([1, 2], 5, budget=-3))
    rows = [batcher.admit(RowRequest([1, 2, 3], 4, seed=i))[0] for i in range(2)]
    assert rows == [0, 1] and batcher.free_rows() == 0
    assert not batcher.can_admit(RowRequest([1], 2))
    with pytest.raises(RuntimeError, match="no room now"):
        batcher.admit(RowRequest([1], 2))
    assert batcher.pages_used() == 2 * layers * heads and batcher.pages_free() == layers * (6 - 2 * heads)
    batcher.release(0)
    assert batcher.can_admit(RowRequest([1], 2))
    batcher.release(1)
    with pytest.raises(ValueError, match="not occupied"):
        batcher.release(1)
    assert batcher.pages_used() == 0 and batcher.pages_free() == batcher.pages_total()


def test_compiled_step_compiles_nothing_more_while_rows_join_and_leave(model):
    """The step's shapes never change (free rows hold a scratch token): once a first run
    has compiled the step and the passes, rows joining and leaving at other steps compile
    nothing, and the tokens are the eager batcher's."""
    policy = SinkWindow(sinks=2, window=6, every=4)
    batcher = RowBatcher(model, policy, rows=3, max_context=40, compile="aot_eager")
    _serve(batcher, _requests(model.config.vocab_size))  # compiles
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    budgets = [4, None, 9, 3, None, 5]  # other windows, arriving at other steps
    requests = [(at + i % 2, req) for i, (at, req) in enumerate(_requests(model.config.vocab_size, budgets))]
    eager = _serve(RowBatcher(model, policy, rows=3, max_context=40), requests)
    assert _serve(batcher, requests) == eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_h2o_fits_four_times_the_requests_of_dense_in_the_same_pages():
    """The point of admitting by the policy's bound: at 125M fox-pro shapes, a 32768-token
    prompt and 256 new tokens, H2O at 0.2 reserves a fifth of dense's pages, so the same
    memory takes at least 4x the requests (arithmetic only: a model on the meta device)."""
    with torch.device("meta"):
        model = Decoder(preset("125m", "fox-pro"))
    req = RowRequest([0] * 32768, 256)
    dense = RowBatcher(model, None, rows=64, max_context=33024)
    pages = 2 * dense.pages_needed(req) // model.config.n_layers  # per layer: two dense requests
    dense = RowBatcher(model, None, rows=64, pages=pages, max_context=33024)
    h2o = RowBatcher(model, H2O(budget=0.2), rows=64, pages=pages, max_context=33024)
    fits = [b.pages_total() // b.pages_needed(req) for b in (dense, h2o)]
    assert fits[0] == 2 and fits[1] >= 4 * fits[0]


def test_acp_keeps_reserved_only_what_its_rows_can_grow_to():
    """Admission checks the worst case (the whole prompt and the new tokens), then keeps
    reserved only each head's kept tokens plus the new ones: with gates that forget within a
    few tokens, ACP keeps a few of a 100-token prompt, so pages enough for two dense requests
    take four ACP requests at once; every row then decodes its tokens and the pool comes back."""
    torch.manual_seed(0)
    model = Decoder(preset("tiny", "fox-pro", init_std=0.1, n_kv_heads=2, acp=True)).double().eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.fgate.bias.fill_(-4.0)  # f ~ 0.02: a key fades within a few tokens
    policy = ACPBoundary(every=2)
    requests = [RowRequest([3 + i % 40 for i in range(100)], 4, seed=i) for i in range(4)]
    shape = dict(rows=4, max_context=112, ahead=2)
    dense = RowBatcher(model, None, **shape)
    pages = 2 * dense.pages_needed(requests[0]) // model.config.n_layers  # two dense requests a layer
    for policy_, fits in ((None, 2), (policy, 4)):
        batcher = RowBatcher(model, policy_, pages=pages, **shape)
        admitted = []
        for req in requests:
            if not batcher.can_admit(req):
                break
            admitted.append(batcher.admit(req)[0])
        assert len(admitted) == fits, policy_
        drawn = {row: 1 for row in admitted}
        while drawn:
            for row in batcher.step():
                drawn[row] += 1
            for row in [r for r, n in drawn.items() if n == 4]:
                batcher.release(row)
                del drawn[row]
        assert batcher.pages_used() == 0 and batcher.pages_free() == batcher.pages_total()
