"""The training loop, read top to bottom.

:func:`train` starts a run in a new folder; :func:`resume` continues one from its last
checkpoint (the loss curve continues exactly: batches are a pure function of the step,
the learning rate a pure function of the step, and the optimizer state is restored).
Both end in :func:`_run`, which works the same in one process and under ``torchrun``:

    _hold_run_dir   one writer per run folder (a lock), leftovers of dead writers removed
    _setup          the run folder, the data, the model and optimizer, the saved state
    _train          until the last step or a stop: one optimizer step, then whatever
                    falls due after it (log, ACP statistics, validation, checkpoint)
    _end_session    the last metrics, the final checkpoint
    _summary        what the report and ``summary.json`` say

Ctrl-C (SIGINT) or SIGTERM stops the run after the current step with a checkpoint, the
plot and the report; a second Ctrl-C stops at once, and the last complete checkpoint
stays valid (see :mod:`.checkpoint`). A resume starts from the newest intact checkpoint:
a damaged newer one is named, set aside (``checkpoint-<step>.damaged``) and skipped.

Fine-tuning (``init_from``) starts a new run from another run's weights; a model with DCP
attention adds the sparsity term to the loss and follows the alpha schedule
(:mod:`.dcp`), and logs the share of context dropped beside the loss.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from lapse.data import PreparedData, WindowSampler
from lapse.files import write_json_atomic
from lapse.interrupt import StopFlag, stop_signals
from lapse.layers import ContextParallel
from lapse.models import Decoder, flops_per_token, keep_grads, optimizer_groups, param_count, prepare_blocks
from lapse.models.checkpoint import (
    CONFIG_FILE,
    IMPORTED_FILE,
    CheckpointError,
    checkpoint_folders,
    checkpoint_step,
    corpus_config_from_json,
    is_export_folder,
    latest_checkpoint,
    latest_intact_checkpoint,
    load_weights,
    model_config_from_json,
    read_run,
    verify_checkpoint,
)
from lapse.models.mfu import peak_tflops
from lapse.ops.forgetting import set_value_checks

from .checkpoint import load_checkpoint, remove_stale_temporaries, save_checkpoint, set_aside
from .config import GPU_PRESETS, RESUME_FIELDS, TRAIN_PRESETS, DCPTrainConfig, TrainConfig
from .data import prepare_data, with_run_tokenizer
from .dcp import DCPTraining, dcp_layers
from .distributed import (
    World,
    all_reduce_mean,
    any_rank,
    close_world,
    context_parallel,
    gradient_sync,
    init_world,
    parallelize,
    unwrap,
)
from .lock import RunInUse, run_lock
from .metrics import METRICS_FILE, MetricsLog, plot_losses, write_report


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up to ``cfg.lr``,
    then a cosine down to ``cfg.min_lr_ratio * cfg.lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def train(cfg: TrainConfig) -> dict:
    """Train a new run into ``cfg.run_dir``; returns the run summary (see ``summary.json``)."""
    return _run(cfg, resuming=False)


def resume(run_dir: str | Path, **overrides) -> dict:
    """Continue the run in ``run_dir`` from its newest intact checkpoint with its saved
    config. ``overrides``: run-time fields of :class:`TrainConfig` for this session
    (:data:`~lapse.train.config.RESUME_FIELDS`; ``None`` keeps the saved value); a new
    ``steps`` total is saved with the run, so a later plain resume keeps it."""
    unknown = sorted(set(overrides) - set(RESUME_FIELDS))
    if unknown:
        raise ValueError(f"resume cannot change {unknown}; it takes {', '.join(RESUME_FIELDS)}")
    run_dir = Path(run_dir)
    if (run_dir / IMPORTED_FILE).exists():
        raise ValueError(
            f"{run_dir} holds an imported pretrained model, not a training run: fine-tune it with "
            f"`lapse train PRESET --init-from {run_dir}`"
        )
    cfg = config_from_json(read_run(run_dir).config)
    folders = checkpoint_folders(run_dir)
    done = checkpoint_step(folders[0]) if folders else 0
    if overrides.get("steps") is not None and overrides["steps"] < done:
        raise ValueError(f"--steps {overrides['steps']} is below the {done} steps {run_dir} has done: "
                         f"pass at least {done}")
    steps = overrides.get("steps") or cfg.steps
    stop_at = overrides.get("stop_at_step")
    if stop_at is not None and stop_at <= done < steps:
        raise ValueError(f"--stop-at-step {stop_at} is not past the {done} steps {run_dir} has done: "
                         f"pass a step above {done}")
    if done >= steps and int(os.environ.get("RANK", "0")) == 0:
        print(f"{run_dir} has done all its {steps} steps: to train on, give a larger total (--steps N)")
    # a stop or a time limit belongs to the session that set it, not to the run
    session = {"run_dir": run_dir, "time_limit_minutes": None, "stop_at_step": None}
    session.update({k: v for k, v in overrides.items() if v is not None})
    return _run(replace(cfg, **session), resuming=True)


def print_outcome(summary: dict) -> None:
    """Say (on rank 0) how the session ended and where the run's files are."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    run_dir = summary["run_dir"]
    print(
        f"{summary['status']} at step {summary['step']}/{summary['steps']}: report {run_dir}/report.md, "
        f"plot {run_dir}/loss.png, metrics {run_dir}/metrics.jsonl"
    )
    if summary["status"] != "finished":
        print(f"continue with: lapse resume {run_dir}")


def config_to_json(cfg: TrainConfig) -> dict:
    return json.loads(json.dumps(asdict(cfg), default=str))


def config_from_json(obj: dict) -> TrainConfig:
    """The :class:`TrainConfig` saved in a run folder's ``config.json``."""
    obj = dict(obj)
    obj["model"] = model_config_from_json(obj["model"])
    obj["corpus"] = corpus_config_from_json(obj["corpus"])
    obj["data_dir"] = Path(obj["data_dir"])
    obj["run_dir"] = None if obj["run_dir"] is None else Path(obj["run_dir"])
    obj["dcp"] = DCPTrainConfig(**obj.get("dcp", {}))  # runs saved before DCP: the defaults
    obj["init_from"] = None if obj.get("init_from") is None else Path(obj["init_from"])
    peak = obj.get("peak_tflops")
    if peak is not None and not peak > 0:  # runs saved before the check: MFU from the device's table
        warnings.warn(f"the run's saved peak_tflops {peak} is not positive: dropped (a session's "
                      "--peak-tflops sets one, else MFU comes from the device's known peak)", stacklevel=2)
        obj["peak_tflops"] = None
    return TrainConfig(**obj)


def init_source(path: Path) -> tuple[Path, Path | None]:
    """The checkpoint folder ``init_from`` names (a run folder's newest, or the folder
    itself), verified, and its run folder (``None`` for a checkpoint outside a run)."""
    path = Path(path)
    if is_export_folder(path):
        raise ValueError(f"init_from {path} is a `lapse export` folder: give the run it was exported from")
    if (path / CONFIG_FILE).exists():
        folder = latest_checkpoint(path)
        if folder is None:
            raise ValueError(f"init_from {path} holds no checkpoint to start from")
        return folder, path
    run = path.parent if (path.parent / CONFIG_FILE).exists() else None
    return verify_checkpoint(path), run


def with_init_model(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the model and tokenizer of the run ``init_from`` comes from: its
    architecture, with DCP on its softmax attention when ``cfg.model.attention`` is
    ``"dcp"`` (``dcp_r`` and ``dcp_beta_init`` from ``cfg.model``). Unchanged without
    ``init_from`` or when the checkpoint is outside a run (then ``cfg.model`` must fit it)."""
    if cfg.init_from is None:
        return cfg
    _, run = init_source(cfg.init_from)
    if run is None:
        return cfg
    saved = read_run(run)
    model = saved.model
    if cfg.model.attention == "dcp" and model.attention != "dcp":
        if model.attention != "softmax":
            raise ValueError(
                f"DCP is fine-tuned from softmax attention; {run} holds a {model.name} model"
            )
        model = replace(model, attention="dcp", dcp_r=cfg.model.dcp_r, dcp_beta_init=cfg.model.dcp_beta_init)
    _warn_ignored_model_options(cfg, model, run)
    tokenizer = saved.tokenizer
    preset = _preset_defaults(cfg) or TrainConfig()
    named = {t if t in ("byte", "bpe") else str(Path(t).resolve()) for t in (preset.tokenizer, tokenizer)}
    mine = cfg.tokenizer if cfg.tokenizer in ("byte", "bpe") else str(Path(cfg.tokenizer).resolve())
    if mine not in named:  # given on the command line
        warnings.warn(f"--init-from {run} fine-tunes its model with its tokenizer: ignored --tokenizer "
                      f"{cfg.tokenizer}", stacklevel=2)
    if tokenizer not in ("byte", "bpe") and not Path(tokenizer).exists() and (run / "tokenizer").is_dir():
        tokenizer = str(run / "tokenizer")  # a run folder moved since (an imported one names its own)
    out = replace(cfg, model=model, tokenizer=tokenizer)
    return with_run_tokenizer(out, run / "tokenizer")


def _preset_defaults(cfg: TrainConfig) -> TrainConfig | None:
    """The config of ``cfg``'s preset as it comes (what the command line changed is the
    difference); ``None`` for a config not made from a preset."""
    return TRAIN_PRESETS[cfg.preset_name][1]() if cfg.preset_name in TRAIN_PRESETS else None


def _warn_ignored_model_options(cfg: TrainConfig, model, run: Path) -> None:
    """Warns of the model options given on top of ``cfg``'s preset that fine-tuning from
    ``run`` does not take (its model is ``run``'s, DCP's fields aside): they were dropped
    without a word."""
    defaults = _preset_defaults(cfg)
    if defaults is None:
        return
    preset = defaults.model
    ignored = [
        f"--model.{f.name.replace('_', '-')} {getattr(cfg.model, f.name)} "
        f"({run.name} has {getattr(model, f.name)})"
        for f in fields(model)
        if getattr(cfg.model, f.name) != getattr(preset, f.name)  # given on the command line
        and getattr(cfg.model, f.name) != getattr(model, f.name)
    ]
    if ignored:
        warnings.warn(f"--init-from {run} fine-tunes its model: ignored " + ", ".join(ignored), stacklevel=3)


def _autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def train_step(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    micro: int,
    device: torch.device,
    dtype: torch.dtype,
    grad_clip: float | None,
    regularizer: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on this rank's rows ``x, y`` (``[rows, T]``), ``micro`` rows per
    forward, gradients averaged over the micro-batches (and synchronised across ranks on
    the last one only). ``regularizer``: called after each forward, a term added to its
    loss (DCP's sparsity penalty). Returns the mean LM loss (without the term) and the
    gradient norm before clipping, as device tensors (reading them is the caller's sync)."""
    graphs = getattr(unwrap(module), "cuda_graphs", False)
    if graphs:
        keep_grads(module)
    pieces = list(zip(x.split(micro), y.split(micro), strict=True))
    total = torch.zeros((), device=device)
    for i, (xm, ym) in enumerate(pieces):
        with gradient_sync(module, i == len(pieces) - 1):
            with _autocast(device, dtype):
                # the loss alone: its logits are never made whole (Decoder.forward)
                _, loss = module(xm.to(device, non_blocking=True), ym.to(device, non_blocking=True),
                                 return_logits=False)
                objective = loss if regularizer is None else loss + regularizer()
            (objective / len(pieces)).backward()
        total += loss.detach().float() / len(pieces)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        module.parameters(), grad_clip if grad_clip is not None else math.inf
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=not graphs)  # CUDA-graphed blocks keep them (keep_grads)
    return total, grad_norm


class _Interval:
    """The train loss and the clock between two log points.

    Throughput is timed log point to log point (the loss read-back syncs the device), with
    validation and checkpoints left out (:meth:`paused`).
    """

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)  # summed over the interval's steps
        self.steps = 0
        self.t0 = time.perf_counter()
        self.lr = 0.0  # of the last step
        self.grad_norm = torch.zeros(())  # of the last step, before clipping

    def add(self, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor) -> None:
        self.loss += loss
        self.steps += 1
        self.lr, self.grad_norm = lr, grad_norm

    def restart(self) -> None:
        self.loss.zero_()
        self.steps = 0
        self.t0 = time.perf_counter()

    @contextmanager
    def paused(self):
        """Keep what runs inside (validation, a checkpoint) off the throughput clock."""
        paused = time.perf_counter()
        yield
        self.t0 += time.perf_counter() - paused


@dataclass(eq=False)
class _Run:
    """Everything one training session works with."""

    cfg: TrainConfig
    world: World
    run_dir: Path
    data: PreparedData
    sampler: WindowSampler
    val_sampler: WindowSampler | None  # None: the corpus has no validation split
    micro: int  # rows per forward and backward on this rank
    context: ContextParallel | None  # this rank's part of each row (--cp), None: whole rows
    model: Decoder
    wrapped: torch.nn.Module  # the model as the loop calls it (FSDP2 / DDP / itself)
    optimizer: torch.optim.Optimizer
    dtype: torch.dtype  # autocast
    state: dict  # progress: step, tokens, elapsed_s (saved in every checkpoint)
    log: MetricsLog
    bar: tqdm
    last_saved: int  # step of the newest checkpoint; -1: none yet
    interval: _Interval
    session_start: float  # state["elapsed_s"] when this session began
    dense_flops: float  # per token, attention counted dense causal (the dense-equivalent count)
    flops: float | None  # per token, the work done, for MFU; ACP: at the last measured pruned share,
    # None before one
    peak: float | None  # TFLOP/s of one device; None: unknown, no MFU
    n_params: int
    dcp: DCPTraining | None  # the model has DCP attention: penalty, alpha, dropped share

    @property
    def step(self) -> int:
        return self.state["step"]

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.context


def _run(cfg: TrainConfig, *, resuming: bool) -> dict:
    if not resuming:
        cfg = _absolute_paths(cfg)
        _check_new_run_dir(cfg.run_dir)
    world = init_world(cfg.device)
    if world.main and world.device.type != "cuda" and cfg.preset_name in GPU_PRESETS:
        # before the corpus and the model are prepared: the user can stop here, not minutes later
        where = world.device.type.upper()
        warnings.warn(f"{cfg.preset_name} is made for a GPU and this run is on the {where}, where a step "
                      "takes minutes: on a CPU train cpu-small (minutes in all) or cpu-tiny (seconds)",
                      stacklevel=3)
    ended = False  # the run ended normally (finished or stopped): the ranks leave together
    try:
        run_dir = cfg.run_dir if resuming else _new_run_dir(cfg, world)
        new_run = world.main and not resuming
        with _undone_if_setup_fails(run_dir, new_run) as started, _hold_run_dir(run_dir, world):
            run = _setup(replace(cfg, run_dir=run_dir), world, resuming)
            started()
            # The handlers stay installed until the final checkpoint is written, and again
            # for the report: a SIGTERM then must not kill the process half way.
            stop = StopFlag("stopping after this step with a checkpoint")
            with stop_signals(stop):
                status = _train(run, stop)
                _end_session(run)
            summary = _summary(run, status)
            ended = True  # the ranks' shared work is done: rank 0 alone writes the report now
            if world.main:
                with stop_signals(stop):
                    plot_losses(run.run_dir)
                    write_report(run.run_dir, summary)
        return summary
    finally:
        close_world(world, clean=ended)


@contextmanager
def _undone_if_setup_fails(run_dir: Path, new_run: bool):
    """Yields ``started``, to call once the run is set up. Until then an error (a bad corpus, an
    ``init_from`` of another kind) leaves no trace of a new run: a folder this call made is
    removed, and one that was empty is emptied again (the one-line error is all the user sees)."""
    made = new_run and not run_dir.exists()
    emptied = new_run and not made and run_dir.is_dir() and not any(run_dir.iterdir())
    done = False

    def started() -> None:
        nonlocal done
        done = True

    try:
        yield started
    except BaseException:
        if not done and made:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif not done and emptied:
            for path in run_dir.iterdir():
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        raise


@contextmanager
def _hold_run_dir(run_dir: Path, world: World):
    """Hold the run folder's lock (rank 0, for all ranks) and remove what dead writers left;
    every rank fails alike when another process holds it."""
    with ExitStack() as stack:
        error = None
        if world.main:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                error = FileNotFoundError(f"cannot create the run folder {run_dir}: {e.strerror}")
            else:
                try:
                    stack.enter_context(run_lock(run_dir))
                except RunInUse as e:
                    error = e
        if world.distributed:
            message = [None if error is None else str(error)]
            dist.broadcast_object_list(message, src=0)
            if error is None and message[0] is not None:
                error = RunInUse(message[0])
        if error is not None:
            raise error
        if world.main:
            for path in remove_stale_temporaries(run_dir):
                print(f"removed {path.name}, left by an interrupted writer", flush=True)
        yield


def _setup(cfg: TrainConfig, world: World, resuming: bool) -> _Run:
    """The run folder, the data, the model and optimizer, and the progress so far."""
    run_dir = cfg.run_dir
    if resuming:
        folder = _resume_point(run_dir, world)
        if world.main:
            _save_total_steps(run_dir, cfg.steps)
        cfg = with_run_tokenizer(cfg, run_dir / "tokenizer")
    else:
        if checkpoint_folders(run_dir):
            raise ValueError(
                f"{run_dir} already holds a run with a checkpoint; continue it with "
                f"`lapse resume {run_dir}` or choose another run_dir"
            )
        cfg = with_init_model(cfg)
        if world.main:
            write_json_atomic(run_dir / CONFIG_FILE, config_to_json(cfg))
            window = cfg.model.castle_window  # row i's lookahead takes keys j in (i, i + W]
            if window is not None and window >= cfg.context - 1:
                warnings.warn(f"castle_window {window} spans the context {cfg.context}: every lookahead key "
                              "sees the whole row, so this trains CASTLE without a window", stacklevel=2)
    show = cfg.progress and world.main
    data = prepare_data(cfg, rank=world.rank, progress=show, new_run=not resuming)
    if world.main and not resuming:
        data.tokenizer.save(run_dir / "tokenizer")
    world, context = context_parallel(world, cfg.cp, cfg.cp_mode)
    micro = _micro_batch_rows(cfg, world)
    model, wrapped, optimizer = _model_and_optimizer(cfg, world, init=not resuming, context=context)
    layers = dcp_layers(model)
    dcp = DCPTraining(layers, cfg.dcp, cfg.steps, world.device) if layers else None

    # Progress so far: a resumed run continues from its checkpoint's step.
    state = {"step": 0, "tokens": 0, "elapsed_s": 0.0}
    if resuming:
        state = load_checkpoint(folder, wrapped, optimizer)
    start = state["step"]
    log = MetricsLog(run_dir, enabled=world.main, resume_step=start if resuming else None)
    if resuming and world.main:
        log.write({"kind": "resume", "step": start, "time": datetime.now().isoformat(timespec="seconds")})
    dtype = {
        "auto": torch.bfloat16 if world.device.type == "cuda" else torch.float32,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
    }[cfg.precision]
    bar = tqdm(
        total=cfg.steps, initial=start, disable=not show, desc="training", unit="step", dynamic_ncols=True
    )
    return _Run(
        cfg=cfg,
        world=world,
        run_dir=run_dir,
        data=data,
        sampler=_sampler(data.train, cfg, cfg.seed, "training"),
        val_sampler=_sampler(data.validation, cfg, cfg.seed + 1, "validation")
        if data.validation is not None and cfg.val_every
        else None,
        micro=micro,
        context=context,
        model=model,
        wrapped=wrapped,
        optimizer=optimizer,
        dtype=dtype,
        state=state,
        log=log,
        bar=bar,
        last_saved=start if resuming else -1,
        interval=_Interval(world.device),
        session_start=state["elapsed_s"],
        dense_flops=flops_per_token(cfg.model, cfg.context),
        flops=_flops_done(cfg, state.get("acp_pruned_last")),
        peak=peak_tflops(world.device, cfg.peak_tflops),
        n_params=param_count(model),
        dcp=dcp,
    )


def _micro_batch_rows(cfg: TrainConfig, world: World) -> int:
    """Rows per forward: the global batch is split over the ranks' groups that hold
    different rows (every rank, without context parallelism), then into micro-batches."""
    if cfg.batch_size % world.data_size:
        groups = "processes" if world.cp == 1 else f"groups of {world.cp} processes (--cp)"
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by the {world.data_size} {groups}")
    rows = cfg.batch_size // world.data_size
    micro = cfg.micro_batch_size or rows
    if rows % micro:
        raise ValueError(f"micro_batch_size ({micro}) must divide the {rows} rows per process")
    return micro


def cuda_graphs_off(cfg: TrainConfig, world: World) -> str | None:
    """Why the run's compiled blocks are not replayed as CUDA graphs (``None``: they are)."""
    if not cfg.compile:
        return "the blocks are not compiled"
    if not cfg.cuda_graphs:
        return "--no-cuda-graphs"
    if world.device.type != "cuda":
        return f"the run is on {world.device.type}"
    if world.distributed:  # the graphs would hold FSDP's gathered parameters and DDP's buckets
        return f"{world.size} processes (FSDP or DDP)"
    if cfg.activation_checkpointing:  # torch 2.11: recording the recomputed forward fails
        return "activation checkpointing"
    return None


def graphed(cfg: TrainConfig, world: World) -> bool:
    return cuda_graphs_off(cfg, world) is None


def _model_and_optimizer(
    cfg: TrainConfig, world: World, init: bool = True, context: ContextParallel | None = None
) -> tuple[Decoder, torch.nn.Module, torch.optim.Optimizer]:
    """The model (float32 parameters; autocast does the low precision; the weights of
    ``init_from`` when ``init``), the module the loop calls (sharded or wrapped across
    ranks), and AdamW over its parameter groups (the DCP interaction parameters only, with
    ``dcp.interaction_only``)."""
    torch.manual_seed(cfg.seed)
    model = Decoder(cfg.model).to(world.device)
    layers = dcp_layers(model)
    if (cfg.dcp.gamma > 0 or cfg.dcp.interaction_only) and not layers:
        raise ValueError(
            f"the dcp options need a model with DCP attention (--model.attention dcp); got {cfg.model.name}"
        )
    if init and cfg.init_from is not None:
        load_weights(init_source(cfg.init_from)[0], model, init_dcp=True)
    if cfg.dcp.interaction_only:
        trained = {id(p) for layer in layers for p in layer.interaction_parameters()}
        for p in model.parameters():
            p.requires_grad_(id(p) in trained)
    model.set_context(context)  # before compiling: the blocks trace its collectives
    mode = "reduce-overhead" if graphed(cfg, world) else cfg.compile
    prepare_blocks(model, activation_checkpointing=cfg.activation_checkpointing, compile=mode)
    if world.device.type == "cuda":
        set_value_checks(False)  # the NaN/positive-gate check costs a host sync per layer
    wrapped = parallelize(
        model, world, cfg.parallel, reshard_after_forward=cfg.fsdp_reshard_after_forward,
        param_dtype=getattr(torch, cfg.fsdp_param_dtype),
    )
    optimizer = torch.optim.AdamW(
        optimizer_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.adam_eps,
        fused=world.device.type == "cuda",
    )
    return model, wrapped, optimizer


def _sampler(shards, cfg: TrainConfig, seed: int, split: str) -> WindowSampler:
    """The windows of one split; a split too short for one window is an error that says what
    to change (a single small file's validation split is 1% of its bytes)."""
    longest = max((len(t) for t in shards.shards), default=0)
    if longest < cfg.context + 1:  # a window lies inside one shard (WindowSampler)
        fix = ("a larger --corpus.val-fraction, or no validation (--val-every 0 or --corpus.val-fraction 0)"
               if split == "validation" else "a shorter --seq-len")
        raise ValueError(
            f"the {split} split holds no window of {cfg.context + 1} tokens (context + 1; its longest "
            f"shard has {longest}): give more text, or {fix}"
        )
    return WindowSampler(shards=shards, seq_len=cfg.context, batch_size=cfg.batch_size, seed=seed)


def _absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its data folder, tokenizer path and ``init_from`` absolute, and the working
    directory as its corpus's ``root`` (the paths stay as written: a document's id, which the
    split hashes, is its path as written): the run's saved config then resumes and evaluates
    from any working directory."""
    corpus = cfg.corpus
    if corpus.kind != "python" and corpus.root is None:  # the paths as written: the split hashes them
        corpus = replace(corpus, root=os.getcwd())
    tokenizer = cfg.tokenizer if cfg.tokenizer in ("byte", "bpe") else os.path.abspath(cfg.tokenizer)
    init_from = None if cfg.init_from is None else Path(os.path.abspath(cfg.init_from))
    return replace(cfg, corpus=corpus, data_dir=Path(os.path.abspath(cfg.data_dir)), tokenizer=tokenizer,
                   init_from=init_from)


RUN_FILES = (CONFIG_FILE, METRICS_FILE, "tokenizer", "summary.json", "report.md", "loss.png", "eval")


def _check_new_run_dir(run_dir: Path | None) -> None:
    """A new run goes into a new or empty folder, or one that an earlier run left
    (:data:`RUN_FILES`, checkpoints, hidden files such as the lock, a killed writer's temporaries;
    :func:`_setup` refuses it where that run has a checkpoint), or one holding only logs: never
    a folder of other files (``--run-dir ""`` is the working directory)."""
    if run_dir is None or not run_dir.is_dir():
        return
    ours = ("checkpoint", ".")  # checkpoints (set aside too), checkpoint.json, the lock
    logs = (".log", ".out", ".err")  # `| tee RUN/train.log`, a scheduler's output: made before lapse starts

    def foreign(p: Path) -> bool:
        return not (p.name in RUN_FILES or p.name.startswith(ours) or ".tmp-" in p.name or p.suffix in logs)

    if any(foreign(p) for p in run_dir.iterdir()):
        shown = f"{run_dir} (the working directory)" if run_dir.resolve() == Path.cwd() else str(run_dir)
        raise ValueError(f"run_dir {shown} holds other files and no run: give a new folder")


def _new_run_dir(cfg: TrainConfig, world: World) -> Path:
    name = [
        str(cfg.run_dir)
        if cfg.run_dir is not None
        else f"runs/{cfg.preset_name}-{cfg.model.name}-{datetime.now():%Y%m%d-%H%M%S}"
    ]
    if world.distributed:  # one name for all ranks (their clocks may straddle a second)
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def _resume_point(run_dir: Path, world: World) -> Path:
    """The newest intact checkpoint (rank 0 decides for all); newer damaged ones are named
    and set aside, never read again."""
    found: list = [None, None]  # the folder's name, or the error every rank raises
    if world.main:
        folder, damaged = latest_intact_checkpoint(run_dir)
        if folder is None and damaged:
            found[1] = CheckpointError(f"no intact checkpoint in {run_dir}: " + "; ".join(map(str, damaged)))
        elif folder is None:
            found[1] = ValueError(f"{run_dir} holds no checkpoint to resume from")
        else:
            # latest_intact_checkpoint went newest first: the damaged ones are the newest folders
            for error, bad in zip(damaged, checkpoint_folders(run_dir), strict=False):
                aside = set_aside(bad)
                aside_note = f"{bad.name} set aside as {aside.name}"
                warnings.warn(f"{error}; resuming from {folder.name} ({aside_note})", stacklevel=2)
            found[0] = folder.name
    if world.distributed:
        dist.broadcast_object_list(found, src=0)
    if found[1] is not None:
        raise found[1]
    return run_dir / found[0]


def _save_total_steps(run_dir: Path, steps: int) -> None:
    """A new total of steps is part of the run from now on: a later plain resume keeps it."""
    saved = json.loads((run_dir / CONFIG_FILE).read_text())
    if saved["steps"] != steps:
        saved["steps"] = steps
        write_json_atomic(run_dir / CONFIG_FILE, saved)


def _train(run: _Run, stop: StopFlag) -> str:
    """Optimizer steps until the last one or a stop; returns the status of the session."""
    cfg = run.cfg
    while run.step < cfg.steps:
        if any_rank(stop.reason is not None, run.world):
            return "interrupted"
        # every acp_stats_every steps, and at the last one (as validation), so a run shorter than
        # the interval still reports its pruning
        every = cfg.acp_stats_every
        collect = cfg.model.acp and every > 0 and ((run.step + 1) % every == 0 or run.step + 1 == cfg.steps)
        _optimizer_step(run, collect)
        step = run.step
        if collect:  # first: the train record of this step counts the FLOPs of its pruning
            _log_acp(run)
        if step % cfg.log_every == 0 or step == cfg.steps:
            _log_train(run)
        if run.val_sampler is not None and cfg.val_every and (step % cfg.val_every == 0 or step == cfg.steps):
            with run.interval.paused():
                _validate(run)
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step in cfg.pin_steps:
            _log_train(run)  # the checkpoint's elapsed time and the metrics end at the same step
            with run.interval.paused():
                _checkpoint(run)
        if cfg.stop_at_step is not None and step >= cfg.stop_at_step and step < cfg.steps:
            return "stopped"
        limit = cfg.time_limit_minutes
        if limit is not None and any_rank(_session_seconds(run) > 60 * limit, run.world):
            return "time limit"
    return "finished"


def _optimizer_step(run: _Run, collect_acp_stats: bool) -> None:
    """One optimizer step: the batch of this step, at the learning rate of this step."""
    cfg, world, step = run.cfg, run.world, run.step
    lr = lr_at(step, cfg)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.model.set_collect_stats(collect_acp_stats)
    if run.dcp is not None:
        run.dcp.set_step(step)  # alpha: a function of the step, so a resume continues it
    x, y = _context_rows(run.context, *run.sampler.batch(step, world.data_rank, world.data_size))
    loss, grad_norm = train_step(
        run.wrapped, run.optimizer, x, y, run.micro, world.device, run.dtype, cfg.grad_clip, run.dcp
    )
    run.interval.add(loss, lr, grad_norm)
    run.state["step"], run.state["tokens"] = step + 1, run.state["tokens"] + run.tokens_per_step
    run.bar.update(1)


def _log_train(run: _Run) -> None:
    """A ``train`` record: the loss averaged over the steps since the last record of this
    session (``averaged_steps``: fewer than ``log_every`` after a stop or a resume), throughput."""
    interval = run.interval
    if interval.steps == 0:
        return
    loss = all_reduce_mean(interval.loss / interval.steps, run.world).item()  # syncs
    grad_norm = interval.grad_norm
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    seconds = time.perf_counter() - interval.t0
    run.state["elapsed_s"] += seconds
    tok_s = interval.steps * run.tokens_per_step / seconds
    mfu = _mfu(run, tok_s, run.flops)
    dcp = {}
    if run.dcp is not None:
        dropped, term = run.dcp.take()
        dropped = all_reduce_mean(dropped, run.world).tolist()
        dcp = {
            "alpha": run.dcp.alpha,
            "sparsity": sum(dropped) / len(dropped),
            "sparsity_per_layer": dropped,
            "sparsity_term": all_reduce_mean(term, run.world).item(),
        }
    run.log.write(
        {
            "kind": "train",
            "step": run.step,
            "tokens": run.state["tokens"],
            "loss": loss,
            "averaged_steps": interval.steps,
            "lr": interval.lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tok_s,
            "mfu": mfu,
            **({"mfu_dense_equivalent": _mfu(run, tok_s, run.dense_flops)} if run.cfg.model.acp else {}),
            "elapsed_s": run.state["elapsed_s"],
            **dcp,
        }
    )
    run.bar.set_postfix(
        loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", **({"mfu": f"{100 * mfu:.1f}%"} if mfu is not None else {})
    )
    interval.restart()


def _log_acp(run: _Run) -> None:
    """An ``acp`` record: the pruned fraction per layer and head of the step's last micro-batch.
    MFU counts the FLOPs of this pruning from now on, and the run's summary those of the
    mean over its measurements (kept in the progress state, so a resume continues them)."""
    pruned = unwrap(run.model).pruned_fractions()  # [n_layers, H]
    pruned = all_reduce_mean(pruned.to(run.world.device), run.world).cpu()
    mean = float(pruned.mean())
    state = run.state
    state["acp_pruned_last"] = mean
    state["acp_pruned_sum"] = state.get("acp_pruned_sum", 0.0) + mean
    state["acp_measurements"] = state.get("acp_measurements", 0) + 1
    with run.interval.paused():  # builds the model on the meta device to count its parameters
        run.flops = _flops_done(run.cfg, mean)
    run.log.write(
        {
            "kind": "acp",
            "step": run.step,
            "tokens": run.state["tokens"],
            "pruned": mean,
            "pruned_per_layer": pruned.mean(1).tolist(),
            "pruned_per_head": pruned.tolist(),
        }
    )
    run.model.set_collect_stats(False)


@torch.no_grad()
def _validate(run: _Run) -> None:
    """A ``val`` record: the loss on the same ``val_batches`` batches every time (in eval
    mode: a DCP model drops with the step mask of inference, and the record holds the
    share of context it dropped per layer)."""
    cfg, world, micro = run.cfg, run.world, run.micro
    run.wrapped.eval()
    total = torch.zeros((), device=world.device)
    dropped = torch.zeros(len(run.dcp.layers) if run.dcp else 0, device=world.device)  # [L]
    for i in range(cfg.val_batches):
        x, y = _context_rows(run.context, *run.val_sampler.batch(i, world.data_rank, world.data_size))
        for xm, ym in zip(x.split(micro), y.split(micro), strict=True):
            with _autocast(world.device, run.dtype):
                _, loss = run.wrapped(xm.to(world.device), ym.to(world.device), return_logits=False)
            total += loss.float()
            if run.dcp is not None:
                dropped += run.dcp.observe()[1]
    run.wrapped.train()
    rows = cfg.batch_size // world.data_size
    forwards = cfg.val_batches * (rows // micro)
    loss = all_reduce_mean(total / forwards, world).item()
    record = {"kind": "val", "step": run.step, "tokens": run.state["tokens"], "loss": loss}
    if run.dcp is not None:
        per_layer = all_reduce_mean(dropped / forwards, world).tolist()
        record.update(sparsity=sum(per_layer) / len(per_layer), sparsity_per_layer=per_layer)
    run.log.write(record)


def _context_rows(context: ContextParallel | None, x: torch.Tensor, y: torch.Tensor):
    """This rank's tokens of the rows ``x, y`` ``[rows, T]``: all of them in one process,
    else its two chunks of each row padded to a multiple of ``2 * cp`` (the padding's
    labels ``-100``: left out of the loss; being after every real token, causal attention
    never reads it)."""
    if context is None:
        return x, y
    pad = context.padded_length(x.shape[1]) - x.shape[1]
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=0)
        y = torch.nn.functional.pad(y, (0, pad), value=-100)
    return context.split(x), context.split(y)


def _checkpoint(run: _Run) -> None:
    save_checkpoint(
        run.run_dir, run.wrapped, run.optimizer, dict(run.state), run.world,
        keep=run.cfg.keep_checkpoints, pinned_steps=run.cfg.pin_steps,
    )
    run.last_saved = run.step


def _session_seconds(run: _Run) -> float:
    """Training time of this session so far (the time limit counts it, not the run's)."""
    return run.state["elapsed_s"] - run.session_start + time.perf_counter() - run.interval.t0


def _end_session(run: _Run) -> None:
    """Flush the last interval's metrics and leave a checkpoint of the last step."""
    _log_train(run)
    run.bar.close()
    if run.last_saved != run.step:
        _checkpoint(run)
    run.log.close()


def _summary(run: _Run, status: str) -> dict:
    cfg, world, state = run.cfg, run.world, run.state
    summary = {
        "status": status,
        "step": state["step"],
        "steps": cfg.steps,
        "preset": cfg.preset_name,
        "arch": cfg.model.name,
        "acp": cfg.model.acp,
        "params": run.n_params,
        "corpus": cfg.corpus.kind
        if cfg.corpus.kind == "python"
        else f"{cfg.corpus.kind}: {cfg.corpus.paths}",
        "tokenizer": cfg.tokenizer,
        "vocab_size": run.data.tokenizer.vocab_size,
        "train_tokens": run.data.train.num_tokens,
        "batch_size": cfg.batch_size,
        "seq_len": cfg.context,
        "world_size": world.size,
        "context_parallel": None if run.context is None else {"cp": world.cp, "mode": run.context.mode},
        "device": world.device.type,
        "compile": "cuda-graphs" if graphed(cfg, world) else ("compiled" if cfg.compile else "eager"),
        "tokens": state["tokens"],
        "elapsed_s": state["elapsed_s"],
        "tokens_per_s": state["tokens"] / state["elapsed_s"] if state["elapsed_s"] > 0 else 0.0,
        "run_dir": str(run.run_dir),
        "init_from": None if cfg.init_from is None else str(cfg.init_from),
        "dcp": None
        if run.dcp is None
        else {
            "gamma": cfg.dcp.gamma,
            "alpha": [cfg.dcp.alpha_start, cfg.dcp.alpha_end],
            "interaction_only": cfg.dcp.interaction_only,
            "r": cfg.model.dcp_r,
        },
    }
    measured = state.get("acp_measurements", 0)
    flops = _flops_done(cfg, state["acp_pruned_sum"] / measured if measured else None)
    summary["mfu"] = _mfu(run, summary["tokens_per_s"], flops)
    if cfg.model.acp:
        summary["mfu_dense_equivalent"] = _mfu(run, summary["tokens_per_s"], run.dense_flops)
        summary["acp_pruned_mean"] = state["acp_pruned_sum"] / measured if measured else None
    return summary


def _flops_done(cfg: TrainConfig, pruned: float | None) -> float | None:
    """Training FLOPs per token of the work done: with ACP, its pruned tiles left out at the
    measured pruned share ``pruned`` (``None``: not measured, the work is not known)."""
    if not cfg.model.acp:
        return flops_per_token(cfg.model, cfg.context)
    return None if pruned is None else flops_per_token(cfg.model, cfg.context, pruned=pruned)


def _mfu(run: _Run, tokens_per_s: float, flops: float | None) -> float | None:
    """``flops`` a token at ``tokens_per_s`` over the peak of all ranks; ``None`` when either
    is unknown."""
    if flops is None or not run.peak:
        return None
    return tokens_per_s * flops / (run.world.size * run.peak * 1e12)
