"""Checkpoints that are never half-written, verified when read, loadable in any parallel mode.

A checkpoint is a folder ``checkpoint-<step>/`` in the run folder holding
``model.safetensors`` (the weights under the model's own parameter names),
``trainer_state.pt`` (optimizer state keyed by parameter name, step, tokens, RNG) and
``manifest.json`` (the size and SHA-256 of both). It is written under a temporary name
(``checkpoint-<step>.tmp-<pid>``), synced to disk and renamed when complete; then
``checkpoint.json`` (a pointer for people and older readers) is replaced atomically, and
checkpoints beyond the newest ``keep`` are removed, except pinned ones. An interruption at
any moment leaves every older checkpoint complete; the temporary folder it may leave is
removed by the next session (:func:`remove_stale_temporaries`).

Readers (evaluation, export, resume) find and verify checkpoints with
:mod:`lapse.models.checkpoint`; this module writes them and restores the trainer state.

State dicts are gathered with ``torch.distributed.checkpoint.state_dict`` as full,
CPU-offloaded dicts, so the same files serve one process, DDP and FSDP2.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from lapse.files import write_json_atomic
from lapse.models.checkpoint import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    POINTER,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    checkpoint_folders,
    checkpoint_step,
    file_digest,
    verify_checkpoint,
)

from .distributed import World

PIN_FILE = "pinned"
"""A checkpoint folder holding a file of this name is never removed (``touch`` it to pin)."""

_TEMPORARY = re.compile(r".+\.tmp-\d+")


def save_checkpoint(
    run_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict,
    world: World,
    *,
    keep: int = 2,
    pinned_steps: Iterable[int] = (),
) -> Path | None:
    """Write the checkpoint of ``state["step"]``; every rank must call (FSDP2 gathers).

    ``state``: JSON-able progress (step, tokens, elapsed time, ...). Afterwards the newest
    ``keep`` checkpoints remain, and those of ``pinned_steps`` or holding a ``pinned``
    file. Returns the folder on rank 0, ``None`` elsewhere.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if not world.main:
        return None
    run_dir = Path(run_dir)
    name = f"checkpoint-{state['step']:07d}"
    final = run_dir / name
    tmp = run_dir / f"{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weights = {k: v.contiguous() for k, v in model_sd.items()}
        save_file(weights, tmp / WEIGHTS_FILE, metadata={"step": str(state["step"])})
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save({"optimizer": optim_sd, "state": state, "rng": rng}, tmp / TRAINER_STATE_FILE)
        files = {n: file_digest(tmp / n) for n in (WEIGHTS_FILE, TRAINER_STATE_FILE)}
        manifest = {"format": MANIFEST_FORMAT, "version": 1, "step": state["step"], "files": files}
        write_json_atomic(tmp / MANIFEST_FILE, manifest)
        _fsync(tmp)  # the data must be on disk before a rename makes the folder look complete
        if final.exists():  # the same step saved before (e.g. an interruption right after)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(run_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_json_atomic(run_dir / POINTER, {"step": state["step"], "folder": name, **state})
    _remove_old(run_dir, keep, set(pinned_steps))
    return final


def load_checkpoint(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load weights and optimizer state into ``model`` (wrapped or not) and ``optimizer``
    from a verified checkpoint folder; restore the RNG; return the saved progress ``state``."""
    folder = verify_checkpoint(folder)
    try:
        weights = load_file(folder / WEIGHTS_FILE)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"checkpoint file {folder / WEIGHTS_FILE} is damaged ({e})") from e
    try:
        saved = torch.load(folder / TRAINER_STATE_FILE, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"checkpoint file {folder / TRAINER_STATE_FILE} is damaged ({e})") from e
    set_state_dict(
        model,
        optimizer,
        model_state_dict=weights,
        optim_state_dict=saved["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    torch.set_rng_state(saved["rng"]["cpu"])
    if "cuda" in saved["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["rng"]["cuda"])
    return saved["state"]


def set_aside(folder: Path) -> Path:
    """Rename a damaged checkpoint folder to ``<name>.damaged`` (kept for inspection, never
    read again); returns the new path."""
    target = folder.with_name(f"{folder.name}.damaged")
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}.damaged-{n}")
    os.replace(folder, target)
    return target


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Remove what interrupted writers left in ``run_dir`` (``*.tmp-<pid>`` files and
    checkpoint folders); call only while holding the run's lock, when no other process
    writes there. Returns what was removed."""
    removed = []
    for path in Path(run_dir).iterdir() if Path(run_dir).is_dir() else ():
        if _TEMPORARY.fullmatch(path.name):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _remove_old(run_dir: Path, keep: int, pinned_steps: set[int]) -> None:
    for i, folder in enumerate(checkpoint_folders(run_dir)):
        if i < keep or checkpoint_step(folder) in pinned_steps or (folder / PIN_FILE).exists():
            continue
        shutil.rmtree(folder, ignore_errors=True)


def _fsync(folder: Path) -> None:
    for path in folder.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
