"""What every evaluation starts from: a model loaded from disk, its tokenizer, and data.

:func:`load_model` takes any of the places a lapse model lives:

- a training run folder (``config.json`` + ``checkpoint-*/``, see
  :mod:`lapse.models.checkpoint`): the newest checkpoint (verified: a damaged one is an
  error naming the file), the run's tokenizer, the run's saved configuration;
- one ``checkpoint-<step>/`` folder inside such a run;
- a Hugging Face folder written by ``LapseForCausalLM.save_pretrained`` (its tokenizer
  too when one was saved beside it).

:func:`eval_windows` cuts fixed-length token windows from the run's validation split (or
any corpus), deterministically from a seed, for loss-type evaluations.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from lapse.data import (
    DEFAULT_DATA_DIR,
    CorpusConfig,
    Tokenizer,
    WindowSampler,
    cached_with,
    load_tokenizer,
    prepare_data,
)
from lapse.models import Decoder, ModelConfig
from lapse.models.checkpoint import (
    CHECKPOINT_NAME,
    CONFIG_FILE,
    SavedRun,
    checkpoint_folders,
    is_export_folder,
    latest_checkpoint,
    load_weights,
    read_run,
)
from lapse.ops.backend import resolve_device


@dataclass
class LoadedModel:
    """A model ready for evaluation (``eval()`` mode, on its device)."""

    model: Decoder
    """The decoder; ``model.config`` is its :class:`~lapse.models.ModelConfig`."""
    tokenizer: Tokenizer | None
    """The tokenizer it was trained with, when one was found beside the weights."""
    name: str
    """A short label for plots and tables (the run folder's name by default)."""
    path: Path
    """Where it was loaded from."""
    train_config: SavedRun | None = None
    """What the run folder's ``config.json`` says: model, corpus, tokenizer, data folder,
    training context (run folders only)."""
    tokenizer_path: Path | None = None
    """Where :attr:`tokenizer` was saved (the run's ``tokenizer/``, or beside an HF folder)."""

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def context(self) -> int:
        """The context the model was trained at: the run's row length (``--seq-len``), or
        ``max_seq_len`` when there is no run config."""
        run = self.train_config
        return run.context if run is not None else self.config.max_seq_len


def load_model(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
    **overrides,
) -> LoadedModel:
    """Load a lapse model from a run folder, a checkpoint folder or a Hugging Face folder.

    ``device="auto"``: CUDA when available, else CPU. ``overrides`` replace
    :class:`~lapse.models.ModelConfig` fields (e.g. ``acp=True``,
    ``acp_eps=1e-3``, ``attn_backend="naive"``) without touching the weights. Raises
    ``ValueError`` naming the path when nothing loadable is there.
    """
    device = resolve_device(device)
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model path does not exist: {path}")
    run_dir, folder = None, None
    if (path / CONFIG_FILE).exists() and checkpoint_folders(path):
        run_dir, folder = path, latest_checkpoint(path)
    elif CHECKPOINT_NAME.fullmatch(path.name) and (path.parent / CONFIG_FILE).exists():
        run_dir, folder = path.parent, path
    if run_dir is not None:
        train_config = read_run(run_dir)
        model_config = replace(train_config.model, **overrides)
        model = Decoder(model_config)
        load_weights(folder, model)
        tokenizer_path = run_dir / "tokenizer" if (run_dir / "tokenizer").exists() else None
        tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
        label = name or run_dir.name
    elif is_export_folder(path):
        from lapse.hf import LapseForCausalLM

        hf = LapseForCausalLM.from_pretrained(path)
        model = hf.model
        if overrides:
            state = model.state_dict()
            model = Decoder(replace(model.config, **overrides))
            model.load_state_dict(state)
        tokenizer, tokenizer_path = _tokenizer_beside(path)
        train_config, label = None, name or path.name
    else:
        raise ValueError(
            f"no lapse model at {path}: expected a run folder (config.json and checkpoint-*/), a "
            "checkpoint folder of a run, or a Hugging Face folder saved by LapseForCausalLM"
        )
    model = model.to(device=device, dtype=dtype).eval()
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=label, path=path, train_config=train_config,
        tokenizer_path=tokenizer_path,
    )


def output_folder(result: dict, cfg, name: str) -> Path:
    """Where an evaluation wrote its files: its ``out_dir``, by default
    :func:`default_eval_dir` of its first model."""
    out = result.get("out_dir") if isinstance(result, dict) else None
    if out is None:
        out = getattr(cfg, "resolved_out_dir", None) or getattr(cfg, "out_dir", None)
    if out is None:  # with --hf alone there is no model folder: the working directory's eval/
        model = (cfg.models or [None])[0] if hasattr(cfg, "models") else cfg.model
        out = default_eval_dir(model, name)
    return Path(out)


def default_eval_dir(model: str | Path | None, name: str) -> Path:
    """Where an evaluation of ``model`` writes unless told: ``<model>/eval/<name>/``; for one
    of a run's checkpoint folders ``<run>/eval/<name>-<checkpoint>/`` (a run deletes the
    checkpoints it rotates out, and ``lapse report RUN`` reads ``RUN/eval/``); ``./eval/<name>/``
    without a model folder (``--hf`` alone)."""
    if model is None:
        return Path("eval") / name
    model = Path(model)
    if CHECKPOINT_NAME.fullmatch(model.name) and (model.parent / CONFIG_FILE).exists():
        return model.parent / "eval" / f"{name}-{model.name}"
    return model / "eval" / name


def eval_name(name: str, policy: str | None) -> str:
    """The folder name of evaluation ``name``, ``<name>-<policy>`` under ``--policy``
    (``ppl-h2o``): results under a policy never replace the model's own, and ``lapse
    report`` shows them apart."""
    return name if policy is None else f"{name}-{policy}"


def check_out_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """``out_dir`` as a path, checked before an evaluation runs: a folder (or nothing yet)
    that holds no earlier evaluation (its ``results.json`` or ``summary.md``), unless
    ``overwrite``. Raises ``ValueError`` naming the folder and ``--overwrite``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file: the output folder must be a folder")
    earlier = [name for name in ("results.json", "summary.md") if (out_dir / name).exists()]
    if earlier and not overwrite:
        raise ValueError(f"{out_dir} holds an earlier evaluation ({earlier[0]}): --overwrite replaces it, "
                         "--out-dir writes elsewhere")
    return out_dir


def export_hf(path: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write the model at ``path`` (a run or checkpoint folder) as a Hugging Face folder:
    ``save_pretrained`` (``config.json``, ``model.safetensors``) plus ``tokenizer/``.
    It loads with ``AutoModelForCausalLM.from_pretrained`` once ``lapse.hf`` is
    imported, and with :func:`load_model`. ``out_dir`` must be new or empty, or (with
    ``overwrite``) an earlier export: anything else (a training run, above all) is refused
    before the model loads."""
    from lapse.hf import LapseForCausalLM

    out_dir = Path(out_dir)
    _check_export_target(Path(path), out_dir, overwrite)
    loaded = load_model(path)
    if overwrite and (out_dir / "tokenizer").is_dir():  # the earlier export's: not this model's
        shutil.rmtree(out_dir / "tokenizer")
    LapseForCausalLM.from_decoder(loaded.model).save_pretrained(out_dir)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save(out_dir / "tokenizer")
    return out_dir


def _check_export_target(source: Path, out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file: give `lapse export` a folder to write")
    if source.exists() and out_dir.resolve() in (source.resolve(), *source.resolve().parents):
        raise ValueError(f"{out_dir} holds the model being exported ({source}): give a folder outside it")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not is_export_folder(out_dir):
        raise ValueError(f"{out_dir} is not empty and not a `lapse export` folder (a training run?): "
                         "give a new folder")
    if not overwrite:
        raise ValueError(f"{out_dir} already holds a `lapse export`: --overwrite replaces it")


def _tokenizer_beside(path: Path) -> tuple[Tokenizer | None, Path | None]:
    for candidate in (path / "tokenizer", path):
        try:
            return load_tokenizer(candidate), candidate
        except ValueError:
            continue
    return None, None


def eval_windows(
    loaded: LoadedModel,
    seq_len: int,
    num: int,
    *,
    seed: int = 0,
    corpus: CorpusConfig | None = None,
    data_dir: str | Path | None = None,
) -> torch.Tensor:
    """``num`` windows of ``seq_len + 1`` token ids (int64 ``[num, seq_len + 1]``) from the
    validation split of ``corpus`` (default: the run's own corpus), tokenised with the
    model's tokenizer and cached under ``data_dir`` (default: the run's data folder).

    The same (model, corpus, seq_len, num, seed) always gives the same windows. Windows
    start anywhere and may cross document boundaries (separated by eos), as in training.
    """
    run = loaded.train_config
    if run is None and (corpus is None or loaded.tokenizer_path is None):
        needs = [] if corpus is not None else ["pass a corpus (on the command line: corpus:corpus-config "
                                               "--corpus.kind text --corpus.paths FILE)"]
        needs += [] if loaded.tokenizer_path is not None else ["save a tokenizer beside the model"]
        raise ValueError(f"{loaded.path} is not a training run: {', and '.join(needs)}")
    if run is not None:
        tokenizer, vocab_size = run.tokenizer, run.model.vocab_size
        corpus = corpus if corpus is not None else run.corpus
        data_dir = Path(data_dir) if data_dir is not None else run.data_dir
    else:
        tokenizer, vocab_size = str(loaded.tokenizer_path), loaded.config.vocab_size
        data_dir = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    if tokenizer == "bpe" and not cached_with(
        corpus, tokenizer, vocab_size=vocab_size, data_dir=data_dir, tokenizer_path=loaded.tokenizer_path
    ):
        # Tokenise with the run's own BPE: learning one again (another corpus, another
        # machine, a missing cache) could give different ids than the model was trained on.
        tokenizer = str(loaded.tokenizer_path)
    data = prepare_data(corpus, tokenizer, vocab_size=vocab_size, data_dir=data_dir, progress=False)
    if data.validation is None:
        raise ValueError(
            f"the corpus of {loaded.name} has no validation split (val_fraction = 0): pass a corpus to "
            "evaluate on (on the command line: corpus:corpus-config --corpus.kind text --corpus.paths FILE)"
        )
    sampler = WindowSampler(shards=data.validation, seq_len=seq_len, batch_size=num, seed=seed)
    x, y = sampler.batch(0)
    return torch.cat([x, y[:, -1:]], dim=1)  # [num, seq_len + 1]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()
