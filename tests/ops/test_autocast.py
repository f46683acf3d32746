"""The attention ops under ``torch.autocast`` on the CPU (bfloat16 and float16), every backend.

An op computes in the dtypes of its inputs whatever autocast says (autocast is off inside
it: ``lapse.ops.backend.autocast_off``), so under autocast its output has ``q``'s dtype,
float32 inputs give exactly the float32 op's results, and 16-bit inputs (what autocast's
projections hand it in a model) stay within the measured error of the float32 op. The
forward runs under autocast and the backward after it, as the trainer does; the backwards
that are autograd Functions also run inside it. Then one training step of tiny FoX (ACP),
CASTLE and DCP models under bfloat16 autocast, and the two commands that train with it.

Forgetting attention's torch backend runs with its chunks shrunk to ``ACP_BLOCK`` here, so
that T = 130 has key tiles that one kv head skips (ACP) while the other needs them: the
tiles whose products the chunked path writes by index into its float32 accumulators.
The Triton cases run on the interpreter (a CPU without CUDA, tests/conftest.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import lapse.ops.forgetting.chunked as chunked
from lapse.cli import main as cli_main
from lapse.models import Decoder, preset
from lapse.models.checkpoint import file_digest, latest_checkpoint
from lapse.ops.backend import triton_usable
from lapse.ops.castle import castle_attention
from lapse.ops.dcp import dcp_attention, interaction_log_mask
from lapse.ops.forgetting import ACP_BLOCK, forgetting_attention
from lapse.train import train, train_preset

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: threads only wait on each other

AUTOCAST = {"bf16": torch.bfloat16, "f16": torch.float16}
# A run on 16-bit inputs against the float32 op on the float32 ones: max |x - ref| / max |ref|
# of o and of each gradient, largest over the backends and the ACP settings, measured 6.3e-3
# in bfloat16 (naive dv; the torch backend's largest 4.2e-3) and 7.6e-4 in float16 (naive dk;
# torch 5.6e-4, triton 5.7e-4). The tolerances sit a little above.
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}
NAMES = ("o", "dq", "dk", "dv", "dlog_fgate")

# T not a multiple of 64 (three ACP query blocks, the last of two rows), D not a power of
# two, grouped-query heads
B, T, HQ, H, D = 1, 130, 4, 2, 48


def _needs_interpreter(backend: str) -> None:
    if backend.startswith("triton") and not triton_usable(torch.empty(0)):
        pytest.skip("the Triton backends on CPU tensors need the interpreter")


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_Q", ACP_BLOCK)
    monkeypatch.setattr(chunked, "CHUNK_K", ACP_BLOCK)


@functools.cache
def _fox_inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, HQ, D, generator=g)
    k = torch.randn(B, T, H, D, generator=g)
    v = torch.randn(B, T, H, D, generator=g)
    # kv head 0's query heads forget fast (log f ~ -2.1: ACP skips tiles), kv head 1's slowly
    log_fgate = F.logsigmoid(torch.randn(B, T, HQ, generator=g) + torch.tensor([-2.0, -2.0, 6.0, 6.0]))
    do = torch.randn(B, T, HQ, D, generator=g)
    return q, k, v, log_fgate, do


def _fox(backend, acp, dtype, autocast=None, backward_inside=False):
    """``(o, dq, dk, dv, dlog_fgate)`` and the stats of one call on inputs in ``dtype``, the
    forward under ``autocast`` (a dtype, or None), the backward after it (or inside)."""
    q, k, v, log_fgate, do = _fox_inputs()
    xs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    lf = log_fgate.clone().requires_grad_()  # float32 whatever the autocast
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        o, stats = forgetting_attention(*xs, lf, acp=acp, backend=backend, return_stats=True)
        if backward_inside:
            grads = torch.autograd.grad(o, (*xs, lf), do.to(o.dtype))
    if not backward_inside:
        grads = torch.autograd.grad(o, (*xs, lf), do.to(o.dtype))
    return (o, *grads), stats


@functools.cache
def _fox_float32(backend, acp):
    return _fox(backend, acp, torch.float32)


def _max_err(x, ref) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


FOX_CASES = [
    (backend, name, acp, inputs)
    for backend in ("naive", "torch", "triton")
    for name in AUTOCAST
    for acp in (None, "auto", 2.0)
    for inputs in ("f32", "low")
    # the Triton interpreter's bfloat16 products are wrong: the op refuses them on the CPU
    if not (backend == "triton" and name == "bf16" and inputs == "low")
]


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize(
    ("backend", "name", "acp", "inputs"), FOX_CASES,
    ids=[f"{b}-{n}-acp_{a}-in_{i}" for b, n, a, i in FOX_CASES],
)
def test_forgetting_attention_under_autocast(backend, name, acp, inputs):
    _needs_interpreter(backend)
    low = AUTOCAST[name]
    dtype = torch.float32 if inputs == "f32" else low
    got, stats = _fox(backend, acp, dtype, autocast=low)
    ref, ref_stats = _fox_float32(backend, acp)
    for n, x in zip(NAMES, got, strict=True):
        assert x.dtype == (torch.float32 if n == "dlog_fgate" else dtype), n
        assert not x.isnan().any(), n
    assert torch.equal(stats.block_start, ref_stats.block_start)  # the same tiles pruned
    if acp is not None:  # kv head 0's query heads skip tiles, kv head 1's none
        assert (stats.pruned_fraction[:, :2] > 0).all() and (stats.pruned_fraction[:, 2:] == 0).all()
    for n, x, r in zip(NAMES, got, ref, strict=True):
        if dtype == torch.float32:
            assert torch.equal(x, r), f"{n}: autocast changed a float32 result"
        else:
            err = _max_err(x, r)
            assert err <= TOL[dtype], f"{n}: {err:.2e} from the float32 op (tolerance {TOL[dtype]:.0e})"


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forgetting_backward_inside_autocast(backend):
    """The torch and Triton backwards are autograd Functions, which run under an autocast
    block they are called in: the same gradients as called after it."""
    _needs_interpreter(backend)
    inside, _ = _fox(backend, "auto", torch.float32, autocast=torch.bfloat16, backward_inside=True)
    after, _ = _fox_float32(backend, "auto")
    for n, x, r in zip(NAMES, inside, after, strict=True):
        assert torch.equal(x, r), n


def _castle_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    t, hq, h, d = 40, 4, 2, 16
    shapes = [(1, t, hq, d), (1, t, h, d), (1, t, h, d), (1, t, hq, d), (1, t, h, d), (1, t, h, d)]
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _castle(backend, dtype, autocast):
    xs = _castle_inputs(dtype)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        o, lse = castle_attention(*xs, backend=backend, return_lse=True)
    grads = torch.autograd.grad((o.float().sum() + lse.sum()), xs)
    return o, lse, *grads


CASTLE_CASES = [
    *((backend, name, inputs)
      for backend in ("naive", "torch") for name in AUTOCAST for inputs in ("f32", "low")),
    # the Triton paths' host code has no product autocast would take (and the interpreter is
    # slow): the trainer's case only
    ("triton", "bf16", "f32"),
    ("triton-parallel", "bf16", "f32"),
]


@pytest.mark.parametrize(
    ("backend", "name", "inputs"), CASTLE_CASES, ids=[f"{b}-{n}-in_{i}" for b, n, i in CASTLE_CASES]
)
def test_castle_attention_ignores_autocast(backend, name, inputs):
    """CASTLE under autocast gives exactly what it gives without it (its accuracy in each
    dtype is test_castle_torch.py's and test_castle_triton.py's)."""
    _needs_interpreter(backend)
    low = AUTOCAST[name]
    dtype = torch.float32 if inputs == "f32" else low
    got = _castle(backend, dtype, low)
    ref = _castle(backend, dtype, None)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for i, (x, r) in enumerate(zip(got, ref, strict=True)):
        assert torch.equal(x, r), i


@pytest.mark.parametrize("backend", ["naive", "torch"])
@pytest.mark.parametrize("name", list(AUTOCAST))
@pytest.mark.parametrize("inputs", ["f32", "low"])
def test_dcp_attention_ignores_autocast(backend, name, inputs):
    """DCP attention (SDPA with the mask as a bias on the torch backend) under autocast
    gives exactly what it gives without it: float32 inputs stay float32."""
    low = AUTOCAST[name]
    dtype = torch.float32 if inputs == "f32" else low
    runs = []
    for autocast in (low, None):
        g = torch.Generator().manual_seed(2)
        q = torch.randn(1, 70, 4, 16, generator=g).to(dtype).requires_grad_()
        k, v = (torch.randn(1, 70, 2, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))
        q_int, k_int = (torch.randn(1, 70, 8, generator=g).requires_grad_() for _ in range(2))
        with torch.autocast("cpu", dtype=low, enabled=autocast is not None):
            log_i = interaction_log_mask(q_int, k_int, -0.5, 4.0)  # beta < 0: it drops
            o = dcp_attention(q, k, v, log_i, backend=backend)
        runs.append((o, *torch.autograd.grad(o.float().sum(), (q, k, v, q_int, k_int))))
    assert runs[0][0].dtype == dtype
    for i, (x, r) in enumerate(zip(*runs, strict=True)):
        assert torch.equal(x, r), i


MODELS = {
    "fox-pro-acp": dict(arch="fox-pro", acp=True),
    "castle": dict(arch="castle"),
    "dcp": dict(arch="transformer-llama", attention="dcp", acp=False, dcp_r=4, dcp_beta_init=-0.4),
}


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("kind", list(MODELS))
def test_a_training_step_under_bf16_autocast(kind):
    """Forward and loss under CPU bfloat16 autocast, backward after it (the trainer's step):
    the loss and the gradients against the float32 step's. Measured: losses (about 4.86)
    1.8e-5 (FoX), 2.4e-5 (CASTLE), 4.2e-5 (DCP) apart; gradients 8.1e-3, 3.8e-3, 5.3e-3 of
    their norm apart. The tolerances sit a little above."""
    overrides = dict(MODELS[kind])
    cfg = preset("tiny", overrides.pop("arch"), n_kv_heads=2, max_seq_len=T, **overrides)
    torch.manual_seed(0)
    model = Decoder(cfg)
    if cfg.acp:  # as a trained FoX model: kv head 0's query heads forget fast, kv head 1's slowly
        with torch.no_grad():
            for block in model.blocks:
                block.attn.fgate.bias.copy_(torch.tensor([-2.0, -2.0, 6.0, 6.0]))
        model.set_collect_stats(True)
    ids = torch.randint(0, cfg.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(0))
    steps = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
            _, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert torch.isfinite(loss) and torch.isfinite(grads).all()
        steps[dtype] = loss.item(), grads
        if cfg.acp:
            assert model.pruned_fractions()[:, :2].min() > 0  # ACP skipped tiles in every layer
    (l32, g32), (l16, g16) = steps[torch.float32], steps[torch.bfloat16]
    assert abs(l16 - l32) < 6e-5
    assert ((g16 - g32).norm() / g32.norm()).item() < 1e-2


@pytest.fixture(scope="module")
def fox_run(tmp_path_factory) -> tuple[Path, Path]:
    """A one-step cpu-tiny FoX (Pro) run with ACP at context 512 (cpu-small's) whose forget
    gates are then set as a trained model's are: in every layer query heads 0 and 2 forget
    within a few tokens (ACP skips most of their tiles) and heads 1 and 3 barely, so a
    query chunk has key tiles one kv head skips and the other needs. Returns the run folder
    and the data folder."""
    tmp = tmp_path_factory.mktemp("autocast")
    cfg = train_preset(
        "cpu-tiny", run_dir=tmp / "run", data_dir=tmp / "data", steps=1, val_every=0,
        model=preset("tiny", "fox-pro", acp=True, vocab_size=320, max_seq_len=512),
    )
    train(cfg)
    folder = latest_checkpoint(tmp / "run")
    weights = load_file(folder / "model.safetensors")
    for name in weights:
        if name.endswith("fgate.bias"):
            weights[name] = torch.tensor([-2.0, 6.0] * (weights[name].numel() // 2))
    save_file(weights, folder / "model.safetensors", metadata={"step": "1"})
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = file_digest(folder / "model.safetensors")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return tmp / "run", tmp / "data"


def test_train_init_from_a_pruning_fox_run_in_bfloat16(fox_run, tmp_path, capsys):
    """``lapse train cpu-tiny --init-from RUN --precision bfloat16 --steps 1``: ACP prunes
    from the first step under CPU bfloat16 autocast."""
    run, data = fox_run
    cli_main(["train", "cpu-tiny", "--init-from", str(run), "--precision", "bfloat16", "--steps", "1",
              "--batch-size", "2", "--run-dir", str(tmp_path / "tuned"), "--data-dir", str(data),
              "--val-every", "0"])
    assert "finished at step 1/1" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "tuned" / "metrics.jsonl").read_text().splitlines()]
    acp = [r for r in records if r["kind"] == "acp"]
    assert acp and acp[-1]["pruned"] > 0


def test_bench_train_acp_from_a_pruning_fox_run(fox_run, tmp_path):
    """``lapse bench train --run RUN --seq-len 512 --batch-size 2 --steps 1 --variants acp``
    (bfloat16 autocast; no warm-up step here)."""
    run, _ = fox_run
    cli_main(["bench", "train", "--run", str(run), "--seq-len", "512", "--batch-size", "2", "--steps", "1",
              "--warmup", "0", "--variants", "acp", "--out-dir", str(tmp_path)])
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["variant"] == "acp" and row["pruned"] > 0 and row["loss"] > 0


@pytest.mark.parametrize("kind", ["castle", "dcp"])
def test_the_ops_trace_whole_under_autocast(kind):
    """Turning autocast off inside the ops costs a compiled layer nothing: Dynamo traces
    them in one graph (``fullgraph`` raises at a graph break), with autocast on around.
    (A compiled FoX layer calls the custom ops of ``lapse.ops.forgetting.library`` instead.)"""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 70, 2, 16, generator=g) for _ in range(3))
    if kind == "castle":
        def call(q, k, v):
            return castle_attention(q, k, v, q, k, v, backend="naive")
    else:
        log_i = interaction_log_mask(torch.randn(1, 70, 4, generator=g), torch.randn(1, 70, 4, generator=g),
                                     0.3, 2.0)
        call = functools.partial(dcp_attention, log_i=log_i, backend="torch")

    def fn(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return call(q, k, v)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="eager")(q, k, v), fn(q, k, v))
