"""The loss fused with the output projection, a chunk of rows at a time
(:func:`lapse.models.loss.chunked_lm_loss`, ``Decoder.forward(return_logits=False)``), against
the loss of the whole logits: the value and the gradients of the hidden states, of the head's
weight and of a whole model's parameters, over awkward shapes (T not a multiple of the chunk,
chunk 1, a chunk past ``B * T``, most or all labels left out). Float64 to rounding; float32,
bf16 and bf16 autocast within the measured error of the plain path against float64; no
``[B, T, V]`` tensor made in the forward or the backward; through compiled and checkpointed
blocks, FSDP2 and DDP (one process, gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lapse.models import Decoder, prepare_blocks, preset
from lapse.models.decoder import lm_loss
from lapse.models.loss import chunk_rows, chunked_lm_loss

pytestmark = pytest.mark.usefixtures("one_thread")

# (B, T, C, V, chunk, share of labels left out)
SHAPES = [
    (1, 37, 24, 101, 5, 0.0),  # T not a multiple of the chunk
    (2, 37, 24, 101, 1, 0.3),  # one row per chunk
    (2, 37, 24, 101, 500, 0.3),  # one chunk past B * T
    (3, 64, 48, 257, 16, 0.9),  # most labels left out
    (2, 100, 40, 300, 7, 0.5),
]
SHAPE_IDS = [f"B{b}-T{t}-C{c}-V{v}-chunk{k}-ignored{i}" for b, t, c, v, k, i in SHAPES]


def _inputs(b, t, c, v, ignored, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, c, generator=g).to(dtype)
    weight = (3 / c**0.5 * torch.randn(v, c, generator=g)).to(dtype)  # logits of a few units
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[torch.rand(b, t, generator=g) < ignored] = -100
    return hidden, weight, labels


def _loss_and_grads(fn, hidden, weight, labels, dtype=None):
    """``fn(hidden, weight, labels)`` and its gradients, on leaf copies (in ``dtype``)."""
    h = hidden.detach().to(dtype or hidden.dtype).requires_grad_(True)
    w = weight.detach().to(dtype or weight.dtype).requires_grad_(True)
    loss = fn(h, w, labels)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w)))


def _plain(hidden, weight, labels):
    return lm_loss(F.linear(hidden, weight), labels)


def _plain64(hidden, weight, labels):  # lm_loss rounds to float32; this is its float64 twin
    return F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.flatten(), ignore_index=-100)


def _cross_entropy64(logits, labels):  # lm_loss in float64, the float64 model's loss_fn
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _chunked(chunk):
    return lambda hidden, weight, labels: chunked_lm_loss(hidden, weight, labels, chunk)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check_against_the_plain_path(got, plain, reference, label):
    """``got`` (chunked) and ``plain`` against the float64 ``reference``, each a tuple (loss,
    d hidden, d weight). Principle 3 of STYLE.md: the gradients within 3x the plain path's
    error (relative norm); the loss within 2x its error plus 4 float32 steps, as both errors
    are a few steps of float32 and either may be 0."""
    eps = torch.finfo(torch.float32).eps
    loss_err, loss_base = (got[0] - reference[0]).abs().item(), (plain[0] - reference[0]).abs().item()
    grad_err = [_rel(g, r) for g, r in zip(got[1:], reference[1:], strict=True)]
    grad_base = [_rel(p, r) for p, r in zip(plain[1:], reference[1:], strict=True)]
    print(f"{label}: loss {loss_err:.2e} (plain {loss_base:.2e}), d hidden {grad_err[0]:.2e} "
          f"(plain {grad_base[0]:.2e}), d weight {grad_err[1]:.2e} (plain {grad_base[1]:.2e})")
    assert loss_err <= 2 * loss_base + 4 * eps * reference[0].abs().item(), label
    for err, base in zip(grad_err, grad_base, strict=True):
        assert err <= 3 * base, label


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_float64_equals_the_plain_loss(shape):
    b, t, c, v, chunk, ignored = shape
    hidden, weight, labels = _inputs(b, t, c, v, ignored, torch.float64)
    got = _loss_and_grads(_chunked(chunk), hidden, weight, labels)
    want = _loss_and_grads(_plain64, hidden, weight, labels)
    assert got[0].dtype == torch.float64
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)  # measured: 9e-16 of the largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_float32_and_bf16_are_within_the_plain_paths_error(shape, dtype):
    """Measured (relative error against float64, chunked / plain), float32: loss up to 3.7e-7 /
    5.8e-7 absolute, gradients 2e-7 to 4e-7 / the same; bf16: the loss and the hidden states'
    gradient equal the plain path's, the weight's gradient 5.1e-3 / 4.9e-3 (its sums over
    rows are rounded to bf16 once per chunk)."""
    b, t, c, v, chunk, ignored = shape
    hidden, weight, labels = _inputs(b, t, c, v, ignored, dtype)
    got = _loss_and_grads(_chunked(chunk), hidden, weight, labels)
    plain = _loss_and_grads(_plain, hidden, weight, labels)
    reference = _loss_and_grads(_plain64, hidden, weight, labels, torch.float64)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == dtype
    _check_against_the_plain_path(got, plain, reference, f"{dtype} {shape}")


@pytest.mark.parametrize("shape", SHAPES[1:4], ids=SHAPE_IDS[1:4])
def test_bf16_autocast_projects_as_the_head_does(shape):
    """Float32 inputs under CPU bf16 autocast: the projection in bf16 (as ``nn.Linear`` under
    autocast), the loss in float32, float32 gradients."""
    b, t, c, v, chunk, ignored = shape
    hidden, weight, labels = _inputs(b, t, c, v, ignored)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _loss_and_grads(_chunked(chunk), hidden, weight, labels)
        plain = _loss_and_grads(_plain, hidden, weight, labels)
    reference = _loss_and_grads(_plain64, hidden, weight, labels, torch.float64)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float32
    assert _rel(got[2], reference[2]) > 1e-4  # rounded to bf16 on the way: autocast applied
    _check_against_the_plain_path(got, plain, reference, f"autocast {shape}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_label_left_out_gives_nan_and_zero_gradients_as_cross_entropy(dtype):
    hidden, weight, labels = _inputs(2, 9, 8, 11, 1.0, dtype)
    assert (labels == -100).all()
    got = _loss_and_grads(_chunked(4), hidden, weight, labels)
    want = _loss_and_grads(_plain64, hidden, weight, labels)
    assert got[0].isnan() and want[0].isnan()
    for g, w in zip(got[1:], want[1:], strict=True):
        assert torch.equal(g, w) and not g.any()


def test_only_the_gradients_asked_for():
    """Hidden states without ``requires_grad`` (or grad mode off): the weight's gradient (or
    none) and the same loss, bit for bit."""
    hidden, weight, labels = _inputs(2, 37, 24, 101, 0.3)
    full = _loss_and_grads(_chunked(5), hidden, weight, labels)
    w = weight.clone().requires_grad_(True)
    loss = chunked_lm_loss(hidden, w, labels, 5)
    (dw,) = torch.autograd.grad(loss, (w,))
    assert torch.equal(loss.detach(), full[0]) and torch.equal(dw, full[2])
    with torch.no_grad():
        loss = chunked_lm_loss(hidden.requires_grad_(True), w, labels, 5)
    assert loss.grad_fn is None and torch.equal(loss, full[0])


def test_bad_arguments_are_refused():
    hidden, weight, labels = _inputs(2, 5, 8, 11, 0.0)
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        chunked_lm_loss(hidden, weight, labels, 0)
    with pytest.raises(ValueError, match="labels must be integers"):
        chunked_lm_loss(hidden, weight, labels[:, 1:], 4)
    with pytest.raises(ValueError, match="hidden"):
        chunked_lm_loss(hidden, weight[:, 1:], labels, 4)
    assert chunk_rows(50304) == 1334 and chunk_rows(2**40) == 1


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_tensor_of_the_whole_logits_is_made():
    b, t, c, v, chunk = 2, 64, 16, 512, 16
    hidden, weight, labels = _inputs(b, t, c, v, 0.3)
    with _LargestTensor() as chunked:
        _loss_and_grads(_chunked(chunk), hidden, weight, labels)
    with _LargestTensor() as plain:
        _loss_and_grads(_plain, hidden, weight, labels)
    assert plain.numel == b * t * v  # the mode sees the logits where they are made
    assert chunked.numel == max(chunk * v, v * c, b * t * c) < b * t * v


def _model(dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    return Decoder(preset("tiny", "fox-pro", **overrides)).to(dtype)


def _ids(model, b, t, ignored=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (b, t + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[torch.rand(b, t, generator=g) < ignored] = -100
    return ids[:, :-1], labels


def _model_grads(model, x, y, **kwargs):
    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y, **kwargs)
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_the_model_without_logits_has_the_plain_loss_and_gradients(chunk):
    """A whole model in float64: the loss and every parameter's gradient of
    ``return_logits=False`` equal those of the logits' loss (its float64 twin) to rounding."""
    model = _model(torch.float64)
    model.loss_fn = _cross_entropy64
    x, y = _ids(model, 2, 29)
    _, loss, grads = _model_grads(model, x, y)
    model.loss_chunk = chunk
    logits, loss_c, grads_c = _model_grads(model, x, y, return_logits=False)
    assert logits is None
    torch.testing.assert_close(loss_c, loss, rtol=1e-12, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-10, atol=1e-14, msg=name)


def test_the_model_under_autocast_is_within_the_plain_paths_error():
    """Float32 weights under bf16 autocast, as the trainer runs on a CPU: each parameter's
    gradient within 3x the plain path's error against the float64 model (relative norm;
    measured: chunked / plain at most 1.1)."""
    x, y = _ids(_model(), 2, 48)
    model, model64 = _model(), _model(torch.float64)
    model64.loss_fn = _cross_entropy64
    _, loss64, grads64 = _model_grads(model64, x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss, grads = _model_grads(model, x, y)
        model.loss_chunk = 13
        _, loss_c, grads_c = _model_grads(model, x, y, return_logits=False)
    assert abs(loss_c - loss64) <= 3 * abs(loss - loss64) + 1e-6
    worst = max(_rel(grads_c[n], g) / _rel(grads[n], g) for n, g in grads64.items())
    print(f"autocast model: loss {abs(loss_c - loss64).item():.2e} (plain {abs(loss - loss64).item():.2e}), "
          f"worst gradient error ratio chunked / plain {worst:.2f}")
    assert worst <= 3


def test_the_model_makes_no_tensor_of_the_whole_logits():
    model = _model(vocab_size=1024)  # the logits are the largest tensor of the plain path
    model.loss_chunk = 8
    x, y = _ids(model, 2, 40)
    b, t, v = *x.shape, model.config.vocab_size
    with _LargestTensor() as plain:
        _model_grads(model, x, y)
    with _LargestTensor() as chunked:
        _model_grads(model, x, y, return_logits=False)
    assert plain.numel == b * t * v and chunked.numel < b * t * v, (plain.numel, chunked.numel)
    with pytest.raises(ValueError, match="needs labels"):
        model(x, return_logits=False)


def test_compiled_and_checkpointed_blocks():
    """``prepare_blocks``' checkpointing with each block compiled (``aot_eager``, as the
    checkpointing tests do on a CPU), and the whole forward compiled (the chunked loss is a
    graph break): the loss and gradients of the eager model."""
    x, y = _ids(_model(), 2, 40)
    model = _model()
    model.loss_chunk = 9
    _, loss, grads = _model_grads(model, x, y, return_logits=False)
    torch._dynamo.reset()
    prepared = _model()
    prepared.loss_chunk = 9
    prepare_blocks(prepared, activation_checkpointing=True)
    for block in prepared.blocks:
        block.compile(backend="aot_eager")
    whole = _model()
    whole.loss_chunk = 9
    for compiled in (prepared, torch.compile(whole, backend="aot_eager")):
        _, loss_c, grads_c = _model_grads(compiled, x, y, return_logits=False)
        torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=0)
        for name, g in grads_c.items():
            want = grads[name.removeprefix("_orig_mod.")]
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-7, msg=name)  # measured: 2.2e-8


@pytest.mark.parametrize("parallel", ["fsdp2", "ddp"])
def test_fsdp2_and_ddp_in_one_process(parallel, monkeypatch):
    """Through FSDP2 (``fully_shard`` per block and on the root, as ``lapse.train.
    distributed.parallelize``) and DDP, one process on gloo: ``return_logits=False`` reaches
    the model, the head's weight it sees is the gathered plain one, and the loss and the
    (sharded) gradients equal the unwrapped model's (float64, to rounding)."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo and no process group yet")
    from torch.distributed.tensor import DTensor

    import lapse.models.decoder as decoder

    seen = []

    def spy(hidden, weight, labels, chunk):
        seen.append(type(weight))
        return chunked_lm_loss(hidden, weight, labels, chunk)

    monkeypatch.setattr(decoder, "chunked_lm_loss", spy)
    model, plain = _model(torch.float64), _model(torch.float64)
    model.loss_chunk = plain.loss_chunk = 7
    x, y = _ids(model, 2, 21)
    _, loss, grads = _model_grads(plain, x, y, return_logits=False)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        if parallel == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (1,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh, reshard_after_forward=False)
            assert isinstance(model.lm_head.weight, DTensor)
        else:
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        logits, loss_w = wrapped(x, y, return_logits=False)
        loss_w.backward()
    finally:
        dist.destroy_process_group()
    assert logits is None and seen == [torch.nn.Parameter, torch.nn.Parameter]
    torch.testing.assert_close(loss_w.detach(), loss, rtol=1e-12, atol=0)
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(g, grads[name], rtol=1e-10, atol=1e-14, msg=name)


@pytest.mark.gpu
def test_peak_memory_follows_the_chunk_not_the_logits_on_cuda():
    """One row of 16384 positions at the 125M model's head (C 768, V 50304), bf16 autocast:
    the memory the loss adds to its input (its forward and backward, gradients included)
    stays under a quarter of the plain loss's, and the loss and gradients agree."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    b, t, c, v = 1, 16384, 768, 50304
    hidden, weight, labels = (a.cuda() for a in _inputs(b, t, c, v, 0.1))
    peaks, results = {}, {}
    for name, fn in (("plain", _plain), ("chunked", _chunked(chunk_rows(v)))):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(h, w, labels)
        loss.backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        results[name] = (loss.detach(), h.grad, w.grad)
        del h, w, loss
    print({k: f"{p / 2**30:.2f} GiB" for k, p in peaks.items()})
    assert peaks["chunked"] < peaks["plain"] / 4
    reference = _loss_and_grads(_plain64, hidden, weight, labels, torch.float64)
    # the plain path's bf16 error as the baseline, as on the CPU
    _check_against_the_plain_path(results["chunked"], results["plain"], reference, "cuda bf16 autocast")
