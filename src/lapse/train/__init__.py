"""Training: typed run configs with presets, the loop, checkpoints, metrics and reports.

``lapse train PRESET`` runs :func:`train`; ``lapse resume RUN_DIR`` runs :func:`resume`.
Under ``torchrun`` the same code trains with FSDP2 or DDP (:mod:`.distributed`). Run
folders and checkpoints are read back with :mod:`lapse.models.checkpoint`.
"""

from lapse.train.checkpoint import load_checkpoint, save_checkpoint
from lapse.train.config import TRAIN_PRESETS, ResumeConfig, TrainConfig, train_preset
from lapse.train.data import prepare_data
from lapse.train.metrics import plot_losses, read_metrics, write_report
from lapse.train.trainer import config_from_json, lr_at, print_outcome, resume, train

__all__ = [
    "TRAIN_PRESETS",
    "ResumeConfig",
    "TrainConfig",
    "config_from_json",
    "load_checkpoint",
    "lr_at",
    "plot_losses",
    "prepare_data",
    "print_outcome",
    "read_metrics",
    "resume",
    "save_checkpoint",
    "train",
    "train_preset",
    "write_report",
]
