"""The DCP attention layer (lapse.layers.DCPAttention) on its own: the training path
against the ops' reference, the dense limit, the decoding cache (irreversible, in place),
the sparsity loss's gradient, bad input.

Tolerances: float64 throughout except where a test says; the layer against the same
composition of ops agrees to ~1e-15 (the one difference: SDPA's math path against the
materialised oracle), the product definition of ``I`` to ~1e-14 (measured 4e-15)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch._dynamo.utils import counters

from lapse.kv import DenseStore, PagedStore
from lapse.layers import DCPAttention, DCPStats, SoftmaxAttention
from lapse.ops.backend import triton
from lapse.ops.dcp import (
    LOG_FLOOR,
    dcp_attention,
    dcp_sparsity_loss,
    interaction_log_mask,
    interaction_log_mask_step,
    naive_dcp_attention,
    naive_interaction_mask,
)

pytestmark = pytest.mark.usefixtures("one_thread")

C, H, K, D, R = 32, 4, 2, 8, 6


def _layer(beta_init: float = 0.0, r: int = R, **features) -> DCPAttention:
    """Interaction weights at std 1 (input width 32, r 6): logits of a few units, so
    both masks drop a good share of pairs."""
    torch.manual_seed(0)
    layer = DCPAttention(C, H, K, D, layer_idx=0, r=r, beta_init=beta_init, **features).double()
    with torch.no_grad():
        layer.qint_proj.weight.normal_(0, 1 / math.sqrt(C))
        layer.kint_proj.weight.normal_(0, 1 / math.sqrt(C))
    return layer


def _reference(layer: DCPAttention, x: torch.Tensor, log_mask) -> torch.Tensor:
    """The layer (plain: no Pro pieces) written out from its parts and the ops."""
    b, t, _ = x.shape
    positions = torch.arange(t)[None]
    q = layer.rotary(layer.q_proj(x).view(b, t, H, D), positions, t)
    k = layer.rotary(layer.k_proj(x).view(b, t, K, D), positions, t)
    v = layer.v_proj(x).view(b, t, K, D)
    log_i = log_mask(layer.qint_proj(x), layer.kint_proj(x))
    o = naive_dcp_attention(q, k, v, log_i, layer.scale)
    return layer.o_proj(o.reshape(b, t, H * D))


@pytest.mark.parametrize("alpha", [1.0, 1.5, 4.0], ids=lambda a: f"alpha{a}")
def test_training_path_equals_the_ops_forward_and_backward(alpha):
    layer = _layer().train()
    layer.alpha = alpha
    x = torch.randn(2, 11, C, dtype=torch.float64, requires_grad=True)
    out = layer(x, torch.arange(11)[None])
    ref = _reference(layer, x, lambda qi, ki: interaction_log_mask(qi, ki, layer.beta, alpha))
    torch.testing.assert_close(out, ref, atol=1e-13, rtol=0)
    g = torch.randn_like(out)
    params = [x, layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]
    params += layer.interaction_parameters()
    got = torch.autograd.grad(out, params, g)
    want = torch.autograd.grad(ref, params, g)
    for p, a, b in zip(["x", "W_q", "W_k", "W_v", "W_Qint", "W_Kint", "beta"], got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=p)
    assert all(bool(a.abs().max() > 0) for a in got)
    # and the mask is the product definition of SPEC section 6 (bisection on p, float64)
    with torch.no_grad():
        product = _reference(
            layer, x, lambda qi, ki: naive_interaction_mask(qi, ki, layer.beta, alpha).log().float().double()
        )
    torch.testing.assert_close(out.detach(), product, atol=1e-5, rtol=0)


def test_eval_mode_uses_the_step_mask_and_step_mask_overrides_the_mode():
    layer = _layer().eval()
    x = torch.randn(2, 9, C, dtype=torch.float64)
    step = _reference(layer, x, lambda qi, ki: interaction_log_mask_step(qi, ki, layer.beta))
    soft = _reference(layer, x, lambda qi, ki: interaction_log_mask(qi, ki, layer.beta, 1.0))
    with torch.no_grad():
        torch.testing.assert_close(layer(x, torch.arange(9)[None]), step.detach(), atol=1e-13, rtol=0)
        layer.step_mask = False  # the alpha-sigmoid even in eval mode
        torch.testing.assert_close(layer(x, torch.arange(9)[None]), soft.detach(), atol=1e-13, rtol=0)
        layer.train()
        layer.step_mask = True
        torch.testing.assert_close(layer(x, torch.arange(9)[None]), step.detach(), atol=1e-13, rtol=0)
    assert not torch.allclose(step, soft)


@pytest.mark.parametrize("mode", ["eval", "alpha1", "alpha2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_nothing_dropped_equals_softmax_attention_exactly(mode, dtype):
    """W_Qint = W_Kint = 0 and beta = 100: z = 100 everywhere, kept by the step and (to the
    last bit of log I: log sigmoid(100) = -4e-44) by the alpha-sigmoid; then DCP is the
    softmax attention it wraps, bit for bit, full forward and cached decoding alike."""
    torch.manual_seed(0)
    dense = SoftmaxAttention(C, H, K, D, layer_idx=0).to(dtype)
    dcp = DCPAttention(C, H, K, D, layer_idx=0, r=R, beta_init=100.0).to(dtype)
    missing, unexpected = dcp.load_state_dict(dense.state_dict(), strict=False)
    assert set(missing) == {"qint_proj.weight", "kint_proj.weight", "beta"} and not unexpected
    with torch.no_grad():
        dcp.qint_proj.weight.zero_()
        dcp.kint_proj.weight.zero_()
    dcp.train(mode != "eval")
    dcp.alpha = 2.0 if mode == "alpha2" else 1.0
    x = torch.randn(2, 13, C, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(dcp(x, torch.arange(13)[None]), dense(x, torch.arange(13)[None]))
        got, want = [], []
        for layer, out in ((dcp, got), (dense, want)):
            store = DenseStore(1, capacity=16)
            for start, end in ((0, 6), (6, 7), (7, 8), (8, 13)):
                positions = store.begin(2, end - start, x.device)
                out.append(layer(x[:, start:end], positions, store))
                store.advance()
        torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), atol=0, rtol=0)


@pytest.mark.parametrize("step_mask", [True, False], ids=["step", "alpha-sigmoid"])
@pytest.mark.parametrize("features", [dict(), dict(kv_shift=True, qk_norm=True, output_gate=True)],
                         ids=["plain", "pro"])
def test_cached_chunks_equal_the_full_forward(features, step_mask):
    """Prefill, single tokens and a chunk after a prefix against one full forward; with
    the step mask exactly what the full forward drops, with the alpha-sigmoid (alpha 3)
    the cached product in float64 (the full forward's column sums, re-associated)."""
    layer = _layer(**features).eval()
    layer.step_mask, layer.alpha = step_mask, 3.0
    x = torch.randn(2, 12, C, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x, torch.arange(12)[None])
        store, parts = DenseStore(1, capacity=4), []  # grows on the way
        for start, end in ((0, 5), (5, 6), (6, 9), (9, 10), (10, 12)):
            positions = store.begin(2, end - start, x.device)
            parts.append(layer(x[:, start:end], positions, store))
            store.advance()
        log_i = (interaction_log_mask_step if step_mask else
                 lambda qi, ki, b: interaction_log_mask(qi, ki, b, 3.0))(
            layer.qint_proj(x), layer.kint_proj(x), layer.beta
        )
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-12, rtol=0)
    log_keep = store.extras[0]["log_keep"][:, :12]  # [B, 12]: log I of each slot as of token 11
    torch.testing.assert_close(log_keep, log_i[:, -1].clamp_min(LOG_FLOOR), atol=1e-10, rtol=0)
    dropped = (log_keep <= LOG_FLOOR).float().mean().item()
    assert 0.2 < dropped < 0.9, dropped  # the test exercises dropping, not the dense limit


def test_a_dropped_slot_stays_dropped_in_the_cache():
    """Token by token: every slot's log_keep is 0 or LOG_FLOOR (step mask), the new token's
    own slot starts kept, and once a slot drops it stays dropped whatever later queries
    say (irreversible product), exactly the last row of the full step mask."""
    layer = _layer(beta_init=0.3).eval()
    x = torch.randn(3, 24, C, dtype=torch.float64)
    store = DenseStore(1, capacity=24)
    before = None
    revived = 0  # later queries that alone would keep a slot already dropped
    with torch.no_grad():
        q_int, k_int = layer.qint_proj(x), layer.kint_proj(x)
        z = q_int @ k_int.transpose(1, 2) / math.sqrt(R) + layer.beta  # [B, T(n), T(j)]
        for n in range(24):
            layer(x[:, n : n + 1], store.begin(3, 1, x.device), store)
            store.advance()
            keep = store.extras[0]["log_keep"][:, : n + 1].clone()  # [B, n + 1]
            assert set(keep.unique().tolist()) <= {0.0, LOG_FLOOR}
            assert (keep[:, n] == 0).all()
            if before is not None:
                assert (keep[:, :n][before == LOG_FLOOR] == LOG_FLOOR).all()
                revived += int(((before == LOG_FLOOR) & (z[:, n, :n] > 0)).sum())
            full = interaction_log_mask_step(q_int[:, : n + 1], k_int[:, : n + 1], layer.beta)
            torch.testing.assert_close(keep, full[:, -1].clamp_min(LOG_FLOOR), atol=0, rtol=0)
            before = keep
    assert revived > 10  # the product, not the last factor, decided those slots


def test_sparsity_loss_reaches_the_interaction_parameters_only():
    layer = _layer(beta_init=0.5).train()
    layer.keep_log_mask, layer.alpha = True, 2.0
    x = torch.randn(2, 10, C, dtype=torch.float64)
    layer(x, torch.arange(10)[None])
    log_i = layer.take_log_mask()
    assert log_i.shape == (2, 10, 10) and layer.last_log_mask is None
    dcp_sparsity_loss(log_i).backward()
    for p in layer.interaction_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0
    assert layer.beta.grad > 0  # a larger offset keeps more: the term grows
    assert layer.q_proj.weight.grad is None and layer.v_proj.weight.grad is None


def test_stats_hold_the_share_dropped():
    layer = _layer().eval()
    layer.collect_stats = True
    with torch.no_grad():
        layer(torch.randn(2, 9, C, dtype=torch.float64), torch.arange(9)[None])
    assert isinstance(layer.last_stats, DCPStats) and layer.last_stats.dropped.shape == (2, 9)
    assert layer.last_stats.dropped[:, 0].eq(0).all() and layer.last_stats.dropped.max() > 0


def test_gqa_and_the_sdpa_path_agree_with_dcp_attention():
    """The layer calls lapse.ops.dcp_attention (SDPA) for the full forward: the same
    numbers as its naive backend, in float32 too."""
    layer = _layer().float().train()
    layer.alpha = 1.5
    x = torch.randn(2, 7, C)
    with torch.no_grad():
        out = layer(x, torch.arange(7)[None])
        q = layer.rotary(layer.q_proj(x).view(2, 7, H, D), torch.arange(7)[None], 7)
        k = layer.rotary(layer.k_proj(x).view(2, 7, K, D), torch.arange(7)[None], 7)
        v = layer.v_proj(x).view(2, 7, K, D)
        log_i = interaction_log_mask(layer.qint_proj(x), layer.kint_proj(x), layer.beta, 1.5)
        o = dcp_attention(q, k, v, log_i, scale=layer.scale, backend="naive")
    torch.testing.assert_close(out, layer.o_proj(o.reshape(2, 7, H * D)), atol=2e-6, rtol=0)


def test_bad_input():
    layer = _layer()
    for alpha in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="alpha must be a finite number >= 1"):
            layer.alpha = alpha
    with pytest.raises(TypeError, match="alpha must be a python float"):
        layer.alpha = torch.tensor(2.0)
    for r in (0, -3, 2.5):
        with pytest.raises(ValueError, match="interaction dim r must be a positive integer"):
            DCPAttention(C, H, K, D, layer_idx=0, r=r)
    with pytest.raises(ValueError, match="beta_init must be a finite number"):
        DCPAttention(C, H, K, D, layer_idx=0, beta_init=float("nan"))
    store = PagedStore(1, max_context=16)
    x = torch.randn(1, 3, C, dtype=torch.float64)
    layer.train()  # a paged store takes the inference step mask only
    with pytest.raises(ValueError, match="paged store decodes with the inference step mask"):
        layer(x, store.begin(1, 3, x.device), store)


def test_training_forward_under_bfloat16_autocast():
    """The GPU trainer runs under bf16 autocast: the interaction logits stay float32 (the
    mask's log space), and the loss reaches beta."""
    from lapse.models import Decoder, preset

    torch.manual_seed(0)
    model = Decoder(preset("tiny", "transformer-llama", attention="dcp", acp=False)).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(ids, ids)
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[0].attn.beta.grad is not None


def test_alpha_is_held_as_a_float64_buffer_too():
    """The setter fills a 0-d float64 buffer in place (what compiled code reads); it is not
    in the state dict, and model.to(dtype) neither rounds nor unsets it."""
    layer = _layer()
    layer.alpha = 1.37
    assert layer._alpha_t.dtype == torch.float64 and layer._alpha_t.item() == 1.37
    assert "_alpha_t" not in layer.state_dict()
    buffer = layer._alpha_t
    layer.alpha = 5.0
    assert layer._alpha_t is buffer and buffer.item() == 5.0
    layer.alpha = 1.37
    layer.to(torch.bfloat16)
    assert layer.q_proj.weight.dtype == torch.bfloat16
    assert layer._alpha_t.dtype == torch.float64 and layer._alpha_t.item() == 1.37
    layer.to_empty(device="cpu")
    assert layer._alpha_t.item() == 1.37


COMPILE_ALPHAS = (1.0, 2.0, 3.5, 8.0)  # both closed forms and the bisection
EPS32 = torch.finfo(torch.float32).eps


def _train_step(forward, layer: DCPAttention, x: torch.Tensor, alpha: float):
    """One training forward and backward at ``alpha`` (the output and the sparsity term of
    the kept log I, as the trainer's loss): output, log I, dropped share, gradients."""
    layer.alpha = alpha
    x = x.detach().requires_grad_()
    out = forward(x)
    log_i, dropped = layer.take_log_mask(), layer.last_stats.dropped
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device)
    loss = (out * weights.view(out.shape)).sum()
    grads = torch.autograd.grad(loss + dcp_sparsity_loss(log_i), [x, *layer.parameters()])
    return out.detach(), log_i.detach(), dropped, grads


def _training_forward(layer: DCPAttention, x: torch.Tensor):
    """The layer in training mode keeping its log I and stats, as a function of ``x``, run
    once: RoPE makes its tables on a first call (compiled, a one-off recompilation)."""
    positions = torch.arange(x.shape[1], device=x.device)[None]
    layer.train()
    layer.keep_log_mask = layer.collect_stats = True
    forward = lambda x: layer(x, positions)  # noqa: E731
    forward(x)
    return forward


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's log(0)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_training_forward_is_one_graph_for_every_alpha(backend):
    """The training forward compiles whole (fullgraph: no graph break at the mask) and a new
    alpha needs no recompilation; aot_eager gives the eager numbers (measured bitwise:
    output, log I, dropped share and every gradient)."""
    if backend == "triton" and (triton is None or os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("the Triton alpha-sigmoid on CPU needs TRITON_INTERPRET=1")
    layer = _layer(beta_init=0.5).float()
    layer.interaction_backend = backend
    x = torch.randn(2, 13, C)
    eager = _training_forward(layer, x)
    torch._dynamo.reset()
    compiled = torch.compile(eager, backend="aot_eager", fullgraph=True)
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for alpha in COMPILE_ALPHAS:
            got, want = _train_step(compiled, layer, x, alpha), _train_step(eager, layer, x, alpha)
            for a, b in zip([*got[:3], *got[3]], [*want[:3], *want[3]], strict=True):
                assert torch.equal(a, b)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert (want[1] <= LOG_FLOOR).any()  # pairs drop: the clipped branches run


def _errors(got, ref):
    """Max abs error of the output and of each gradient against the float64 reference."""
    pairs = zip([got[0], *got[3]], [ref[0], *ref[3]], strict=True)
    return [(a.double() - b).abs().max().item() for a, b in pairs]


def _check_against_float64(layer: DCPAttention, ref_layer: DCPAttention, x: torch.Tensor) -> None:
    """``layer`` (float32) compiled by inductor against its float64 twin ``ref_layer`` run
    eagerly, at every alpha of COMPILE_ALPHAS: no recompilation, no graph break, and
    errors at most 2x (output) / 3x (gradients) those of the same layer run eagerly, plus
    8 float32 ulps of ``max(|value|, 1)``: the gradients of the weights are float32 sums
    over the tokens, which inductor orders differently. Measured on CPU (both backends):
    compiled within 1.35x of eager, except two weight gradients where eager's error was far
    below its usual size (7.4e-7 against 3.9e-8, 6.7e-7 against 1.9e-7: under 6 ulps of 1)."""
    eager, ref_forward = _training_forward(layer, x), _training_forward(ref_layer, x.double())
    torch._dynamo.reset()
    compiled = torch.compile(eager, backend="inductor", fullgraph=True)
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for alpha in COMPILE_ALPHAS:
            ref = _train_step(ref_forward, ref_layer, x.double(), alpha)
            got = _errors(_train_step(compiled, layer, x, alpha), ref)
            base = _errors(_train_step(eager, layer, x, alpha), ref)
            floor = [8 * EPS32 * max(r.abs().max().item(), 1.0) for r in (ref[0], *ref[3])]
            print(f"alpha {alpha}: compiled {got}, eager float32 {base}")
            assert got[0] <= 2 * base[0] + floor[0]
            for g, b, f in zip(got[1:], base[1:], floor[1:], strict=True):
                assert g <= 3 * b + f
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's log(0)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inductor_training_forward_compiles_once_and_is_as_close_as_eager(backend):
    """Inductor on CPU: 40-50 s each with a cold compile cache on a shared 2-core machine
    (the Triton alpha-sigmoid runs under the interpreter, an opaque operator to inductor)."""
    if backend == "triton" and (triton is None or os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("the Triton alpha-sigmoid on CPU needs TRITON_INTERPRET=1")
    layer, ref_layer = _layer(beta_init=0.5).float(), _layer(beta_init=0.5)
    layer.interaction_backend = backend
    _check_against_float64(layer, ref_layer, torch.randn(2, 13, C))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_inductor_on_cuda_compiles_once_for_every_alpha(backend):
    """The fine-tuning configuration: inductor on CUDA (``auto``: the Triton alpha-sigmoid),
    as close to the float64 layer as eager float32 (see _check_against_float64)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layer, ref_layer = _layer(beta_init=0.5).float().cuda(), _layer(beta_init=0.5).cuda()
    layer.interaction_backend = backend
    _check_against_float64(layer, ref_layer, torch.randn(2, 300, C, device="cuda"))
