"""Checkpoints that are never half-written, loadable in any parallel mode.

A checkpoint is a folder ``checkpoint-<step>/`` in the run folder holding
``model.safetensors`` (the weights under the model's own parameter names) and
``trainer_state.pt`` (optimizer state keyed by parameter name, step, tokens, RNG). It is
written under a temporary name and renamed when complete; then ``checkpoint.json`` (the
pointer readers follow) is replaced atomically, and older checkpoint folders are removed.
An interruption at any moment leaves the previous pointer and its complete folder.
Readers (evaluation, export, resume) find and load checkpoints with
:mod:`lapse.models.checkpoint`; this module writes them and restores the trainer state.

State dicts are gathered with ``torch.distributed.checkpoint.state_dict`` as full,
CPU-offloaded dicts, so the same files serve one process, DDP and FSDP2.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from lapse.files import write_json_atomic
from lapse.models.checkpoint import POINTER, TRAINER_STATE_FILE, WEIGHTS_FILE

from .distributed import World


def save_checkpoint(
    run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, world: World
) -> Path | None:
    """Write the checkpoint of ``state["step"]``; every rank must call (FSDP2 gathers).

    ``state``: JSON-able progress (step, tokens, elapsed time, ...). Returns the folder on
    rank 0, ``None`` elsewhere.
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
        _fsync_folder(tmp)
        if final.exists():  # the same step saved before (e.g. an interruption right after)
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_json_atomic(run_dir / POINTER, {"step": state["step"], "folder": name, **state})
    for old in run_dir.glob("checkpoint-*"):
        if old.is_dir() and old.name != name and ".tmp-" not in old.name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load weights and optimizer state into ``model`` (wrapped or not) and ``optimizer``;
    restore the RNG; return the saved progress ``state``."""
    folder = Path(folder)
    weights = load_file(folder / WEIGHTS_FILE)
    saved = torch.load(folder / TRAINER_STATE_FILE, map_location="cpu", weights_only=False)
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


def _fsync_folder(folder: Path) -> None:
    # The data must be on disk before a rename makes the folder look complete.
    for path in folder.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
