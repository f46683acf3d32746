"""Reading what training leaves on disk: a run folder's configuration and its checkpoints.

A run folder (written by ``lapse train``, see :mod:`lapse.train`) holds::

    config.json          the full training configuration (model, corpus, tokenizer, ...)
    checkpoint.json      the pointer to the newest checkpoint: {"step": N, "folder": ...}
    checkpoint-000000N/  model.safetensors (the weights under the model's parameter names),
                         trainer_state.pt (optimizer state, progress, RNG) and
                         manifest.json (the size and SHA-256 of each of the two)
    tokenizer/           the tokenizer the model was trained with
    imported.json        only in a folder ``lapse import`` wrote from a pretrained model
                         (where it came from): a start for ``lapse train --init-from``,
                         never resumed

A checkpoint is *intact* when every file its manifest lists has the listed size and
SHA-256 (checkpoints written before manifests existed are taken as they are).
:func:`latest_checkpoint` returns the newest checkpoint and refuses a damaged one with a
:class:`CheckpointError` naming the damaged file (evaluation, export);
:func:`latest_intact_checkpoint` steps back to the newest intact one (resume).

Evaluation, export, benchmarks and the trainer read runs through this module; only the
trainer writes them.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from lapse.data import CorpusConfig
from lapse.layers import DCPAttention

from .config import ModelConfig

CONFIG_FILE = "config.json"
POINTER = "checkpoint.json"
IMPORTED_FILE = "imported.json"
WEIGHTS_FILE = "model.safetensors"
TRAINER_STATE_FILE = "trainer_state.pt"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "lapse-checkpoint"
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
"""A checkpoint folder's name; ``checkpoint-<step>.tmp-<pid>`` (being written) and
``checkpoint-<step>.damaged`` (set aside) do not match it."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: a file missing, truncated or changed."""


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


RUN_KEYS = ("model", "corpus", "tokenizer", "data_dir")  # what read_run needs of a run's config.json


def read_run(run_dir: str | Path) -> SavedRun:
    """The configuration saved in ``run_dir/config.json``."""
    path = Path(run_dir) / CONFIG_FILE
    if not Path(run_dir).exists():
        raise FileNotFoundError(f"{run_dir} does not exist")
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} is not a training run folder (no {CONFIG_FILE})")
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is damaged: not valid JSON ({e})") from e
    if isinstance(obj, dict) and obj.get("model_type") == EXPORT_MODEL_TYPE:  # is_export_folder's test
        raise ValueError(f"{run_dir} is a `lapse export` folder, not a training run: give the run folder "
                         "it was exported from")
    missing = [key for key in RUN_KEYS if key not in obj] if isinstance(obj, dict) else list(RUN_KEYS)
    if missing:
        raise ValueError(f"{path} is not a lapse run's configuration (no {', '.join(map(repr, missing))})")
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
    """A :class:`ModelConfig` from its saved fields (a run's ``config.json``, an export's). A
    ``castle_window`` saved beside another attention than CASTLE's (before that was refused) is
    dropped: it never did anything."""
    obj = dict(obj)
    if (obj.get("castle_window") is not None and obj.get("arch") is None
            and obj.get("attention", "castle") != "castle"):
        obj["castle_window"] = None
    return ModelConfig(**obj)


def corpus_config_from_json(obj: dict) -> CorpusConfig:
    """A :class:`~lapse.data.CorpusConfig` from its saved fields (JSON lists back to tuples)."""
    obj = dict(obj)
    for key in ("paths", "patterns"):
        obj[key] = tuple(obj[key])
    if obj["kind"] == "python":  # runs saved before such paths were refused: they were never read
        obj["paths"] = ()
    return CorpusConfig(**obj)


EXPORT_MODEL_TYPE = "lapse"  # config.json's model_type in a `lapse export` folder (lapse.hf.LapseConfig)


def is_export_folder(path: str | Path) -> bool:
    """Whether ``path`` is a Hugging Face folder that ``lapse export`` wrote: a ``config.json``
    whose ``model_type`` is lapse's (a run folder's config.json has none)."""
    config = Path(path) / CONFIG_FILE
    try:
        return config.is_file() and json.loads(config.read_text()).get("model_type") == EXPORT_MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def checkpoint_folders(run_dir: str | Path) -> list[Path]:
    """The run's checkpoint folders, newest (highest step) first, intact or not."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in run_dir.iterdir()
        if (m := CHECKPOINT_NAME.fullmatch(p.name)) and p.is_dir()
    ]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_step(folder: str | Path) -> int:
    """The step of a checkpoint folder, from its name."""
    m = CHECKPOINT_NAME.fullmatch(Path(folder).name)
    if m is None:
        raise ValueError(f"{folder} is not a checkpoint folder (checkpoint-<step>)")
    return int(m.group(1))


def file_digest(path: str | Path) -> dict:
    """``{"bytes": size, "sha256": hex digest}`` of a file, as a manifest lists it."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def verify_checkpoint(folder: str | Path) -> Path:
    """``folder`` when it is intact; else a :class:`CheckpointError` naming the bad file.

    Every file the manifest lists must have its size and SHA-256. A folder without a
    manifest (written before manifests existed) needs its two files only.
    """
    folder = Path(folder)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.exists():
        for name in (WEIGHTS_FILE, TRAINER_STATE_FILE):
            if not (folder / name).exists():
                raise CheckpointError(f"checkpoint {folder} is incomplete: {name} is missing")
        return folder
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError("not a lapse checkpoint manifest")
        listed = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint file {manifest_path} is damaged ({e})") from e
    for name, (size, sha256) in listed.items():
        path = folder / name
        if not path.exists():
            raise CheckpointError(f"checkpoint file {path} is missing")
        found = path.stat().st_size
        if found != size:
            raise CheckpointError(
                f"checkpoint file {path} is damaged: {found} bytes, the manifest says {size}"
            )
        if file_digest(path)["sha256"] != sha256:
            raise CheckpointError(
                f"checkpoint file {path} is damaged: its SHA-256 differs from the one {MANIFEST_FILE} records"
            )
    return folder


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint folder of the run, verified; ``None`` when the run has none.

    Raises :class:`CheckpointError` naming the damaged file when the newest is not intact
    (``lapse resume`` steps back to an older one instead: :func:`latest_intact_checkpoint`).
    """
    folders = checkpoint_folders(run_dir)
    if not folders:
        return None
    try:
        return verify_checkpoint(folders[0])
    except CheckpointError as e:
        if len(folders) == 1:
            raise
        older = ", ".join(str(f) for f in folders[1:3])
        raise CheckpointError(f"{e}; an older checkpoint folder may be used instead: {older}") from e


def latest_intact_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[CheckpointError]]:
    """The newest intact checkpoint folder (``None`` when there is none), and what was wrong
    with each newer one."""
    damaged = []
    for folder in checkpoint_folders(run_dir):
        try:
            return verify_checkpoint(folder), damaged
        except CheckpointError as e:
            damaged.append(e)
    return None, damaged


def dcp_parameter_names(model: nn.Module) -> list[str]:
    """The names (in ``model.state_dict()``) of what DCP adds to softmax attention: each
    :class:`~lapse.layers.DCPAttention` layer's ``W_Qint``, ``W_Kint`` and ``beta``."""
    layers = [m for m in model.modules() if isinstance(m, DCPAttention)]
    added = {id(p) for layer in layers for p in layer.interaction_parameters()}
    return [name for name, p in model.named_parameters() if id(p) in added]


def load_weights(folder: str | Path, model: nn.Module, *, init_dcp: bool = False) -> None:
    """Only the weights of a checkpoint folder (for evaluation, export or fine-tuning),
    verified against its manifest first.

    ``init_dcp``: ``model`` has DCP layers and the checkpoint is the same architecture with
    softmax attention (no DCP parameters at all): load it and leave the interaction
    parameters as they are (their init), the start of a DCP fine-tuning. Without it such a
    checkpoint is an error: it was never trained to drop tokens.
    """
    folder = verify_checkpoint(folder)
    path = folder / WEIGHTS_FILE
    try:
        weights = load_file(path)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"checkpoint file {path} is damaged ({e})") from e
    dcp = dcp_parameter_names(model)
    if dcp and not init_dcp and not set(dcp) & set(weights):
        raise ValueError(
            f"checkpoint {folder} has no DCP parameters (W_Qint, W_Kint, beta): it holds a model "
            "trained without DCP; start DCP from it with load_weights(..., init_dcp=True) or "
            f"`lapse train ... --init-from {folder} --model.attention dcp`"
        )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if init_dcp and set(missing) == set(dcp):
        missing = []
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not fit the model: missing {missing}, unexpected {unexpected}"
        )


__all__ = [
    "CHECKPOINT_NAME",
    "CONFIG_FILE",
    "IMPORTED_FILE",
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "POINTER",
    "TRAINER_STATE_FILE",
    "WEIGHTS_FILE",
    "CheckpointError",
    "SavedRun",
    "checkpoint_folders",
    "checkpoint_step",
    "corpus_config_from_json",
    "dcp_parameter_names",
    "file_digest",
    "latest_checkpoint",
    "latest_intact_checkpoint",
    "load_weights",
    "model_config_from_json",
    "read_run",
    "verify_checkpoint",
]
