"""The settings of ``lapse eval lm-eval`` (:func:`lapse.eval.lm_eval.run_lm_eval`).

Kept apart from :mod:`lapse.eval.lm_eval` so the ``lapse`` command line can build its
options without importing the harness (which may be absent, e.g. on the GPU machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro

from lapse.eval.common import default_eval_dir, eval_name
from lapse.eval.lm import HfOptions
from lapse.generation import PolicyOptions

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _positive_int(name: str, value) -> int:
    """``value`` as an int >= 1; lm-eval's ``model_args`` strings (``"8"``) are accepted."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value



@dataclass(kw_only=True)
class LmEvalConfig(PolicyOptions, HfOptions):
    """lm-eval tasks on one lapse model or pretrained Hugging Face model (``--hf``),
    optionally under an eviction policy (``--policy``: each prompt pruned to the budget
    before its answer is scored, the A2SF protocol): the settings of :func:`run_lm_eval`."""

    model: Annotated[Path | None, tyro.conf.arg(aliases=("--models",))] = None
    """A run folder, checkpoint folder or Hugging Face folder (anything
    ``lapse.eval.load_model`` opens), with its tokenizer beside it; or none with ``--hf``."""
    tasks: tuple[str, ...]
    """lm-eval task, group or tag names: the bundled ``lapse_tiny_mc`` / ``_ppl`` / ``_gen``
    (tag ``lapse_tiny``), those in ``include_path``, or the harness's own (these need
    their datasets in the local Hugging Face cache)."""
    include_path: Path | None = None
    """A folder of task YAMLs searched besides the bundled ones."""
    limit: int | float | None = None
    """Documents per task: a count, or a fraction of the task when below 1; ``None``: all."""
    num_fewshot: int | None = None
    """Few-shot examples in each prompt; ``None``: the task's own setting (0 if it has none)."""
    batch_size: int = 8
    """Sequences per forward pass."""
    max_length: int | None = None
    """Context the requests are cut to, from the left; ``None``: the model's ``max_seq_len``."""
    device: str = "auto"
    """Where the model runs; ``"auto"``: CUDA when available, else CPU."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations of the model."""
    out_dir: Path | None = None
    """Where ``results.json``, ``summary.md`` and ``samples_<task>.jsonl`` go; ``None``:
    ``<model>/eval/lm-eval/`` (``lm-eval-<policy>/`` under ``--policy``)."""
    overwrite: bool = False
    """Replace an earlier evaluation in the output folder, its samples included (without it,
    one there is refused before anything runs)."""
    seed: int = 0
    """Seed of Python, NumPy, torch and the few-shot sampler."""
    log_samples: bool = True
    """Also write every document's prompt, responses and scores (``samples_<task>.jsonl``)."""
    progress: bool = True
    """Show lapse's progress bars (scoring and generation; lm-eval's own logging stays)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_source(self.model)
        if self.model is not None:
            self.model = Path(self.model)
            if not self.model.exists():
                raise ValueError(f"model path does not exist: {self.model}")
        names_ok = not isinstance(self.tasks, str) and all(isinstance(t, str) and t for t in self.tasks)
        if not self.tasks or not names_ok:
            raise ValueError(f"tasks must be a non-empty tuple of task names, got {self.tasks!r}")
        self.tasks = tuple(self.tasks)
        if self.include_path is not None:
            self.include_path = Path(self.include_path)
            if not self.include_path.is_dir():
                raise ValueError(f"include_path is not a folder: {self.include_path}")
        count = isinstance(self.limit, int) and self.limit >= 1
        fraction = isinstance(self.limit, float) and 0 < self.limit < 1
        if self.limit is not None and not (count or fraction):
            raise ValueError(f"limit must be an integer >= 1 or a fraction in (0, 1), got {self.limit!r}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"num_fewshot must be >= 0, got {self.num_fewshot}")
        _positive_int("batch_size", self.batch_size)
        if self.max_length is not None:
            _positive_int("max_length", self.max_length)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.out_dir is not None:
            self.out_dir = Path(self.out_dir)

    @property
    def resolved_out_dir(self) -> Path:
        return self.out_dir or default_eval_dir(self.model, eval_name("lm-eval", self.policy))
