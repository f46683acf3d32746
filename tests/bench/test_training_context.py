"""``lapse bench train --cp N`` under torchrun: every variant trains one row across N CPU
processes (gloo) and takes the one-process steps; its one-line refusals; and the model set-up
of the torch baseline (``Decoder.set_context(..., attention=False)``), checked with an SDPA
that attends across the processes in place of torch's ring attention (which needs CUDA)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lapse.cli import main
from lapse.layers import ContextParallel
from lapse.models import Decoder, ModelConfig

COMMON = ["--preset", "tiny", "--seq-len", "64", "--batch-size", "2", "--micro-batch-size", "1",
          "--steps", "1", "--warmup", "1", "--variants", "dense", "acp", "transformer"]


def _bench(args: list[str], nproc: int | None, out) -> dict:
    """``lapse bench train`` in a fresh process, or under torchrun in ``nproc`` of them."""
    launch = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone",
                                       f"--nproc-per-node={nproc}"]
    cmd = [sys.executable, *launch, "-m", "lapse.cli", "bench", "train", *args, "--out-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads in both runs: the same bf16 sums
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _bench(COMMON, None, tmp_path_factory.mktemp("one"))


# The timed step follows one AdamW step (lr 1e-4) under bf16 autocast. Measured against one
# process: the losses differ by at most 3.5e-5 of the loss (gather 1.6e-5 / 3.5e-5, head
# 0.9e-5 / 0.6e-5 for FoX / the Transformer); before any update (--warmup 0) by at most 5e-8,
# and with autocast off by 1e-7 after an update at lr 1e-2: the rest is bf16 rounding of the
# gradients, which AdamW's first step (each weight moved by lr times the sign of its
# gradient) carries into the loss.
REL = 1e-4


@pytest.mark.parametrize("mode", ["gather", "head"])
def test_two_processes_take_the_one_process_steps(one_process, tmp_path, mode):
    result = _bench(["--cp", "2", "--cp-mode", mode, *COMMON], 2, tmp_path)
    assert result["context_parallel"] == {"cp": 2, "mode": mode, "padded_seq_len": 64,
                                          "torch_rotate_method": None}
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["dense", "acp", "transformer"]
    for r in one_process["rows"]:
        assert rows[r["variant"]]["loss"] == pytest.approx(r["loss"], rel=REL), r["variant"]
    assert rows["acp"]["speedup_vs_torchcp"] is None and rows["acp"]["speedup_vs_dense"] > 0
    text = (tmp_path / "results.md").read_text()
    assert f"context parallel over 2 processes, mode {mode}" in text.splitlines()[0]
    assert "| vs dense | vs transformer | vs torch CP | TFLOP/s |" in text


def test_data_parallel_processes_share_the_rows(one_process, tmp_path):
    """``--cp 1`` under torchrun: FSDP2 data parallelism, each process one of the 2 rows; the
    same steps as one process (the loss the mean of both rows)."""
    result = _bench(COMMON, 2, tmp_path)
    assert result["context_parallel"] is None and result["device"].startswith("2 x ")
    rows = {r["variant"]: r for r in result["rows"]}
    for r in one_process["rows"]:
        assert rows[r["variant"]]["loss"] == pytest.approx(r["loss"], rel=REL), r["variant"]
    assert "2 data-parallel groups of 1 rows" in (tmp_path / "results.md").read_text().splitlines()[0]


def test_data_groups_of_context_parallel_processes_take_the_one_process_steps(one_process, tmp_path):
    """4 processes with ``--cp 2``: 2 data-parallel groups, each splitting its row over 2."""
    result = _bench(["--cp", "2", *COMMON], 4, tmp_path)
    assert result["context_parallel"]["cp"] == 2 and result["device"].startswith("4 x ")
    rows = {r["variant"]: r for r in result["rows"]}
    for r in one_process["rows"]:
        assert rows[r["variant"]]["loss"] == pytest.approx(r["loss"], rel=REL), r["variant"]
    first = (tmp_path / "results.md").read_text().splitlines()[0]
    assert "context parallel over 2 processes" in first and "2 data-parallel groups of 1 rows" in first


@pytest.mark.parametrize(
    "args,message",
    [
        (["--cp", "2"],
         "--cp 2 needs a multiple of 2 processes, each holding its share of every row (not under torchrun): "
         "launch it as torchrun --standalone --nproc-per-node 2 -m lapse.cli bench train --cp 2 ..."),
        (["--variants", "transformer-torchcp"],
         "transformer-torchcp is torch's context parallelism across processes: give --cp N > 1 "
         "(under torchrun)"),
        (["--cp", "2", "--variants", "acp-cudagraphs"],
         "acp-cudagraphs does not run with cp > 1 (the graphs would hold FSDP's gathered weights): "
         "use -compile"),
    ],
    ids=["cp-without-torchrun", "torchcp-without-cp", "cudagraphs-with-cp"],
)
def test_bench_train_cp_refusals_are_one_line(args, message, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("LAPSE_DEBUG", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["bench", "train", "--preset", "tiny", "--out-dir", str(tmp_path), *args])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {message}"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_torch_context_parallelism_needs_cuda(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("LAPSE_DEBUG", raising=False)
    with pytest.raises(SystemExit):
        main(["bench", "train", "--preset", "tiny", "--cp", "2", "--variants", "transformer-torchcp-compile",
              "--out-dir", str(tmp_path)])
    assert capsys.readouterr().err.splitlines() == [
        "error: transformer-torchcp-compile: torch's context parallelism needs CUDA SDPA (its ring attention "
        "replaces the flash, memory-efficient and cuDNN kernels only); no CUDA GPU is visible"
    ]


def test_speedups_over_torch_context_parallelism_stay_within_a_compile_mode():
    from lapse.bench.training import _add_speedups

    rows = [{"variant": v, "tokens_per_s": r} for v, r in (
        ("acp-compile", 300.0), ("transformer-torchcp-compile", 100.0), ("transformer-torchcp", 50.0),
        ("dense", 80.0))]
    _add_speedups(rows)
    got = {r["variant"]: (r["speedup_vs_torchcp"], r["torchcp_reference"]) for r in rows}
    assert got == {"acp-compile": (3.0, "transformer-torchcp-compile"),
                   "transformer-torchcp-compile": (1.0, "transformer-torchcp-compile"),
                   "transformer-torchcp": (1.0, "transformer-torchcp"), "dense": (1.6, "transformer-torchcp")}


def test_local_attention_is_for_softmax_only():
    model = Decoder(_config("forgetting"))
    with pytest.raises(ValueError, match="softmax attention only, got ForgettingAttention"):
        model.set_context(ContextParallel(None, 2, 0, "gather"), attention=False)


def _config(attention: str) -> ModelConfig:
    return ModelConfig(attention=attention, block="pro", vocab_size=61, d_model=32, n_layers=2, n_heads=4,
                       mlp_hidden_size=48, max_seq_len=64, attn_backend="torch")


def _worker(rank: int, size: int, port: int, out: str) -> None:
    """A Pro softmax model (KV-shift: its neighbours cross the chunks) with ``attention=False``
    and SDPA replaced by attention over every rank's keys, as torch's ring attention does:
    the one-process logits, loss and gradients, in float64."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    ctx = ContextParallel.of(None, "gather")
    sdpa = F.scaled_dot_product_attention

    def across_ranks(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert attn_mask is None and is_causal  # [B, H, 2n, D]: this rank's chunks, causal in their order
        keys, values = (ctx.gather(t.transpose(1, 2)).transpose(1, 2) for t in (k, v))  # [B, K, T, D]
        at = ctx.positions(q.shape[2], q.device)[0]  # [2n]
        mask = at[:, None] >= torch.arange(keys.shape[2])[None]  # [2n, T]
        return sdpa(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)

    torch.manual_seed(0)
    one = Decoder(_config("softmax")).double()
    model = Decoder(_config("softmax")).double()
    model.load_state_dict(one.state_dict())
    model.set_context(ctx, attention=False)
    ids = torch.randint(0, 61, (2, 14), generator=torch.Generator().manual_seed(1))
    x, y = F.pad(ids[:, :-1], (0, 3), value=0), F.pad(ids[:, 1:], (0, 3), value=-100)  # T 13 -> 16
    logits_one, loss_one = one(x, y)
    loss_one.backward()
    F.scaled_dot_product_attention = across_ranks
    try:
        logits, loss = model(ctx.split(x), ctx.split(y))
        loss.backward()
    finally:
        F.scaled_dot_product_attention = sdpa
    total = ctx.total(loss) / size  # each rank's loss: its share of the rows' mean, times size
    errors = {"logits": float((logits - ctx.split(logits_one)).detach().abs().max() / logits_one.abs().max()),
              "loss": float((total - loss_one.detach()).abs() / loss_one.detach())}
    for (name, p), q in zip(model.named_parameters(), one.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # averaged over ranks by FSDP in training: their sum / size
        errors[name] = float((grad / size - q.grad).abs().max() / q.grad.abs().max())
    if rank == 0:
        with open(out, "w") as f:
            json.dump(errors, f)
    dist.destroy_process_group()


def test_local_attention_with_attention_across_ranks_is_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "errors.json"
    mp.start_processes(_worker, args=(2, port, str(out)), nprocs=2, start_method="spawn")
    errors = json.loads(out.read_text())
    assert errors.pop("loss") < 1e-6  # a float32 scalar
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-10, f"{worst} off by {errors[worst]:.2e}"
