"""Test-session setup shared by every test module.

Triton decides between compiling and interpreting when a kernel is defined, so the
interpreter must be switched on before anything imports ``lapse.ops`` (and Triton): on a
machine without CUDA the kernels run under ``TRITON_INTERPRET=1``; on a GPU they compile.
"""

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def single_thread():
    """Torch on one intra-op thread for the block. Tiny models gain nothing from threads,
    and on a shared CPU their barriers stall (2 threads ran the generation tests 10-100x
    slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """A module runs on one thread: ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    with single_thread():
        yield


def _compiled_step_matches_eager(model, ids, steps: int, *, reference=None, capacity: int | None = None,
                                 atol: float = 2e-5):
    """Prefills ``ids`` into two DenseStores, then runs ``steps`` greedy steps: the compiled
    decode step (fullgraph, ``aot_eager``) on ``model`` against the eager step on
    ``reference`` (default ``model``), each fed its own argmax; asserts the logits agree
    within ``atol`` at every step. Returns ``(eager_store, compiled_store)``."""
    from lapse.generation import compiled_decode_one_token, decode_one_token, prefill
    from lapse.kv import DenseStore

    reference = model if reference is None else reference
    capacity = capacity or ids.shape[1] + steps + 1
    n_layers = model.config.n_layers
    eager, compiled = DenseStore(n_layers, capacity=capacity), DenseStore(n_layers, capacity=capacity)
    step = compiled_decode_one_token(mode=None, backend="aot_eager")
    token_e = prefill(reference, ids, eager).argmax(-1, keepdim=True)
    token_c = prefill(model, ids, compiled).argmax(-1, keepdim=True)
    for _ in range(steps):
        logits_e, logits_c = decode_one_token(reference, token_e, eager), step(model, token_c, compiled)
        torch.testing.assert_close(logits_c, logits_e, atol=atol, rtol=0)
        token_e, token_c = logits_e.argmax(-1, keepdim=True), logits_c.argmax(-1, keepdim=True)
    return eager, compiled


@pytest.fixture
def compiled_step_matches_eager():
    """:func:`_compiled_step_matches_eager`, for the decode-step tests of every kind."""
    return _compiled_step_matches_eager


def _compiled_paged_steps_match_eager(model, ids, policy, steps: int, *, atol: float = 2e-5) -> None:
    """``steps`` greedy steps over a PagedStore under ``policy`` (its passes between steps,
    outside the step): the compiled decode step (fullgraph, ``aot_eager``) gives the eager
    step's logits within ``atol``."""
    from lapse.generation import compiled_decode_one_token, decode_one_token, evict, paged_store_for, prefill

    batch, prompt = ids.shape
    compiled = compiled_decode_one_token(mode=None, backend="aot_eager")
    runs = []
    for step in (decode_one_token, compiled):
        store = paged_store_for(model, batch, prompt, steps + 1, policy)
        token = prefill(model, ids, store).argmax(-1, keepdim=True)
        out = []
        for i in range(steps):
            if i % policy.every == 0:
                evict(model, store, policy)
                store.reserve(policy.every)
            logits = step(model, token, store)
            out.append(logits)
            token = logits.argmax(-1, keepdim=True)
        runs.append(torch.stack(out, 1))
    torch.testing.assert_close(runs[1], runs[0], atol=atol, rtol=0)


@pytest.fixture
def compiled_paged_steps_match_eager():
    """:func:`_compiled_paged_steps_match_eager`, for the paged decode tests of every kind."""
    return _compiled_paged_steps_match_eager


@pytest.fixture
def policy_passes(monkeypatch):
    """A list that gets one entry per ``PagedStore.apply_policy_all`` call (eviction passes
    over every layer) while the test runs."""
    from lapse.kv import PagedStore

    calls = []
    original = PagedStore.apply_policy_all

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PagedStore, "apply_policy_all", counted)
    return calls
