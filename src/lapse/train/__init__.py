"""Training: typed run configs with presets, the loop, checkpoints, metrics and reports.

``lapse train PRESET`` runs :func:`train`; ``lapse resume RUN_DIR`` runs :func:`resume`.
Under ``torchrun`` the same code trains with FSDP2 or DDP (:mod:`.distributed`). Run
folders and checkpoints are read back with :mod:`lapse.models.checkpoint`. Each name loads
with its submodule on first use (:mod:`.config` imports no torch).
"""

from lapse.lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    ".checkpoint": ("load_checkpoint", "save_checkpoint"),
    ".config": ("TRAIN_PRESETS", "ResumeConfig", "TrainConfig", "train_preset"),
    ".data": ("prepare_data",),
    ".metrics": ("plot_losses", "read_metrics", "write_report"),
    ".trainer": ("config_from_json", "lr_at", "print_outcome", "resume", "train"),
})
