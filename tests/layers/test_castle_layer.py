"""The CASTLE attention layer (lapse.layers.CastleAttention) on its own: the full forward
against the recurrent definition, decoding over a DenseStore (prefill, chunks, steps,
ragged prompts) against the full forward, bad input.

Tolerances: float64 throughout; the layer against the recurrent oracle composed by hand
agrees to ~1e-14 (measured 8.9e-16 outputs, 7.1e-15 gradients), cached decoding against
the full forward likewise (measured 1.0e-15): 1e-12 leaves room and still catches any
misplaced slot or missing term (those show at 1e-2 and up)."""

from __future__ import annotations

import os

import pytest
import torch

from lapse.kv import DenseStore, LookaheadRing
from lapse.layers import Attention, CastleAttention
from lapse.ops.castle import castle_decode_fold, castle_lookahead_keys, naive_castle_recurrent

pytestmark = pytest.mark.usefixtures("one_thread")

C, H, D = 32, 4, 8
ATOL = 1e-12
WINDOWS = [None, 1, 3]


def _layer(kv_heads: int = H, window: int | None = None, **features) -> CastleAttention:
    """Weights at std 1/sqrt(C): scores of a few units, so the lookahead term matters."""
    torch.manual_seed(0)
    layer = CastleAttention(C, H, kv_heads, D, layer_idx=0, window=window, **features).double()
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0, C**-0.5)
    return layer


def _reference(layer: CastleAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer (plain: no Pro pieces) written out from its parts and the recurrent oracle."""
    b, t, _ = x.shape
    k = layer.n_kv_heads
    pos = torch.arange(t)[None]

    def proj(linear, heads, rope):
        y = linear(x).view(b, t, heads, D)
        return layer.rotary(y, pos, t) if rope else y

    q_c, k_c, v_c = proj(layer.q_proj, H, True), proj(layer.k_proj, k, True), proj(layer.v_proj, k, False)
    q_u, k_u, v_u = proj(layer.qu_proj, H, True), proj(layer.ku_proj, k, True), proj(layer.vu_proj, k, False)
    o, _ = naive_castle_recurrent(q_c, k_c, v_c, q_u, k_u, v_u, layer.scale, layer.window)
    return layer.o_proj(o.reshape(b, t, H * D))


def _run(layer: Attention, x: torch.Tensor, store: DenseStore, lengths=None) -> torch.Tensor:
    """One forward of ``x`` through ``layer`` over ``store``, as the decoder drives it."""
    positions = store.begin(x.shape[0], x.shape[1], x.device, lengths)
    out = layer(x, positions, store)
    store.advance()
    return out


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("kv_heads", [H, 2], ids=lambda k: f"K{k}")
def test_full_forward_equals_the_recurrent_definition(kv_heads, window):
    layer = _layer(kv_heads, window)
    x = torch.randn(2, 11, C, dtype=torch.float64, requires_grad=True)
    out, ref = layer(x, torch.arange(11)[None]), _reference(layer, x)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    d_out = torch.randn_like(out)
    params = [x, *layer.parameters()]
    for g, g_ref in zip(torch.autograd.grad(out, params, d_out), torch.autograd.grad(ref, params, d_out),
                        strict=True):
        torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)
    # the lookahead projections are used: a layer without them is another function
    with torch.no_grad():
        layer.qu_proj.weight.zero_()
    assert (layer(x, torch.arange(11)[None]) - out).abs().max() > 1e-3


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("kv_heads", [H, 2], ids=lambda k: f"K{k}")
def test_prefill_chunk_and_steps_equal_the_full_forward(kv_heads, window):
    """4 prompt tokens, a chunk of 3, then 3 single steps: every output equals the full
    forward's row, and the cached U equals the lookahead keys of the whole sequence."""
    layer = _layer(kv_heads, window)
    x = torch.randn(2, 10, C, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x, torch.arange(10)[None])
        store = DenseStore(1, capacity=16)
        parts = [_run(layer, x[:, a:b], store) for a, b in ((0, 4), (4, 7), (7, 8), (8, 9), (9, 10))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=0)
    b, t = x.shape[:2]
    pos = torch.arange(t)[None]
    q_u = layer.rotary(layer.qu_proj(x).view(b, t, H, D), pos, t)
    k_u = layer.rotary(layer.ku_proj(x).view(b, t, kv_heads, D), pos, t)
    v_u = layer.vu_proj(x).view(b, t, kv_heads, D)
    u = castle_lookahead_keys(q_u, k_u, v_u, scale=layer.scale, window=window)
    view = store.view(0)
    assert view.extras["u"].dtype == torch.float64 and store.seqlens.tolist() == [10, 10]
    torch.testing.assert_close(view.extras["u"][:, :10], u, atol=ATOL, rtol=0)
    torch.testing.assert_close(view.extras["q_u"][:, :10], q_u, atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("fold_every", [1, 3], ids=lambda m: f"M{m}")
def test_deferred_update_decodes_like_the_full_forward(fold_every, window):
    """fold_every: a prompt of 4, a chunk of 3, then 5 steps (folds at slots 2 mod 3, so
    mid-chunk and between steps) equal the full forward; the store's U after folding the
    ring equals the lookahead keys of the whole sequence."""
    layer = _layer(2, window, fold_every=fold_every)
    x = torch.randn(2, 12, C, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x, torch.arange(12)[None])
        store = DenseStore(1, capacity=16)
        cuts = ((0, 4), (4, 7), (7, 8), (8, 9), (9, 10), (10, 11), (11, 12))
        parts = [_run(layer, x[:, a:b], store) for a, b in cuts]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=0)
    ring = store.state(0, LookaheadRing)
    assert ring.k.shape == (2, fold_every, 2, D) and ring.pos.dtype == torch.int32
    view = store.view(0)
    castle_decode_fold(view.extras["u"], view.extras["q_u"], (ring.k, ring.v, ring.pos), store.seqlens,
                       scale=layer.scale, window=window)
    b, t = x.shape[:2]
    pos = torch.arange(t)[None]
    q_u = layer.rotary(layer.qu_proj(x).view(b, t, H, D), pos, t)
    k_u = layer.rotary(layer.ku_proj(x).view(b, t, 2, D), pos, t)
    u = castle_lookahead_keys(q_u, k_u, layer.vu_proj(x).view(b, t, 2, D), scale=layer.scale, window=window)
    torch.testing.assert_close(view.extras["u"][:, :t], u, atol=ATOL, rtol=0)


def test_deferred_ring_follows_reorder():
    """A batch reordered between steps with tokens pending: every row continues as the
    same sequence does unreordered."""
    layer = _layer(2, 3, fold_every=4)
    x = torch.randn(3, 9, C, dtype=torch.float64)
    index = torch.tensor([2, 0, 1])
    with torch.no_grad():
        plain, moved = DenseStore(1, capacity=12), DenseStore(1, capacity=12)
        _run(layer, x[:, :4], plain)
        _run(layer, x[index, :4], moved)
        for i in (4, 5):  # slots 4 and 5 pending (the fold is at slot 7)
            _run(layer, x[:, i:i + 1], plain)
            _run(layer, x[index, i:i + 1], moved)
        moved.reorder(torch.argsort(index))  # back to the plain order
        after = [(_run(layer, x[:, i:i + 1], plain), _run(layer, x[:, i:i + 1], moved)) for i in range(6, 9)]
    for a, b in after:
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    assert torch.equal(moved.state(0, LookaheadRing).pos, plain.state(0, LookaheadRing).pos)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("window", [None, 2], ids=lambda w: f"W{w}")
def test_fused_triton_step_decodes_like_the_torch_reference(window):
    """backend="triton" (interpreter, float32): the prefill, a chunk and single steps go
    through the fused decode kernel and give the torch-backend layer's outputs and U."""
    layer = _layer(2, window).float()
    x = torch.randn(2, 9, C)
    outs, stores = {}, {}
    with torch.no_grad():
        for backend in ("torch", "triton"):
            layer.backend = backend
            stores[backend] = DenseStore(1, capacity=12)
            outs[backend] = torch.cat([_run(layer, x[:, a:b], stores[backend])
                                       for a, b in ((0, 4), (4, 6), (6, 7), (7, 8), (8, 9))], dim=1)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=0)
    u_t, u_ref = stores["triton"].view(0).extras["u"], stores["torch"].view(0).extras["u"]
    torch.testing.assert_close(u_t[:, :9], u_ref[:, :9], atol=1e-5, rtol=0)


def test_a_one_token_prompt_and_float32_state():
    """A prompt of one token takes the step's path; in float32 ``U`` is kept in float32."""
    layer = _layer(2, None).float()
    x = torch.randn(3, 6, C)
    with torch.no_grad():
        full = layer(x, torch.arange(6)[None])
        store = DenseStore(1)
        parts = [_run(layer, x[:, i : i + 1], store) for i in range(6)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)
    assert store.view(0).extras["u"].dtype == torch.float32


@pytest.mark.parametrize("window", [None, 2], ids=lambda w: f"W{w}")
def test_ragged_prefill_equals_each_prompt_alone(window):
    """Right-padded prompts of lengths 5, 2, 4 (the padding holds other tokens), then two
    steps: every row equals its prompt run alone (the padding adds nothing to U)."""
    layer = _layer(2, window)
    lengths = [5, 2, 4]
    x = torch.randn(3, 5, C, dtype=torch.float64)
    steps = torch.randn(3, 2, C, dtype=torch.float64)
    with torch.no_grad():
        store = DenseStore(1, capacity=8)
        prompt = _run(layer, x, store, torch.tensor(lengths))
        after = [_run(layer, steps[:, i : i + 1], store) for i in range(2)]
        for b, n in enumerate(lengths):
            alone = layer(torch.cat([x[b : b + 1, :n], steps[b : b + 1]], dim=1), torch.arange(n + 2)[None])
            torch.testing.assert_close(prompt[b, :n], alone[0, :n], atol=ATOL, rtol=0)
            torch.testing.assert_close(torch.cat(after, dim=1)[b], alone[0, n:], atol=ATOL, rtol=0)
    assert store.seqlens.tolist() == [7, 4, 6]


def test_pro_features_decode_like_the_full_forward():
    """KV-shift, QK-norm and the output gate act on the causal branch; cached == uncached."""
    layer = _layer(2, 3, kv_shift=True, qk_norm=True, output_gate=True)
    x = torch.randn(2, 8, C, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x, torch.arange(8)[None])
        store = DenseStore(1)
        parts = [_run(layer, x[:, :5], store), _run(layer, x[:, 5:6], store), _run(layer, x[:, 6:], store)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=0)


def test_parameters_per_head():
    layer = CastleAttention(C, H, H, D, layer_idx=0)
    assert CastleAttention.matrices_per_head == 7
    assert sum(p.numel() for p in layer.parameters()) == 7 * H * C * D
    assert layer.window is None and "window=None" in repr(layer)


def test_bad_input():
    for window in (0, -3):
        with pytest.raises(ValueError, match="window must be >= 1"):
            CastleAttention(C, H, H, D, layer_idx=0, window=window)
    for window in (1.5, True, "8"):
        with pytest.raises(TypeError, match="window must be None or an int"):
            CastleAttention(C, H, H, D, layer_idx=0, window=window)
    for fold_every in (0, 2.0, True):
        with pytest.raises(ValueError, match="fold_every"):
            CastleAttention(C, H, H, D, layer_idx=0, fold_every=fold_every)
    with pytest.raises(ValueError, match="even head dim"):
        CastleAttention(C, H, H, 7, layer_idx=0)
    assert CastleAttention.supports_paged is True and Attention.supports_paged is True
