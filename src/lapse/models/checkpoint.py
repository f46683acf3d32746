"""Reading what training leaves on disk: a run folder's configuration and its checkpoints.

A run folder (written by ``lapse train``, see :mod:`lapse.train`) holds::

    config.json          the full training configuration (model, corpus, tokenizer, ...)
    checkpoint.json      the pointer: {"step": N, "folder": "checkpoint-000000N", ...}
    checkpoint-000000N/  model.safetensors (the weights under the model's parameter names)
                         and trainer_state.pt (optimizer state, progress, RNG)
    tokenizer/           the tokenizer the model was trained with

Evaluation, export, benchmarks and the trainer itself read runs through this module; only
the trainer writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file
from torch import nn

from lapse.data import CorpusConfig

from .config import ModelConfig

CONFIG_FILE = "config.json"
POINTER = "checkpoint.json"
WEIGHTS_FILE = "model.safetensors"
TRAINER_STATE_FILE = "trainer_state.pt"


@dataclass(frozen=True, kw_only=True)
class SavedRun:
    """What a run folder's ``config.json`` says, in the parts its readers need."""

    model: ModelConfig
    """The architecture the weights belong to."""
    corpus: CorpusConfig
    """Where the training documents came from (and how they were split)."""
    tokenizer: str
    """``"byte"``, ``"bpe"`` or the path of a saved tokenizer, as given to the trainer."""
    data_dir: Path
    """The cache of tokenised corpora the run used."""
    context: int
    """T, the length of the training rows."""
    config: dict
    """The whole saved configuration, as JSON (the trainer's own fields too)."""


def read_run(run_dir: str | Path) -> SavedRun:
    """The configuration saved in ``run_dir/config.json``."""
    path = Path(run_dir) / CONFIG_FILE
    obj = json.loads(path.read_text())
    model = model_config_from_json(obj["model"])
    seq_len = obj.get("seq_len")
    return SavedRun(
        model=model,
        corpus=corpus_config_from_json(obj["corpus"]),
        tokenizer=obj["tokenizer"],
        data_dir=Path(obj["data_dir"]),
        context=model.max_seq_len if seq_len is None else seq_len,
        config=obj,
    )


def model_config_from_json(obj: dict) -> ModelConfig:
    """A :class:`ModelConfig` from its saved fields."""
    return ModelConfig(**obj)


def corpus_config_from_json(obj: dict) -> CorpusConfig:
    """A :class:`~lapse.data.CorpusConfig` from its saved fields (JSON lists back to tuples)."""
    obj = dict(obj)
    for key in ("paths", "patterns"):
        obj[key] = tuple(obj[key])
    return CorpusConfig(**obj)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The folder ``checkpoint.json`` points at, or ``None`` when the run has none."""
    pointer = Path(run_dir) / POINTER
    if not pointer.exists():
        return None
    folder = Path(run_dir) / json.loads(pointer.read_text())["folder"]
    if not (folder / WEIGHTS_FILE).exists() or not (folder / TRAINER_STATE_FILE).exists():
        raise ValueError(f"{pointer} points at {folder}, which is incomplete or missing")
    return folder


def load_weights(folder: str | Path, model: nn.Module) -> None:
    """Only the weights of a checkpoint folder (for evaluation or fine-tuning)."""
    missing, unexpected = model.load_state_dict(load_file(Path(folder) / WEIGHTS_FILE), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not fit the model: missing {missing}, unexpected {unexpected}"
        )


__all__ = [
    "CONFIG_FILE",
    "POINTER",
    "TRAINER_STATE_FILE",
    "WEIGHTS_FILE",
    "SavedRun",
    "corpus_config_from_json",
    "latest_checkpoint",
    "load_weights",
    "model_config_from_json",
    "read_run",
]
