"""The training pipeline on CPU: run folder, exact resume, interruption, bad configs,
data parallelism (gloo) against one process."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lapse.cli import main as cli_main
from lapse.data import CorpusConfig
from lapse.models import preset
from lapse.models.checkpoint import (
    checkpoint_folders,
    checkpoint_step,
    file_digest,
    latest_checkpoint,
    model_config_from_json,
)
from lapse.train import (
    TrainConfig,
    lr_at,
    read_metrics,
    resume,
    train,
    train_preset,
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """One tokenised corpus cache shared by the module's runs."""
    return tmp_path_factory.mktemp("data")


def tiny(tmp_path: Path, data_dir: Path, **overrides) -> TrainConfig:
    return train_preset("cpu-tiny", run_dir=tmp_path / "run", data_dir=data_dir, **overrides)


def kinds(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind]


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10], strict=False))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[-1] == pytest.approx(1e-4)


def test_run_folder_has_everything_and_loss_falls(tmp_path, data_dir):
    summary = train(tiny(tmp_path, data_dir, steps=30))
    run = Path(summary["run_dir"])
    assert summary["status"] == "finished" and summary["step"] == 30
    for name in (
        "config.json",
        "checkpoint.json",
        "metrics.jsonl",
        "loss.png",
        "report.md",
        "summary.json",
        "tokenizer",
    ):
        assert (run / name).exists(), name
    assert not [p for p in run.rglob("*") if ".tmp-" in p.name]
    records = read_metrics(run)
    losses = [r["loss"] for r in kinds(records, "train")]
    assert [r["step"] for r in kinds(records, "train")] == list(range(1, 31))
    assert losses[0] > math.log(258) - 0.5  # starts near uniform over the byte vocabulary
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    val = kinds(records, "val")
    assert [r["step"] for r in val] == [10, 20, 30] and val[-1]["loss"] < val[0]["loss"]
    acp = kinds(records, "acp")
    assert [r["step"] for r in acp] == [5, 10, 15, 20, 25, 30]
    assert len(acp[0]["pruned_per_head"]) == 2 and len(acp[0]["pruned_per_head"][0]) == 4
    folder = latest_checkpoint(run)
    weights = load_file(folder / "model.safetensors")
    assert "blocks.0.attn.fgate.bias" in weights
    report = (run / "report.md").read_text()
    assert "finished" in report and "validation loss" in report



def test_acp_statistics_at_the_last_step_too(tmp_path, data_dir):
    """As validation, the ACP statistics are also taken at the last step, so a run shorter than
    acp_stats_every still reports its pruning (a 40-step cpu-small run had none)."""
    run = train(tiny(tmp_path, data_dir, steps=7, acp_stats_every=5, checkpoint_every=0, val_every=0))
    assert [r["step"] for r in kinds(read_metrics(Path(run["run_dir"])), "acp")] == [5, 7]

def test_mfu_of_an_acp_run_counts_the_flops_done(tmp_path, data_dir):
    """With ACP, MFU leaves the pruned tiles out at the last measured share (none before the
    first ``acp`` record; the record of a statistics step counts that step's pruning) and the
    summary's at the mean of the measurements; the dense-equivalent MFU stands beside it.
    At T = 512 a fresh init prunes, so the two differ."""
    from lapse.models import flops_per_token

    cfg = tiny(tmp_path, data_dir, seq_len=512, batch_size=2, steps=6, acp_stats_every=3, val_every=0,
               checkpoint_every=0, peak_tflops=1.0)
    summary = train(cfg)
    records = read_metrics(Path(summary["run_dir"]))
    acp = {r["step"]: r["pruned"] for r in kinds(records, "acp")}
    assert list(acp) == [3, 6] and min(acp.values()) > 0.1
    dense = flops_per_token(cfg.model, 512)
    for r in kinds(records, "train"):
        assert r["mfu_dense_equivalent"] == pytest.approx(r["tokens_per_s"] * dense / 1e12)
        if r["step"] < 3:
            assert r["mfu"] is None
            continue
        done = flops_per_token(cfg.model, 512, pruned=acp[3 if r["step"] < 6 else 6])
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * done / 1e12)
        assert r["mfu"] < r["mfu_dense_equivalent"]
    mean = (acp[3] + acp[6]) / 2
    assert summary["acp_pruned_mean"] == pytest.approx(mean)
    assert summary["mfu"] == pytest.approx(
        summary["tokens_per_s"] * flops_per_token(cfg.model, 512, pruned=mean) / 1e12)
    assert summary["mfu_dense_equivalent"] == pytest.approx(summary["tokens_per_s"] * dense / 1e12)
    report = (Path(summary["run_dir"]) / "report.md").read_text()
    assert f"MFU {100 * summary['mfu']:.1f}% (FLOPs done" in report and "dense-equivalent" in report


def test_exact_resume_continues_the_same_curve(tmp_path, data_dir):
    straight = train(tiny(tmp_path / "a", data_dir, steps=16, checkpoint_every=0))
    first = train(tiny(tmp_path / "b", data_dir, steps=16, checkpoint_every=0, stop_at_step=7))
    assert first["status"] == "stopped" and first["step"] == 7
    resumed = resume(first["run_dir"])
    assert resumed["status"] == "finished" and resumed["step"] == 16

    a, b = read_metrics(Path(straight["run_dir"])), read_metrics(Path(resumed["run_dir"]))
    for kind in ("train", "val", "acp"):
        ka, kb = kinds(a, kind), kinds(b, kind)
        assert [r["step"] for r in ka] == [r["step"] for r in kb]
        key = "pruned" if kind == "acp" else "loss"
        assert [r[key] for r in ka] == [r[key] for r in kb], kind  # bitwise equal
    wa = load_file(latest_checkpoint(Path(straight["run_dir"])) / "model.safetensors")
    wb = load_file(latest_checkpoint(Path(resumed["run_dir"])) / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_after_the_end_extends_the_run(tmp_path, data_dir, capsys):
    done = train(tiny(tmp_path, data_dir, steps=5, val_every=0, acp_stats_every=0))
    capsys.readouterr()
    assert resume(done["run_dir"])["step"] == 5  # nothing to do: it says how to train on
    assert "has done all its 5 steps: to train on, give a larger total (--steps N)" in capsys.readouterr().out
    more = resume(done["run_dir"], steps=8)
    assert "has done all its" not in capsys.readouterr().out
    assert more["step"] == 8
    steps = [r["step"] for r in kinds(read_metrics(Path(done["run_dir"])), "train")]
    assert steps == list(range(1, 9))


def test_new_run_refuses_a_folder_with_a_checkpoint(tmp_path, data_dir):
    train(tiny(tmp_path, data_dir, steps=2, val_every=0))
    with pytest.raises(ValueError, match="lapse resume"):
        train(tiny(tmp_path, data_dir, steps=2, val_every=0))


def test_paths_given_as_strings_work_as_the_readme_shows(tmp_path, data_dir):
    """README: ``train(train_preset("cpu-small", steps=50, run_dir="runs/try"))``; a string
    run_dir failed with ``'str' object has no attribute 'is_dir'`` before the first step."""
    cfg = train_preset("cpu-tiny", run_dir=str(tmp_path / "run"), data_dir=str(data_dir), steps=2,
                       val_every=0, init_from=None)
    assert isinstance(cfg.run_dir, Path) and isinstance(cfg.data_dir, Path)
    summary = train(cfg)
    assert summary["status"] == "finished" and Path(summary["run_dir"]) == tmp_path / "run"


def test_accumulation_matches_the_whole_batch(tmp_path, data_dir):
    whole = train(tiny(tmp_path / "a", data_dir, steps=6, val_every=0, acp_stats_every=0))
    accum = train(tiny(tmp_path / "b", data_dir, steps=6, val_every=0, acp_stats_every=0, micro_batch_size=1))
    la = [r["loss"] for r in kinds(read_metrics(Path(whole["run_dir"])), "train")]
    lb = [r["loss"] for r in kinds(read_metrics(Path(accum["run_dir"])), "train")]
    # Same rows, same mean; only the summation order differs (float32).
    assert la == pytest.approx(lb, rel=1e-5, abs=1e-5)


def test_activation_checkpointing_gives_the_same_losses(tmp_path, data_dir):
    plain = train(tiny(tmp_path / "a", data_dir, steps=4, val_every=0, acp_stats_every=0))
    ckpt = train(
        tiny(tmp_path / "b", data_dir, steps=4, val_every=0, acp_stats_every=0, activation_checkpointing=True)
    )
    la = [r["loss"] for r in kinds(read_metrics(Path(plain["run_dir"])), "train")]
    lb = [r["loss"] for r in kinds(read_metrics(Path(ckpt["run_dir"])), "train")]
    assert la == lb


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"model": "heads"}, "must divide d_model"),
        ({"corpus": CorpusConfig(kind="text", paths=("/nonexistent/corpus",))}, "does not exist"),
        ({"tokenizer": "/nonexistent/tok"}, "does not exist"),
        ({"batch_size": 6, "micro_batch_size": 4}, "micro_batch_size"),
        ({"steps": 0}, "steps must be a positive integer"),
        ({"peak_tflops": -3.0}, "peak_tflops must be positive"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*32\)"),
    ],
    ids=["heads", "corpus-path", "tokenizer-path", "micro-batch", "steps", "peak-tflops", "seed"],
)
def test_bad_configs_fail_at_construction(overrides, match):
    if overrides.get("model") == "heads":
        with pytest.raises(ValueError, match=match):
            preset("tiny", "fox-pro", n_heads=3)
        return
    with pytest.raises(ValueError, match=match):
        train_preset("cpu-tiny", **overrides)


@pytest.mark.parametrize(
    "overrides, size, device, why",
    [
        ({}, 1, "cuda", None),
        ({"preset": "125m-16k"}, 1, "cuda", None),
        ({"cuda_graphs": False}, 1, "cuda", "--no-cuda-graphs"),
        ({"compile": False}, 1, "cuda", "not compiled"),
        ({}, 2, "cuda", "2 processes"),
        ({}, 1, "cpu", "on cpu"),
        ({"activation_checkpointing": True}, 1, "cuda", "activation checkpointing"),
    ],
    ids=["gpu-20m", "125m-16k", "off", "eager", "fsdp", "cpu", "checkpointing"],
)
def test_compiled_gpu_runs_take_cuda_graphs_by_default(overrides, size, device, why):
    """The GPU presets replay their compiled blocks as CUDA graphs without a flag, wherever the
    run allows it; elsewhere they say why not (the report prints which ran)."""
    from lapse.train.distributed import World
    from lapse.train.trainer import cuda_graphs_off

    name = overrides.pop("preset", "gpu-20m")
    cfg = train_preset(name, **overrides)
    off = cuda_graphs_off(cfg, World(rank=0, size=size, local_rank=0, device=torch.device(device)))
    assert off is None if why is None else why in off


def test_unknown_preset_and_empty_corpus_fail_at_start(tmp_path, data_dir):
    """A run that fails before it starts (here its corpus is empty) leaves no trace: the run
    folder it made is removed (it left a lock and config.json, so each retry without ``--run-dir``
    left one more dated folder), and a folder that was empty is empty again."""
    with pytest.raises(ValueError, match="unknown training preset"):
        train_preset("nope")
    with pytest.raises(SystemExit):
        cli_main(["train", "nope"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    cfg = tiny(
        tmp_path, tmp_path / "data", corpus=CorpusConfig(kind="text", paths=(str(tmp_path / "empty"),))
    )
    with pytest.raises(ValueError, match="empty corpus|no documents"):
        train(cfg)
    assert not (tmp_path / "run").exists()
    (tmp_path / "made").mkdir()
    with pytest.raises(ValueError, match="empty corpus|no documents"):
        train(replace(cfg, run_dir=tmp_path / "made"))
    assert list((tmp_path / "made").iterdir()) == []


def test_cli_train_with_overrides(tmp_path, data_dir, capsys):
    cli_main(
        [
            "train",
            "cpu-tiny",
            "--run-dir",
            str(tmp_path / "run"),
            "--data-dir",
            str(data_dir),
            "--steps",
            "3",
            "--model.no-acp",
            "--model.arch",
            "transformer-llama",
            "--val-every",
            "0",
        ]
    )
    out = capsys.readouterr().out
    assert "finished at step 3/3" in out
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert model_config_from_json(saved["model"]).name == "transformer-llama" and saved["steps"] == 3


def _run_cli(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "lapse.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def test_sigint_leaves_a_valid_checkpoint_and_a_resumable_run(tmp_path, data_dir):
    run = tmp_path / "run"
    proc = _run_cli(
        [
            "train",
            "cpu-tiny",
            "--run-dir",
            str(run),
            "--data-dir",
            str(data_dir),
            "--steps",
            "100000",
            "--checkpoint-every",
            "0",
            "--val-every",
            "0",
        ]
    )
    deadline = time.monotonic() + 120
    while len(kinds(read_metrics(run), "train")) < 3:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no training steps within 120 s"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "lapse resume" in out
    folder = latest_checkpoint(run)  # raises if the pointer leads to an incomplete folder
    stopped_at = json.loads((run / "checkpoint.json").read_text())["step"]
    assert stopped_at >= 3 and folder.name == f"checkpoint-{stopped_at:07d}"
    assert not [p for p in run.rglob("*") if ".tmp-" in p.name]
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    summary = resume(run, steps=stopped_at + 2)
    assert summary["status"] == "finished" and summary["step"] == stopped_at + 2


def _torchrun(args: list[str], nproc: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "lapse.cli",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "parallel",
    [["--parallel", "fsdp"], ["--parallel", "ddp"], ["--cp", "2"], ["--cp", "2", "--cp-mode", "gather"]],
    ids=["fsdp", "ddp", "cp-head", "cp-gather"],
)
def test_two_processes_follow_the_one_process_curve(tmp_path, data_dir, parallel):
    """Two processes holding different rows (FSDP2, DDP) or the two halves of every row
    (context parallelism, FSDP2 over both) train the one-process curve."""
    common = [
        "--data-dir",
        str(data_dir),
        "--steps",
        "6",
        "--val-every",
        "3",
        "--acp-stats-every",
        "0",
        "--checkpoint-every",
        "3",
    ]
    one = train(
        replace(tiny(tmp_path / "one", data_dir, steps=6, val_every=3, acp_stats_every=0, checkpoint_every=3))
    )
    result = _torchrun(
        ["train", "cpu-tiny", "--run-dir", str(tmp_path / "two"), *parallel, *common], nproc=2
    )
    assert result.returncode == 0, result.stdout + result.stderr
    a = read_metrics(Path(one["run_dir"]))
    b = read_metrics(tmp_path / "two")
    for kind in ("train", "val"):
        la, lb = [r["loss"] for r in kinds(a, kind)], [r["loss"] for r in kinds(b, kind)]
        assert len(la) == len(lb) > 0
        # The same rows in the same global batch; only the reduction order differs.
        assert la == pytest.approx(lb, rel=2e-4, abs=2e-4), kind
    if "--cp" in parallel:  # the report says how the rows were split
        mode = parallel[-1] if "--cp-mode" in parallel else "head"
        summary = json.loads((tmp_path / "two" / "summary.json").read_text())
        assert summary["context_parallel"] == {"cp": 2, "mode": mode}
        report = (tmp_path / "two" / "report.md").read_text()
        assert f"each row split into 4 chunks over 2 of them (context parallelism, {mode} mode" in report
    # the sharded checkpoint holds the full weights and resumes in one process
    assert resume(tmp_path / "two", steps=7)["step"] == 7


def test_dcp_under_context_parallelism_follows_one_process(tmp_path, data_dir):
    """DCP's scalar beta makes `--parallel auto` take DDP (FSDP2 refuses 0-d parameters);
    with `--cp 2` each rank builds the whole mask, and the sparsity term's gradient, summed
    over the row's ranks like the loss's, gives the one-process curve."""
    model = ["--model.attention", "dcp", "--model.block", "llama", "--model.no-acp", "--dcp.gamma", "0.1"]
    common = ["--data-dir", str(data_dir), "--steps", "3", "--val-every", "3", "--acp-stats-every", "0",
              "--checkpoint-every", "0", "--no-progress", *model]
    assert cli_main(["train", "cpu-tiny", "--run-dir", str(tmp_path / "one"), *common]) in (0, None)
    two = ["train", "cpu-tiny", "--run-dir", str(tmp_path / "two"), "--cp", "2", *common]
    result = _torchrun(two, nproc=2)
    assert result.returncode == 0, result.stdout + result.stderr
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    for kind in ("train", "val"):
        la, lb = [r["loss"] for r in kinds(a, kind)], [r["loss"] for r in kinds(b, kind)]
        assert len(la) == len(lb) > 0
        assert la == pytest.approx(lb, rel=2e-4, abs=2e-4), kind


def test_a_new_total_of_steps_sticks_across_resumes(tmp_path, data_dir):
    first = train(tiny(tmp_path, data_dir, steps=6, stop_at_step=3, val_every=0, acp_stats_every=0))
    assert first["step"] == 3
    assert resume(first["run_dir"], steps=10, stop_at_step=5)["step"] == 5
    last = resume(first["run_dir"])  # no --steps: the 10 set above, not the 6 of the start
    assert last["status"] == "finished" and last["step"] == 10 and last["steps"] == 10


def test_a_stop_between_log_points_keeps_the_interval(tmp_path, data_dir):
    s = train(tiny(tmp_path, data_dir, steps=20, log_every=4, stop_at_step=3, val_every=0, acp_stats_every=0))
    records = kinds(read_metrics(Path(s["run_dir"])), "train")
    assert [r["step"] for r in records] == [3]
    assert s["elapsed_s"] > 0 and s["tokens_per_s"] > 0


def test_a_new_run_replaces_metrics_left_without_a_checkpoint(tmp_path, data_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 99, "tokens": 1, "loss": 9.0}\n')
    train(tiny(tmp_path, data_dir, steps=2, val_every=0, acp_stats_every=0))
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


def test_the_time_limit_counts_this_session_only(tmp_path, data_dir):
    first = train(tiny(tmp_path, data_dir, steps=8, stop_at_step=4, val_every=0, acp_stats_every=0))
    # pretend the first session trained for hours: a limit on the run's total would stop at once
    folder = latest_checkpoint(Path(first["run_dir"]))
    saved = torch.load(folder / "trainer_state.pt", weights_only=False)
    saved["state"]["elapsed_s"] = 10_000.0
    torch.save(saved, folder / "trainer_state.pt")
    manifest = json.loads((folder / "manifest.json").read_text())  # a deliberate edit: re-sign it
    manifest["files"]["trainer_state.pt"] = file_digest(folder / "trainer_state.pt")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    more = resume(first["run_dir"], time_limit_minutes=1.0)
    assert more["status"] == "finished" and more["step"] == 8


def test_a_resumed_bpe_run_keeps_its_tokenizer_when_the_cache_is_gone(tmp_path, data_dir):
    import shutil

    from lapse.models import preset

    model = preset("tiny", "fox-pro", vocab_size=320, max_seq_len=64)
    first = train(
        tiny(
            tmp_path,
            tmp_path / "data",
            tokenizer="bpe",
            model=model,
            steps=4,
            stop_at_step=2,
            val_every=0,
            acp_stats_every=0,
        )
    )
    run = Path(first["run_dir"])
    saved = {p.name: p.read_bytes() for p in (run / "tokenizer").iterdir()}
    shutil.rmtree(tmp_path / "data")  # another machine: no cache, a BPE would be learned again
    last = resume(run)
    assert last["step"] == 4
    assert {p.name: p.read_bytes() for p in (run / "tokenizer").iterdir()} == saved
    built = [p for p in (tmp_path / "data").iterdir() if p.is_dir()]
    assert len(built) == 1 and built[0].name.startswith("python-tok-")  # tokenised with the saved one


def test_the_newest_checkpoints_are_kept_and_pinned_ones_too(tmp_path, data_dir):
    first = train(
        tiny(tmp_path, data_dir, steps=10, checkpoint_every=2, pin_steps=(3,), val_every=0, acp_stats_every=0)
    )
    run = Path(first["run_dir"])
    assert [checkpoint_step(p) for p in checkpoint_folders(run)] == [10, 8, 3]
    (run / "checkpoint-0000008" / "pinned").touch()  # pinned after the fact
    resume(run, steps=14)
    assert [checkpoint_step(p) for p in checkpoint_folders(run)] == [14, 12, 8, 3]


def test_a_record_after_a_stop_or_a_resume_says_how_many_steps_it_averages(tmp_path, data_dir):
    first = train(
        tiny(tmp_path, data_dir, steps=12, log_every=4, stop_at_step=6, checkpoint_every=0, val_every=0,
             acp_stats_every=0)
    )
    resume(first["run_dir"])
    records = kinds(read_metrics(Path(first["run_dir"])), "train")
    assert [(r["step"], r["averaged_steps"]) for r in records] == [(4, 4), (6, 2), (8, 2), (12, 4)]


def test_one_text_file_trains_and_validates(tmp_path, data_dir):
    book = tmp_path / "book.txt"
    book.write_text("".join(f"{i}: the quick brown fox jumps over the lazy dog\n" for i in range(4000)))
    corpus = CorpusConfig(kind="text", paths=(str(book),))
    s = train(tiny(tmp_path, tmp_path / "data", corpus=corpus, steps=4, val_every=2, acp_stats_every=0))
    val = kinds(read_metrics(Path(s["run_dir"])), "val")
    assert s["status"] == "finished" and [r["step"] for r in val] == [2, 4]


def test_val_fraction_zero_trains_without_validation(tmp_path, data_dir):
    corpus = replace(train_preset("cpu-tiny").corpus, val_fraction=0.0)
    s = train(tiny(tmp_path, tmp_path / "data", corpus=corpus, steps=4, val_every=2, acp_stats_every=0))
    records = read_metrics(Path(s["run_dir"]))
    assert s["status"] == "finished" and not kinds(records, "val") and len(kinds(records, "train")) == 4


def test_resume_takes_run_time_fields_only(tmp_path, data_dir, capsys):
    first = train(tiny(tmp_path, data_dir, steps=4, stop_at_step=2, val_every=0, acp_stats_every=0))
    with pytest.raises(ValueError, match=r"resume cannot change \['lr'\]"):
        resume(first["run_dir"], lr=1.0)
    with pytest.raises(ValueError, match="--steps 1 is below the 2 steps .* pass at least 2"):
        resume(first["run_dir"], steps=1)  # it printed "finished at step 2/1" and saved steps: 1
    cli_main(["resume", first["run_dir"], "--no-progress", "--log-every", "2", "--keep-checkpoints", "1"])
    assert "finished at step 4/4" in capsys.readouterr().out
    assert [checkpoint_step(p) for p in checkpoint_folders(first["run_dir"])] == [4]
    assert kinds(read_metrics(Path(first["run_dir"])), "train")[-1]["averaged_steps"] == 2


@pytest.mark.parametrize("flag", ["progress", "compile", "cuda_graphs"])
def test_resume_flag_pairs_set_unset_or_contradict(flag):
    from lapse.train.config import ResumeConfig

    assert flag not in ResumeConfig(run_dir=Path("r")).overrides()
    assert ResumeConfig(run_dir=Path("r"), **{flag: True}).overrides()[flag] is True
    assert ResumeConfig(run_dir=Path("r"), **{f"no_{flag}": True}).overrides()[flag] is False
    with pytest.raises(ValueError, match="contradict"):
        ResumeConfig(run_dir=Path("r"), **{flag: True, f"no_{flag}": True})


def test_a_run_saves_absolute_paths_and_resumes_from_anywhere(tmp_path, monkeypatch):
    """The data folder and a tokenizer path given relative are saved absolute, and the corpus's
    paths as written with the working directory as their root, so ``lapse resume`` works from
    another working directory (the saved relative paths failed) with the same split."""
    (tmp_path / "work" / "corpus").mkdir(parents=True)
    (tmp_path / "work" / "corpus" / "a.txt").write_text("the quick brown fox jumps. " * 400)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    cfg = train_preset("cpu-tiny", run_dir=Path("run"), data_dir=Path("data"), steps=4, stop_at_step=2,
                       val_every=0, corpus=CorpusConfig(kind="text", paths=("corpus",), val_fraction=0))
    train(cfg)
    saved = json.loads((tmp_path / "work" / "run" / "config.json").read_text())
    assert saved["corpus"]["paths"] == ["corpus"] and saved["corpus"]["root"] == str(tmp_path / "work")
    assert saved["data_dir"] == str(tmp_path / "work" / "data")
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert resume(tmp_path / "work" / "run")["step"] == 4
    assert not (tmp_path / "elsewhere" / "runs").exists()  # the cache was found where it was made


def test_a_new_run_refuses_a_folder_of_other_files(tmp_path, data_dir, monkeypatch):
    """``--run-dir ""`` (the working directory) or any folder holding other files and no run is
    refused before anything is written into it."""
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    for run_dir in (Path(""), tmp_path):
        with pytest.raises(ValueError, match="holds other files and no run"):
            train(replace(tiny(tmp_path, data_dir, steps=2), run_dir=run_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    logged = tmp_path / "logged"  # `| tee RUN/train.log` makes the log first; a killed writer's temporary
    logged.mkdir()
    (logged / "train.log").write_text("")
    (logged / "config.json.tmp-123").write_text("")
    assert train(replace(tiny(tmp_path, data_dir, steps=1, val_every=0), run_dir=logged))["step"] == 1


def test_resume_refuses_a_stop_at_or_before_the_steps_done(tmp_path, data_dir):
    first = train(tiny(tmp_path, data_dir, steps=6, stop_at_step=3, val_every=0, acp_stats_every=0))
    for stop in (2, 3):
        with pytest.raises(ValueError, match=f"--stop-at-step {stop} is not past the 3 steps"):
            resume(first["run_dir"], stop_at_step=stop)
    assert resume(first["run_dir"], stop_at_step=4)["step"] == 4


def test_a_small_corpus_says_what_to_change_and_trains_without_validation(tmp_path, data_dir):
    """One small file's validation split (1% of its bytes) holds no window: the error says what
    to change, and --val-every 0 trains without building the validation windows (it failed the
    same way)."""
    book = tmp_path / "book.txt"
    book.write_text("a small book of a few sentences. " * 100)  # 3,300 bytes: 33 validation tokens
    corpus = CorpusConfig(kind="text", paths=(str(book),))
    with pytest.raises(ValueError, match=r"the validation split holds no window of 65 tokens .*val-every 0"):
        train(tiny(tmp_path / "a", data_dir, steps=2, corpus=corpus))
    assert train(tiny(tmp_path / "b", data_dir, steps=2, corpus=corpus, val_every=0))["step"] == 2
    with pytest.raises(ValueError, match="the training split holds no window of 4001 tokens"):
        train(tiny(tmp_path / "c", data_dir, steps=2, corpus=corpus, val_every=0, seq_len=4000))


def test_a_run_saved_with_a_peak_at_or_below_zero_loads(tmp_path, data_dir):
    """Runs saved before ``peak_tflops`` was checked may hold 0 or less: they load with it
    dropped (MFU from the device's known peak) and a warning, rather than failing to resume."""
    from lapse.train.trainer import config_from_json, config_to_json

    cfg = tiny(tmp_path / "run", data_dir, steps=2)
    saved = config_to_json(cfg)
    saved["peak_tflops"] = -3.0
    with pytest.warns(UserWarning, match="peak_tflops -3.0 is not positive: dropped"):
        loaded = config_from_json(saved)
    assert loaded.peak_tflops is None and loaded.steps == 2


def test_a_castle_window_as_long_as_the_context_is_warned_of(tmp_path, data_dir):
    """castle-swl's preset window (128 at ``tiny``) over cpu-tiny's context of 64 is CASTLE
    without a window: said when the run starts."""
    model = preset("tiny", "castle-swl", vocab_size=320, max_seq_len=64)
    with pytest.warns(UserWarning, match="castle_window 128 spans the context 64"):
        train(tiny(tmp_path, data_dir, model=model, steps=1, val_every=0, acp_stats_every=0))


def test_a_gpu_preset_on_a_cpu_says_so_before_it_starts(tmp_path, monkeypatch):
    """``lapse train gpu-20m`` on a machine without a GPU started without a word and took 106 s
    a step: one warning, before the corpus is read, names the CPU presets; cpu-tiny has none."""
    import warnings

    import lapse.train.trainer as trainer

    def set_up(*args, **kwargs):
        raise RuntimeError("set-up reached")

    monkeypatch.setattr(trainer, "_setup", set_up)
    with pytest.warns(UserWarning, match="^gpu-20m is made for a GPU and this run is on the CPU, where a "
                      "step takes minutes: on a CPU train cpu-small .* or cpu-tiny") as seen:
        with pytest.raises(RuntimeError, match="set-up reached"):
            train(train_preset("gpu-20m", run_dir=tmp_path / "gpu", device="cpu"))
    assert len(seen) == 1
    if not torch.cuda.is_available():  # asked for, a missing GPU is an error
        with pytest.raises(ValueError, match="no CUDA GPU is visible"):
            train(train_preset("gpu-20m", run_dir=tmp_path / "cuda", device="cuda"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="set-up reached"):
            train(train_preset("cpu-tiny", run_dir=tmp_path / "cpu", device="cpu"))
