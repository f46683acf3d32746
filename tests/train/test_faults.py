"""Fault injection: a run killed (SIGKILL, SIGINT) at any moment, its checkpoint files
truncated or flipped, or started twice, still ends with the weights of an uninterrupted run,
bit for bit, or fails at once with a clear message.

The killed sessions are real ``python -m lapse.cli`` processes of the ``cpu-tiny`` preset;
a kill inside a checkpoint write is placed by a small driver that wraps one step of
:func:`lapse.train.checkpoint.save_checkpoint` and SIGKILLs its own process there.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lapse.eval import load_model
from lapse.models.checkpoint import CheckpointError, checkpoint_folders, checkpoint_step
from lapse.train import prepare_data, read_metrics, resume, train, train_preset

STEPS = 24
# checkpoints every 2 steps, validation and ACP statistics on: every kind of step is hit
TRAIN = ["train", "cpu-tiny", "--steps", str(STEPS), "--checkpoint-every", "2", "--val-every", "6",
         "--acp-stats-every", "4"]

# Wraps one step of save_checkpoint; the n-th time it is reached, the process SIGKILLs itself
# (after cutting the file being written in half, for the two data files).
DRIVER = """
import os, signal, sys
from pathlib import Path
import torch
import lapse.train.checkpoint as ckpt

point, nth = sys.argv[1], int(sys.argv[2])
calls = [0]

def due():
    calls[0] += 1
    return calls[0] == nth

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def half(path):
    path = Path(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

if point == "in-weights":
    save_file = ckpt.save_file
    def wrapped(tensors, path, metadata=None):
        save_file(tensors, path, metadata=metadata)
        if due():
            half(path); die()
    ckpt.save_file = wrapped
elif point == "in-trainer-state":
    save = torch.save
    def wrapped(obj, path, *args, **kwargs):
        save(obj, path, *args, **kwargs)
        if due():
            half(path); die()
    torch.save = wrapped
elif point == "before-rename":
    fsync = ckpt._fsync
    def wrapped(folder):
        fsync(folder)
        if due():
            die()
    ckpt._fsync = wrapped
elif point == "before-pointer":
    write_json_atomic = ckpt.write_json_atomic
    def wrapped(path, obj, **kwargs):
        if Path(path).name == "checkpoint.json" and due():
            die()
        return write_json_atomic(path, obj, **kwargs)
    ckpt.write_json_atomic = wrapped
elif point == "before-cleanup":
    remove_old = ckpt._remove_old
    def wrapped(*args):
        if due():
            die()
        remove_old(*args)
    ckpt._remove_old = wrapped
else:
    raise SystemExit(f"unknown point {point}")

from lapse.cli import main
main(sys.argv[3:])
"""
POINTS = ["in-weights", "in-trainer-state", "before-rename", "before-pointer", "before-cleanup"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The corpus cache, built once here (the subprocesses only read it)."""
    path = tmp_path_factory.mktemp("data")
    cfg = train_preset("cpu-tiny", data_dir=path)
    prepare_data(cfg, progress=False)
    return path


def _env() -> dict:
    # One thread: every process computes the same float sums in the same order.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LAPSE_DEBUG": "1"}


def _cli(args: list[str], *, driver: tuple[str, int] | None = None) -> subprocess.Popen:
    prefix = ["-c", DRIVER, driver[0], str(driver[1])] if driver else ["-m", "lapse.cli"]
    return subprocess.Popen(
        [sys.executable, *prefix, *args],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _run_dir_args(run: Path, data_dir: Path) -> list[str]:
    return ["--run-dir", str(run), "--data-dir", str(data_dir)]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    newest = checkpoint_folders(run)[0]
    assert checkpoint_step(newest) == STEPS
    return load_file(newest / "model.safetensors")


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run) if r["kind"] == "train"]


def _assert_same_run(run: Path, reference: Path) -> None:
    a, b = _weights(run), _weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "weights differ"
    assert _losses(run) == _losses(reference)  # the whole loss curve, bit for bit
    assert not [p.name for p in run.iterdir() if ".tmp-" in p.name]  # leftovers were removed
    assert len(checkpoint_folders(run)) == 2  # keep_checkpoints


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir) -> Path:
    """The uninterrupted run, in a process of its own like the others."""
    run = tmp_path_factory.mktemp("reference") / "run"
    code, out = _finish(_cli([*TRAIN, *_run_dir_args(run, data_dir)]))
    assert code == 0, out
    return run


def _wait_for_step(run: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.monotonic() + 120
    while not any(r["kind"] == "train" and r["step"] >= step for r in read_metrics(run)):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"no step {step} within 120 s"
        time.sleep(0.02)


def test_sigkill_at_any_moment_then_resume_gives_the_uninterrupted_weights(tmp_path, data_dir, reference):
    run = tmp_path / "run"
    sessions = [TRAIN + _run_dir_args(run, data_dir)] + [["resume", str(run)]] * len(POINTS)
    # Inside or around the second checkpoint write of each session: the first one saved
    # progress, so every session moves the run on.
    left_behind = False
    for args, point in zip(sessions, POINTS, strict=False):
        code, out = _finish(_cli(args, driver=(point, 2)))
        assert code == -signal.SIGKILL, out
        # what a killed writer left is removed by the next session, at its start
        assert ("left by an interrupted writer" in out) == left_behind, out
        left_behind = any(".tmp-" in p.name for p in run.iterdir())
        assert left_behind == (point in ("in-weights", "in-trainer-state", "before-rename")), point
    # Between steps, at a moment of the clock's choosing.
    proc = _cli(["resume", str(run)])
    start = max(step for step, _ in _losses(run))
    _wait_for_step(run, proc, start + 3)
    proc.send_signal(signal.SIGKILL)
    _finish(proc)
    code, out = _finish(_cli(["resume", str(run)]))
    assert code == 0, out
    _assert_same_run(run, reference)


def test_sigint_twice_then_resume_gives_the_uninterrupted_weights(tmp_path, data_dir, reference):
    run = tmp_path / "run"
    for i, args in enumerate([TRAIN + _run_dir_args(run, data_dir), ["resume", str(run)]]):
        proc = _cli(args)
        _wait_for_step(run, proc, 3 + 8 * i)
        proc.send_signal(signal.SIGINT)
        code, out = _finish(proc)
        assert code == 130 and "lapse resume" in out, out
    code, out = _finish(_cli(["resume", str(run)]))
    assert code == 0, out
    _assert_same_run(run, reference)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    if path.name == "manifest.json":  # a bit of a recorded digest, not of the JSON syntax
        at = data.index(b'"sha256": "') + len('"sha256": "') + 5
    else:
        at = len(data) // 2
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory, data_dir) -> tuple[Path, Path]:
    """In this process: a run stopped at step 8 (checkpoints 4 and 8) and the same run
    trained straight to 12."""
    root = tmp_path_factory.mktemp("damaged")
    common = dict(data_dir=data_dir, steps=12, checkpoint_every=4, val_every=4, acp_stats_every=0)
    train(train_preset("cpu-tiny", run_dir=root / "straight", **common))
    train(train_preset("cpu-tiny", run_dir=root / "stopped", stop_at_step=8, **common))
    return root / "stopped", root / "straight"


@pytest.mark.parametrize("damage", [_truncate, _flip], ids=["truncated", "bit-flip"])
@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.pt", "manifest.json"])
def test_a_damaged_latest_checkpoint_resumes_from_the_previous_one(tmp_path, eight_steps, name, damage):
    stopped, straight = eight_steps
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    damage(run / "checkpoint-0000008" / name)
    # a flipped digest in the manifest makes its file look damaged: which of the two changed
    # cannot be told, and either way the checkpoint is not used
    named = "model.safetensors" if name == "manifest.json" and damage is _flip else name
    # evaluation and export refuse it in one line naming the file
    with pytest.raises(CheckpointError, match=f"checkpoint-0000008/{named} is damaged"):
        load_model(run)
    with pytest.warns(UserWarning, match=f"{named} is damaged.*resuming from checkpoint-0000004"):
        summary = resume(run)
    assert summary["step"] == 12 and (run / "checkpoint-0000008.damaged").is_dir()
    a = load_file(run / "checkpoint-0000012" / "model.safetensors")
    b = load_file(straight / "checkpoint-0000012" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the curve from step 4 on is the uninterrupted one
    assert _losses(run) == _losses(straight)
    assert [(r["step"], r["loss"]) for r in read_metrics(run) if r["kind"] == "val"] == [
        (r["step"], r["loss"]) for r in read_metrics(straight) if r["kind"] == "val"
    ]


def test_a_damaged_pointer_does_not_matter(tmp_path, eight_steps):
    stopped, straight = eight_steps
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    (run / "checkpoint.json").write_text('{"step": 8, "fol')
    assert resume(run)["step"] == 12


def test_no_intact_checkpoint_is_one_clear_error(tmp_path, eight_steps):
    run = tmp_path / "run"
    shutil.copytree(eight_steps[0], run)
    for folder in checkpoint_folders(run):
        _truncate(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*0000008.*0000004"):
        resume(run)


def test_concurrent_starts_on_one_folder(tmp_path, data_dir):
    run = tmp_path / "run"
    args = _run_dir_args(run, data_dir)
    first = _cli(["train", "cpu-tiny", "--steps", "100000", "--checkpoint-every", "1", "--val-every", "0",
                  *args])
    try:
        _wait_for_step(run, first, 2)
        for second in (["train", "cpu-tiny", "--steps", "4", *args], ["resume", str(run)]):
            t0 = time.monotonic()
            code, out = _finish(subprocess.Popen(
                [sys.executable, "-m", "lapse.cli", *second], env={**_env(), "LAPSE_DEBUG": "0"},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            ))
            assert code == 2 and out.strip().splitlines()[-1] == (
                f"error: {run} is in use by another lapse process (pid {first.pid}); wait for it to end "
                "or choose another run folder"
            ), out
            assert time.monotonic() - t0 < 30  # at once (the start-up of Python and torch aside)
    finally:
        first.send_signal(signal.SIGKILL)
        _finish(first)
    # the dead holder does not block: the run resumes from its last checkpoint
    stopped_at = checkpoint_step(checkpoint_folders(run)[0])
    code, out = _finish(_cli(["resume", str(run), "--steps", str(stopped_at + 2)]))
    assert code == 0 and f"finished at step {stopped_at + 2}/" in out, out
    assert json.loads((run / "config.json").read_text())["steps"] == stopped_at + 2
