"""Reading run folders and verifying checkpoints (lapse.models.checkpoint)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lapse.models import Decoder
from lapse.models.checkpoint import (
    CheckpointError,
    checkpoint_folders,
    latest_checkpoint,
    latest_intact_checkpoint,
    load_weights,
    read_run,
    verify_checkpoint,
)
from lapse.train import train, train_preset


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny run with checkpoints at steps 2 and 4 (a pristine copy per test: :func:`fresh`)."""
    root = tmp_path_factory.mktemp("ckpt")
    train(
        train_preset(
            "cpu-tiny", run_dir=root / "run", data_dir=root / "data", steps=4, checkpoint_every=2,
            val_every=0, acp_stats_every=0,
        )
    )
    return root / "run"


@pytest.fixture
def fresh(run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def test_read_run_gives_the_parts_readers_need(run):
    saved = read_run(run)
    assert saved.model.name == "fox-pro" and saved.model.vocab_size == 320
    assert saved.corpus.kind == "python" and saved.tokenizer == "byte" and saved.context == 64
    assert saved.config["steps"] == 4
    with pytest.raises(FileNotFoundError, match="not a training run folder"):
        read_run(run / "tokenizer")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_run(run / "missing")


def test_read_run_refuses_other_configs_in_one_line(run, tmp_path):
    """A folder whose config.json is not a run's (an export's, or anything else) is a ValueError
    naming it, not a KeyError from deep inside (what ``lapse resume`` of an export printed)."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"not a lapse run's configuration \(no 'model', 'corpus'"):
        read_run(foreign)
    (foreign / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a lapse run's configuration"):
        read_run(foreign)
    (foreign / "config.json").write_text(json.dumps({"model_type": "lapse", "d_model": 64}))
    with pytest.raises(ValueError, match="is a `lapse export` folder, not a training run"):
        read_run(foreign)


def test_checkpoints_are_listed_newest_first_and_verified(run):
    assert [p.name for p in checkpoint_folders(run)] == ["checkpoint-0000004", "checkpoint-0000002"]
    assert latest_checkpoint(run) == run / "checkpoint-0000004"
    folder = run / "checkpoint-0000004"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "trainer_state.pt"}
    assert manifest["files"]["model.safetensors"]["bytes"] == (folder / "model.safetensors").stat().st_size


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip], ids=["truncated", "bit-flip"])
@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.pt"])
def test_a_damaged_file_is_named_and_the_older_checkpoint_is_intact(fresh, name, damage):
    damage(fresh / "checkpoint-0000004" / name)
    with pytest.raises(CheckpointError, match=f"checkpoint-0000004/{name} is damaged") as e:
        latest_checkpoint(fresh)
    assert "checkpoint-0000002" in str(e.value)  # the way out is named
    folder, damaged = latest_intact_checkpoint(fresh)
    assert folder == fresh / "checkpoint-0000002" and len(damaged) == 1
    model = Decoder(read_run(fresh).model)
    with pytest.raises(CheckpointError, match=name):
        load_weights(fresh / "checkpoint-0000004", model)
    load_weights(folder, model)


def test_a_damaged_or_missing_manifest(fresh):
    folder = fresh / "checkpoint-0000004"
    (folder / "manifest.json").write_text('{"format": "lapse-checkpoint", "files": ')
    with pytest.raises(CheckpointError, match="manifest.json is damaged"):
        verify_checkpoint(folder)
    # a checkpoint written before manifests existed: its two files are enough
    (folder / "manifest.json").unlink()
    assert verify_checkpoint(folder) == folder
    (folder / "trainer_state.pt").unlink()
    with pytest.raises(CheckpointError, match="trainer_state.pt is missing"):
        verify_checkpoint(folder)


def test_load_weights_fills_the_model_exactly(run):
    from safetensors.torch import load_file

    model = Decoder(read_run(run).model)
    load_weights(latest_checkpoint(run), model)
    saved = load_file(run / "checkpoint-0000004" / "model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
