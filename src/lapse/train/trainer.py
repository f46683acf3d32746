"""The training loop: one function, read top to bottom.

:func:`train` starts a run in a new folder; :func:`resume` continues one from its last
checkpoint (the loss curve continues exactly: batches are a pure function of the step,
the learning rate a pure function of the step, and the optimizer state is restored).
Both end in :func:`_run`, which works the same in one process and under ``torchrun``.

Ctrl-C (SIGINT) or SIGTERM stops the run after the current step with a checkpoint, the
plot and the report; a second Ctrl-C stops at once, and the last complete checkpoint
stays valid (see :mod:`.checkpoint`).
"""

from __future__ import annotations

import json
import math
import signal
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from lapse.data import WindowSampler
from lapse.files import write_json_atomic
from lapse.models import Decoder, flops_per_token, optimizer_groups, param_count
from lapse.models.checkpoint import (
    CONFIG_FILE,
    corpus_config_from_json,
    latest_checkpoint,
    model_config_from_json,
)
from lapse.models.mfu import peak_tflops
from lapse.ops.forgetting import set_value_checks

from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .data import prepare_data, with_run_tokenizer
from .distributed import (
    World,
    all_reduce_mean,
    any_rank,
    close_world,
    gradient_sync,
    init_world,
    parallelize,
    unwrap,
)
from .metrics import MetricsLog, plot_losses, write_report


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


def resume(
    run_dir: str | Path,
    *,
    steps: int | None = None,
    time_limit_minutes: float | None = None,
    stop_at_step: int | None = None,
    progress: bool | None = None,
) -> dict:
    """Continue the run in ``run_dir`` from its last checkpoint with its saved config;
    ``steps`` raises (or keeps) the total number of steps."""
    run_dir = Path(run_dir)
    if latest_checkpoint(run_dir) is None:
        raise ValueError(f"{run_dir} holds no checkpoint to resume from (no checkpoint.json)")
    saved = json.loads((run_dir / CONFIG_FILE).read_text())
    cfg = config_from_json(saved)
    if steps is not None and steps != cfg.steps:
        # the new total is part of the run from now on: a later plain resume keeps it
        saved["steps"] = steps
        write_json_atomic(run_dir / CONFIG_FILE, saved)
    overrides = {"run_dir": run_dir, "time_limit_minutes": time_limit_minutes, "stop_at_step": stop_at_step}
    if steps is not None:
        overrides["steps"] = steps
    if progress is not None:
        overrides["progress"] = progress
    return _run(replace(cfg, **overrides), resuming=True)


def config_to_json(cfg: TrainConfig) -> dict:
    return json.loads(json.dumps(asdict(cfg), default=str))


def config_from_json(obj: dict) -> TrainConfig:
    """The :class:`TrainConfig` saved in a run folder's ``config.json``."""
    obj = dict(obj)
    obj["model"] = model_config_from_json(obj["model"])
    obj["corpus"] = corpus_config_from_json(obj["corpus"])
    obj["data_dir"] = Path(obj["data_dir"])
    obj["run_dir"] = None if obj["run_dir"] is None else Path(obj["run_dir"])
    return TrainConfig(**obj)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on this rank's rows ``x, y`` (``[rows, T]``), ``micro`` rows per
    forward, gradients averaged over the micro-batches (and synchronised across ranks on
    the last one only). Returns the mean loss and the gradient norm before clipping, as
    device tensors (reading them is the caller's sync)."""
    pieces = list(zip(x.split(micro), y.split(micro), strict=True))
    total = torch.zeros((), device=device)
    for i, (xm, ym) in enumerate(pieces):
        with gradient_sync(module, i == len(pieces) - 1):
            with _autocast(device, dtype):
                _, loss = module(xm.to(device, non_blocking=True), ym.to(device, non_blocking=True))
            (loss / len(pieces)).backward()
        total += loss.detach().float() / len(pieces)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        module.parameters(), grad_clip if grad_clip is not None else math.inf
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm


class _StopFlag:
    """Set by SIGINT/SIGTERM; the loop stops at the next step boundary. A second SIGINT
    raises ``KeyboardInterrupt`` at once."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def __call__(self, signum, frame) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        print(
            f"\n{self.reason}: stopping after this step with a checkpoint (Ctrl-C again to stop at once)",
            flush=True,
        )


@contextmanager
def _signals(flag: _StopFlag):
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in previous:
            signal.signal(s, flag)
    except ValueError:  # not the main thread: run without the handlers
        previous = {}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run(cfg: TrainConfig, *, resuming: bool) -> dict:
    world = init_world(cfg.device)
    try:
        return _train_loop(cfg, world, resuming)
    finally:
        close_world(world)


def _new_run_dir(cfg: TrainConfig, world: World) -> Path:
    name = [
        str(cfg.run_dir)
        if cfg.run_dir is not None
        else f"runs/{cfg.preset_name}-{cfg.model.name}-{datetime.now():%Y%m%d-%H%M%S}"
    ]
    if world.distributed:  # one name for all ranks (their clocks may straddle a second)
        dist.broadcast_object_list(name, src=0)
    run_dir = Path(name[0])
    if latest_checkpoint(run_dir) is not None:
        raise ValueError(
            f"{run_dir} already holds a run with a checkpoint; continue it with "
            f"`lapse resume {run_dir}` or choose another run_dir"
        )
    return run_dir


def _train_loop(cfg: TrainConfig, world: World, resuming: bool) -> dict:
    run_dir = cfg.run_dir if resuming else _new_run_dir(cfg, world)
    cfg = replace(cfg, run_dir=run_dir)
    show = cfg.progress and world.main
    if world.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resuming:
            (run_dir / CONFIG_FILE).write_text(json.dumps(config_to_json(cfg), indent=2) + "\n")

    # Data: rows of the global batch are split over ranks, then into micro-batches. A
    # resumed BPE run reads its own saved tokenizer unless the data cache was made by it
    # (learning the BPE again elsewhere could give other ids than the model learned).
    saved_tokenizer = run_dir / "tokenizer"
    if resuming:
        cfg = with_run_tokenizer(cfg, saved_tokenizer)
    data = prepare_data(cfg, rank=world.rank, progress=show)
    if world.main and not resuming:
        data.tokenizer.save(saved_tokenizer)
    seq_len = cfg.context
    if cfg.batch_size % world.size:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by the {world.size} processes")
    rows = cfg.batch_size // world.size
    micro = cfg.micro_batch_size or rows
    if rows % micro:
        raise ValueError(f"micro_batch_size ({micro}) must divide the {rows} rows per process")
    sampler = WindowSampler(shards=data.train, seq_len=seq_len, batch_size=cfg.batch_size, seed=cfg.seed)
    val_sampler = WindowSampler(
        shards=data.validation, seq_len=seq_len, batch_size=cfg.batch_size, seed=cfg.seed + 1
    )

    # Model and optimizer (float32 parameters; autocast does the low precision).
    torch.manual_seed(cfg.seed)
    model = Decoder(cfg.model).to(world.device)
    n_params = param_count(model)
    if cfg.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in model.blocks:
            checkpoint(block)
    if cfg.compile:
        for block in model.blocks:
            block.compile()
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
    state = {"step": 0, "tokens": 0, "elapsed_s": 0.0}
    if resuming:
        state = load_checkpoint(latest_checkpoint(run_dir), wrapped, optimizer)
    start = state["step"]
    log = MetricsLog(run_dir, enabled=world.main, resume_step=start if resuming else None)
    if resuming and world.main:
        log.write({"kind": "resume", "step": start, "time": datetime.now().isoformat(timespec="seconds")})

    dtype = {
        "auto": torch.bfloat16 if world.device.type == "cuda" else torch.float32,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
    }[cfg.precision]

    def autocast():
        return _autocast(world.device, dtype)

    flops = flops_per_token(cfg.model, seq_len)
    peak = peak_tflops(world.device, cfg.peak_tflops)
    tokens_per_step = cfg.batch_size * seq_len
    stop = _StopFlag()
    status = "finished"
    last_saved = start if resuming else -1
    bar = tqdm(
        total=cfg.steps, initial=start, disable=not show, desc="training", unit="step", dynamic_ncols=True
    )

    @torch.no_grad()
    def validation_loss() -> float:
        wrapped.eval()
        total = torch.zeros((), device=world.device)
        for i in range(cfg.val_batches):
            x, y = val_sampler.batch(i, world.rank, world.size)
            for xm, ym in zip(x.split(micro), y.split(micro), strict=True):
                with autocast():
                    _, loss = wrapped(xm.to(world.device), ym.to(world.device))
                total += loss.float()
        wrapped.train()
        return all_reduce_mean(total / (cfg.val_batches * (rows // micro)), world).item()

    def checkpoint_now(step: int) -> None:
        nonlocal last_saved
        save_checkpoint(run_dir, wrapped, optimizer, {**state, "step": step}, world)
        last_saved = step

    # Throughput is timed log point to log point (the loss read-back syncs the device), with
    # validation and checkpoints left out; a stop between log points flushes the interval.
    interval = {"loss": torch.zeros((), device=world.device), "steps": 0, "t0": time.perf_counter()}
    session_start = state["elapsed_s"]
    last = {"lr": 0.0, "grad_norm": torch.zeros(())}

    def flush(step: int) -> None:
        if interval["steps"] == 0:
            return
        loss_value = all_reduce_mean(interval["loss"] / interval["steps"], world).item()  # syncs
        grad_norm = last["grad_norm"]
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
            grad_norm = grad_norm.full_tensor()
        seconds = time.perf_counter() - interval["t0"]
        state["elapsed_s"] += seconds
        tok_s = interval["steps"] * tokens_per_step / seconds
        mfu = tok_s * flops / (world.size * peak * 1e12) if peak else None
        log.write(
            {
                "kind": "train",
                "step": step,
                "tokens": state["tokens"],
                "loss": loss_value,
                "lr": last["lr"],
                "grad_norm": float(grad_norm),
                "tokens_per_s": tok_s,
                "mfu": mfu,
                "elapsed_s": state["elapsed_s"],
            }
        )
        bar.set_postfix(
            loss=f"{loss_value:.3f}",
            tok_s=f"{tok_s:,.0f}",
            **({"mfu": f"{100 * mfu:.1f}%"} if mfu is not None else {}),
        )
        interval["loss"].zero_()
        interval["steps"] = 0
        interval["t0"] = time.perf_counter()

    def untimed(fn):
        """Run ``fn`` (validation, a checkpoint) outside the throughput clock."""
        paused = time.perf_counter()
        result = fn()
        interval["t0"] += time.perf_counter() - paused
        return result

    # The handlers stay installed until the report is written: a SIGTERM during the final
    # checkpoint must not kill the process half way (the checkpoint is atomic regardless).
    with _signals(stop):
        step = start
        while step < cfg.steps:
            if any_rank(stop.reason is not None, world):
                status = "interrupted"
                break
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            collect = cfg.model.acp and cfg.acp_stats_every > 0 and (step + 1) % cfg.acp_stats_every == 0
            model.set_collect_stats(collect)

            x, y = sampler.batch(step, world.rank, world.size)  # [rows, T] each
            loss, grad_norm = train_step(wrapped, optimizer, x, y, micro, world.device, dtype, cfg.grad_clip)
            interval["loss"] += loss
            interval["steps"] += 1
            last["lr"], last["grad_norm"] = lr, grad_norm
            step += 1
            state["step"], state["tokens"] = step, state["tokens"] + tokens_per_step
            bar.update(1)

            if step % cfg.log_every == 0 or step == cfg.steps:
                flush(step)
            if collect:
                pruned = unwrap(model).pruned_fractions()  # [n_layers, H], last micro-batch
                pruned = all_reduce_mean(pruned.to(world.device), world).cpu()
                log.write(
                    {
                        "kind": "acp",
                        "step": step,
                        "tokens": state["tokens"],
                        "pruned": float(pruned.mean()),
                        "pruned_per_layer": pruned.mean(1).tolist(),
                        "pruned_per_head": pruned.tolist(),
                    }
                )
                model.set_collect_stats(False)
            if cfg.val_every and (step % cfg.val_every == 0 or step == cfg.steps):
                val = untimed(validation_loss)
                log.write({"kind": "val", "step": step, "tokens": state["tokens"], "loss": val})
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                flush(step)  # the checkpoint's elapsed time and the metrics end at the same step
                untimed(lambda step=step: checkpoint_now(step))
            if cfg.stop_at_step is not None and step >= cfg.stop_at_step and step < cfg.steps:
                status = "stopped"
                break
            session = state["elapsed_s"] - session_start + time.perf_counter() - interval["t0"]
            if cfg.time_limit_minutes is not None and any_rank(session > 60 * cfg.time_limit_minutes, world):
                status = "time limit"
                break
        flush(state["step"])
        bar.close()
        if last_saved != state["step"]:
            checkpoint_now(state["step"])
        log.close()
    summary = {
        "status": status,
        "step": state["step"],
        "steps": cfg.steps,
        "preset": cfg.preset_name,
        "arch": cfg.model.name,
        "acp": cfg.model.acp,
        "params": n_params,
        "corpus": cfg.corpus.kind
        if cfg.corpus.kind == "python"
        else f"{cfg.corpus.kind}: {cfg.corpus.paths}",
        "tokenizer": cfg.tokenizer,
        "vocab_size": data.tokenizer.vocab_size,
        "train_tokens": data.train.num_tokens,
        "batch_size": cfg.batch_size,
        "seq_len": seq_len,
        "world_size": world.size,
        "device": world.device.type,
        "tokens": state["tokens"],
        "elapsed_s": state["elapsed_s"],
        "tokens_per_s": state["tokens"] / state["elapsed_s"] if state["elapsed_s"] > 0 else 0.0,
        "run_dir": str(run_dir),
    }
    summary["mfu"] = summary["tokens_per_s"] * flops / (world.size * peak * 1e12) if peak else None
    if world.main:
        with _signals(stop):
            plot_losses(run_dir)
            write_report(run_dir, summary)
    return summary
