"""Training throughput of one model with ACP on and off, and of DCP fine-tuning against the
softmax Transformer it wraps, in one process (``lapse bench train``).

Every variant loads the same weights (a trained run's checkpoint, so the gates have
decayed the way training made them, or a fresh init), feeds the same windows, and runs
whole optimizer steps (forward, backward, clipping, AdamW) as the trainer takes them
(:func:`optimizer_step`; the benchmark does not import the trainer). Variants alternate in
rounds so drift of the GPU clock hits all alike. Each row reports the median step time;
tokens/s; the speed-ups "vs dense" and "vs transformer", its tokens/s over those of the
``dense`` and the ``transformer`` variant of the same compile mode (above 1: faster; none
where that variant did not run); TFLOP/s and MFU of the FLOPs done
(:func:`lapse.models.flops_per_token` of the variant's model, ACP's pruned tiles left out
as measured per layer and head, so MFU stays below 100%) beside the dense-equivalent
TFLOP/s (every causal pair counted: what a run without pruning would need for the same
tokens/s); the pruned fraction and the peak memory.

``dcp`` times DCP fine-tuning steps (SPEC section 6) as ``lapse train --init-from RUN
--model.attention dcp`` takes them: the softmax Transformer of the same sizes with DCP
attention on it, its softmax weights those of the ``transformer`` variant (or of the run's
checkpoint, when that holds a softmax model) and its interaction parameters at their
init, the alpha-sigmoid mask at a fixed ``dcp_alpha`` (the schedule's middle: the
bisection's full cost, not the closed forms of alpha = 1 or 2), and the sparsity penalty
``dcp_gamma * mean over layers of mean I`` in the loss. Its row reads against the
``transformer`` row of the same compile mode ("vs transformer": tokens/s ratio).

With ``--cp N`` (under ``torchrun --nproc-per-node N``) every variant trains one row across
``N`` processes: lapse's context parallelism (:class:`lapse.layers.ContextParallel`, each
process two mirrored chunks of every row, ``--cp-mode``), FSDP2 over the processes as
``lapse train --cp`` shards (the benchmark does not import the trainer). Every process draws
the same rows and takes its chunks; a step's time is the slowest process's, tokens/s counts
the rows' tokens, TFLOP/s those of all processes (MFU against ``N`` devices' peak), peak
memory the largest process's. With more processes than ``N`` (a multiple of it), the
batch's rows are shared among ``processes / N`` data-parallel groups; ``--cp 1`` under
torchrun is FSDP2 data parallelism alone. ``transformer-torchcp`` is the baseline: the ``transformer``
variant's model with positions and loss under lapse's split but its attention left to
torch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``:
its ring attention in place of SDPA, the rows sharded by torch); every row reads against it
("vs torch CP": tokens/s ratio within a compile mode).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import MODES, TrainBenchConfig


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(cfg: TrainBenchConfig) -> dict:
    from lapse.data import WindowSampler, prepare_data
    from lapse.models import Decoder, flops_per_token, optimizer_groups, prepare_blocks, preset
    from lapse.models.checkpoint import dcp_parameter_names, latest_checkpoint, load_weights, read_run
    from lapse.models.mfu import peak_tflops
    from lapse.ops.backend import resolve_device
    from lapse.ops.forgetting import set_value_checks

    # CPU runs (a tiny preset) check the wiring only; timings that matter come from CUDA.
    device = resolve_device("auto")
    cuda = device.type == "cuda"
    torch_cp = [v for v in cfg.variants if _torch_cp(v)]
    if torch_cp and not cuda:
        raise ValueError(f"{torch_cp[0]}: torch's context parallelism needs CUDA SDPA (its ring attention "
                         "replaces the flash, memory-efficient and cuDNN kernels only); no CUDA GPU is "
                         "visible")
    ctx, mesh, world = None, None, int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.cp > 1 or world > 1:
        device, mesh, ctx = _join(cfg, device, world)
    spread = mesh is not None  # several processes: FSDP2 over all of them
    data_rank, data_size = (mesh["data"].get_local_rank(), mesh["data"].size()) if spread else (0, 1)
    if cfg.batch_size % (data_size * cfg.micro_batch_size):
        raise ValueError(f"batch_size {cfg.batch_size} does not split into {data_size} data-parallel "
                         f"groups of whole micro-batches of {cfg.micro_batch_size}")
    main = not spread or dist.get_rank() == 0  # prints and writes the results
    if not cuda and main:
        warnings.warn("no CUDA GPU is visible: timing on the CPU, which checks the wiring only "
                      "(minutes a step beyond the tiny preset: --preset tiny)", stacklevel=2)
    set_value_checks(False)
    if cfg.run is not None:
        saved = read_run(cfg.run)
        model_cfg = saved.model
        folder = latest_checkpoint(cfg.run)
        if spread and not main:  # rank 0 tokenises the corpus first, if it must
            dist.barrier()
        data = prepare_data(
            saved.corpus, saved.tokenizer, vocab_size=model_cfg.vocab_size, data_dir=saved.data_dir,
            progress=False,
        )
        if spread and main:
            dist.barrier()
        sampler = WindowSampler(
            shards=data.validation, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=7
        )
        source = f"checkpoint {folder} (step {json.loads((cfg.run / 'checkpoint.json').read_text())['step']})"
    else:
        model_cfg = preset(cfg.preset, cfg.arch)
        folder, sampler = None, None
        source = f"fresh {cfg.preset} init"
    model_cfg = replace(
        model_cfg,
        max_seq_len=cfg.seq_len,
        attn_backend="auto",
        **({"acp_eps": cfg.acp_eps} if cfg.acp_eps is not None else {}),
    )

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rows of this process's data-parallel group (every group its own share
        of the same batch); under context parallelism padded at their ends to
        ``ctx.padded_length`` (inputs 0, labels -100: out of the loss, and causal attention
        never reads the padding)."""
        if sampler is not None:
            x, y = sampler.batch(step)
        else:
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, model_cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
            x, y = ids[:, :-1], ids[:, 1:]
        rows = cfg.batch_size // data_size
        x, y = x[data_rank * rows : (data_rank + 1) * rows], y[data_rank * rows : (data_rank + 1) * rows]
        if ctx is None:
            return x, y
        pad = ctx.padded_length(cfg.seq_len) - cfg.seq_len
        return F.pad(x, (0, pad), value=0), F.pad(y, (0, pad), value=-100)

    peak = peak_tflops(device, cfg.peak_tflops)
    tokens = cfg.batch_size * cfg.seq_len
    softmax_cfg = replace(model_cfg, attention="softmax", acp=False, castle_window=None)
    states = {}
    for name in cfg.variants:
        torch.manual_seed(0)
        regularizer = None
        if name.startswith("transformer"):
            model = Decoder(softmax_cfg).to(device)
        elif name.startswith("dcp"):
            model = Decoder(replace(softmax_cfg, attention="dcp", dcp_r=cfg.dcp_r)).to(device)
            if folder is not None and model_cfg.attention == "softmax":
                load_weights(folder, model, init_dcp=True)
            else:  # the transformer variant's weights (the same seed), the interaction ones at init
                torch.manual_seed(0)
                missing, unexpected = model.load_state_dict(Decoder(softmax_cfg).state_dict(), strict=False)
                if unexpected or set(missing) != set(dcp_parameter_names(model)):
                    raise RuntimeError(f"DCP vs softmax weights: missing {missing}, unexpected {unexpected}")
            regularizer = dcp_penalty(model, cfg.dcp_alpha, cfg.dcp_gamma)
        else:
            if model_cfg.attention != "forgetting":
                raise ValueError(f"the {name} variant needs a FoX model (arch fox-*), got {model_cfg.name}")
            model = Decoder(replace(model_cfg, acp=name.startswith("acp"))).to(device)
            if folder is not None:
                load_weights(folder, model)
        if ctx is not None:  # before compiling: the blocks trace its collectives
            model.set_context(ctx, attention=not _torch_cp(name))
        prepare_blocks(model, activation_checkpointing=cfg.activation_checkpointing,
                       compile=MODES[_mode(name)])
        if spread:
            _shard(model)
        opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=cfg.lr, betas=(0.9, 0.95), fused=cuda)
        states[name] = {"model": model, "opt": opt, "regularizer": regularizer, "times": [], "fastest": [],
                        "losses": [], "checked": False}

    def step(name: str, i: int, timed: bool) -> None:
        s = states[name]
        x, y = batch(i)
        if cuda:
            torch.cuda.synchronize()
        if spread:  # every process starts the step together
            dist.barrier()
        t0 = time.perf_counter()
        if _torch_cp(name):
            loss = _torch_cp_step(mesh["context"], ctx, s, x, y, cfg.micro_batch_size, check=not s["checked"])
            s["checked"] = True
        else:
            if ctx is not None:
                x, y = ctx.split(x), ctx.split(y)
            loss = optimizer_step(s["model"], s["opt"], x, y, cfg.micro_batch_size, s["regularizer"])
        loss = loss.item()  # syncs
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        fastest = elapsed
        if spread:  # the slowest process's time; the rows' mean loss (each holds cp x its share)
            fastest = _all_reduce(elapsed, device, dist.ReduceOp.MIN)
            elapsed = _all_reduce(elapsed, device, dist.ReduceOp.MAX)
            loss = _all_reduce(loss, device, dist.ReduceOp.SUM) / world
        if timed:
            s["times"].append(elapsed)
            s["fastest"].append(fastest)
            s["losses"].append(loss)

    # Warm-up and timing run on separate models, but memory is held by all of them: keep
    # the variants few. Peak memory is measured per variant on its own steps.
    for name in cfg.variants:
        for i in range(cfg.warmup):
            step(name, i, timed=False)
    for i in range(cfg.steps):
        for name in cfg.variants:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            step(name, cfg.warmup + i, timed=True)
            states[name].setdefault("peak_gib", 0.0)
            if cuda:
                states[name]["peak_gib"] = max(
                    states[name]["peak_gib"], torch.cuda.max_memory_allocated() / 2**30
                )

    if cfg.profile:
        profiles = {name: _profiled(lambda name=name: step(name, cfg.warmup + cfg.steps, timed=False), cuda)
                    for name in cfg.variants}
        if main:
            cfg.out_dir.mkdir(parents=True, exist_ok=True)
            for name, (_, prof) in profiles.items():
                prof.export_chrome_trace(str(cfg.out_dir / f"trace-{name}.json.gz"))
            (cfg.out_dir / "profile.md").write_text(_profile_markdown(profiles, cuda) + "\n")

    rows = []
    for name, s in states.items():
        model = s["model"]
        if spread:
            s["peak_gib"] = _all_reduce(s["peak_gib"], device, dist.ReduceOp.MAX)
        pruned = None
        if name.startswith("acp"):
            model.set_collect_stats(True)
            x, _ = batch(0)
            x = x if ctx is None else ctx.split(x)  # the statistics are of whole rows
            # Eager: statistics take the eager op anyway, and this one-off forward then
            # records no graphs of its own (set_stance: torch 2.6 and later).
            stance = getattr(torch.compiler, "set_stance", None)
            with (
                torch.no_grad(),
                torch.autocast(device.type, dtype=torch.bfloat16),
                stance("force_eager") if stance is not None else contextlib.nullcontext(),
            ):
                model(x[: cfg.micro_batch_size].to(device))
            pruned = model.pruned_fractions()  # [n_layers, H], the same in every process
            model.set_collect_stats(False)
        elif name.startswith("dcp"):
            pruned = s["regularizer"].dropped[:, None] / max(s["regularizer"].forwards, 1)  # [n_layers, 1]
        t = statistics.median(s["times"])
        tok_s = tokens / t  # the rows' tokens, all processes together
        # Each variant's own model (the Transformer has no gates); ACP's pruned tiles left
        # out of the FLOPs done (DCP's mask skips no computation)
        dense_flops = flops_per_token(model.config, cfg.seq_len)
        skipped = float(pruned.mean()) if name.startswith("acp") else 0.0
        flops = flops_per_token(model.config, cfg.seq_len, pruned=skipped)
        rows.append(
            {
                "variant": name,
                "step_s": t,
                "fastest_process_step_s": statistics.median(s["fastest"]),  # step_s when one process
                "tokens_per_s": tok_s,
                "flops_per_token": flops,
                "dense_flops_per_token": dense_flops,
                "tflops": tok_s * flops / 1e12,
                "dense_equivalent_tflops": tok_s * dense_flops / 1e12,
                "mfu": tok_s * flops / (peak * 1e12 * world) if peak else None,  # of all devices
                "peak_gib": s["peak_gib"],
                "loss": statistics.mean(s["losses"]),
                "pruned": None if pruned is None else float(pruned.mean()),
                "pruned_per_layer": None if pruned is None else pruned.mean(1).tolist(),
            }
        )
    _add_speedups(rows)

    device_name = torch.cuda.get_device_name(device) if cuda else f"cpu {platform.processor()}".strip()
    result = {
        "bench": "train",
        "device": device_name if world == 1 else f"{world} x {device_name}",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "commit": cfg.commit or _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "source": source,
        "model": asdict(model_cfg),
        "config": json.loads(json.dumps(asdict(cfg), default=str)),
        "peak_tflops": peak,
        "context_parallel": None if ctx is None else {
            "cp": cfg.cp, "mode": cfg.cp_mode, "padded_seq_len": ctx.padded_length(cfg.seq_len),
            "torch_rotate_method": _torch_rotate_method() if torch_cp else None,
        },
        "rows": rows,
    }
    split = "" if ctx is None else f", context parallel over {cfg.cp} processes, mode {cfg.cp_mode}"
    if data_size > 1:
        split += f", {data_size} data-parallel groups of {cfg.batch_size // data_size} rows"
    refs = ("dense", "transformer") if ctx is None else ("dense", "transformer", "torchcp")
    lines = [
        f"Training throughput, {model_cfg.name} {cfg.preset if cfg.run is None else cfg.run.name}, "
        f"T={cfg.seq_len}, {cfg.batch_size} rows/step ({cfg.micro_batch_size} per forward), bf16 autocast, "
        f"{result['device']}{split}; weights: {source}; median of {cfg.steps} steps",
        "",
        "vs dense, vs transformer: tokens/s over that of the `dense` / `transformer` variant of the same "
        "compile mode (above 1: faster; -: not run). TFLOP/s and MFU count the FLOPs done: 6 N + attention "
        "over the causal pairs, ACP's pruned tiles left out"
        + (f", against {peak:g} TFLOP/s" if peak else ", MFU: peak unknown for this device")
        + (f" a device ({world} devices: TFLOP/s of all of them)" if spread and peak else "")
        + ". Dense-eq. TFLOP/s counts every causal pair (the rate a run without pruning would need for "
        "these tokens/s). pruned: ACP's pruned share of the attention tiles, DCP's dropped share of the "
        "context.",
        "",
        "| variant | step s | tokens/s | vs dense | vs transformer | "
        + ("vs torch CP | " if ctx is not None else "")
        + "TFLOP/s | MFU | dense-eq. TFLOP/s | pruned | peak GiB | loss |",
        "|---" * (9 + len(refs)) + "|",
    ]
    if ctx is not None:
        lines[2:2] = [
            f"Each row split over {cfg.cp} processes (chunks r and {2 * cfg.cp - 1} - r of "
            f"{2 * cfg.cp}, padded to {ctx.padded_length(cfg.seq_len)} tokens), FSDP2 over them; step s: the "
            "slowest process's; peak GiB: the largest process's. vs torch CP: tokens/s over that of "
            "`transformer-torchcp` of the same compile mode (the `transformer` model with torch's "
            "`context_parallel`, its ring attention in place of SDPA).",
            "",
        ]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        pruned = f"{100 * r['pruned']:.1f}%" if r["pruned"] is not None else "-"
        ratios = " | ".join(
            f"{r[f'speedup_vs_{k}']:.2f}x" if r[f"speedup_vs_{k}"] is not None else "-" for k in refs
        )
        lines.append(
            f"| {r['variant']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {ratios} | "
            f"{_tflops(r['tflops'])} | {mfu} | {_tflops(r['dense_equivalent_tflops'])} | "
            f"{pruned} | {r['peak_gib']:.1f} | {r['loss']:.3f} |"
        )
    text = "\n".join(lines)
    if main:
        print(text)
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        (cfg.out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (cfg.out_dir / "results.md").write_text(text + "\n")
    if spread:  # rank 0 has written: leave together (pytorch/pytorch#75097)
        dist.barrier()
        dist.destroy_process_group()
    return result


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    micro: int,
    regularizer: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One optimizer step as the trainer takes it in one process: forward and backward per
    micro-batch of ``micro`` rows under bf16 autocast (``regularizer()``, called after each
    forward, added to its loss), gradients averaged, clipped to norm 1, AdamW. Returns the
    mean LM loss (a device tensor). A model sharded with FSDP2 reduce-scatters its
    gradients after the last micro-batch only (the trainer's ``gradient_sync``)."""
    device = next(model.parameters()).device
    graphs = getattr(model, "cuda_graphs", False)
    if graphs:
        from lapse.models import keep_grads

        keep_grads(model)
    sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2
    pieces = list(zip(x.split(micro), y.split(micro), strict=True))
    total = torch.zeros((), device=device)
    for i, (xm, ym) in enumerate(pieces):
        if sync is not None:
            sync(i == len(pieces) - 1)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(xm.to(device, non_blocking=True), ym.to(device, non_blocking=True),
                            return_logits=False)
            objective = loss if regularizer is None else loss + regularizer()
        (objective / len(pieces)).backward()
        total += loss.detach().float() / len(pieces)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=not graphs)
    return total


class dcp_penalty:
    """DCP's training objective term for ``model``'s DCP layers, as the trainer's
    ``DCPTraining`` computes it (which the benchmark may not import): the layers keep each
    forward's ``log I`` under the alpha-sigmoid at ``alpha``; calling the instance after a
    forward returns ``gamma * mean over layers of dcp_sparsity_loss`` and counts the share
    of context each layer dropped (``dropped`` ``[L]`` summed over ``forwards``)."""

    def __init__(self, model: torch.nn.Module, alpha: float, gamma: float):
        from lapse.layers import DCPAttention

        self.layers = [m for m in model.modules() if isinstance(m, DCPAttention)]
        for layer in self.layers:
            layer.alpha, layer.keep_log_mask = alpha, True
        self.gamma = gamma
        self.dropped = torch.zeros(len(self.layers), device=next(model.parameters()).device)
        self.forwards = 0

    def __call__(self) -> torch.Tensor:
        from lapse.layers.dcp import take_log_masks
        from lapse.ops.dcp import dcp_sparsity_loss

        masks, dropped = take_log_masks(self.layers)
        self.dropped += dropped
        self.forwards += 1
        return self.gamma * torch.stack([dcp_sparsity_loss(m) for m in masks]).mean()


def _profiled(run_step: Callable[[], None], cuda: bool):
    """``(wall seconds, profiler)`` of one ``run_step()`` under ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run_step()
        wall = time.perf_counter() - t0
    return wall, prof


def _profile_markdown(profiles: dict, cuda: bool, top: int = 25) -> str:
    """Per variant: the profiled step's wall time, the device's busy time (its kernels'
    sum; the rest of the wall time the device waited for the host or for another process)
    and the ``top`` ops by self time on the device (on the host without CUDA)."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    lines = ["One optimizer step per variant under torch.profiler, after the timed steps "
             f"({'the device' if cuda else 'the host'}'s self time per op).", ""]
    for name, (wall, prof) in profiles.items():
        events = prof.key_averages()
        busy = sum(getattr(e, key, 0.0) for e in events) / 1e6  # us -> s
        lines += [f"## {name}", "",
                  f"wall {1e3 * wall:.1f} ms, {'device busy' if cuda else 'host self time'} "
                  f"{1e3 * busy:.1f} ms ({100 * busy / wall:.0f}%)", "",
                  "| op | calls | self ms | share |", "| --- | ---: | ---: | ---: |"]
        for e in sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:top]:
            ms = getattr(e, key, 0.0) / 1e3
            share = 100 * ms / 1e3 / max(busy, 1e-12)
            lines.append(f"| `{e.key[:80]}` | {e.count} | {ms:.2f} | {share:.1f}% |")
        lines.append("")
    return "\n".join(lines)


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def _add_speedups(rows: list[dict]) -> None:
    """Gives each row ``speedup_vs_dense``, ``speedup_vs_transformer`` and
    ``speedup_vs_torchcp``: its tokens/s over those of the ``dense`` / ``transformer`` /
    ``transformer-torchcp`` variant of its compile mode (above 1: faster), named in
    ``dense_reference`` / ``transformer_reference`` / ``torchcp_reference``; ``None`` where
    that variant is not among ``rows``."""
    rates = {r["variant"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        for ref, variant in (("dense", "dense"), ("transformer", "transformer"),
                             ("torchcp", "transformer-torchcp")):
            of = f"{variant}{_mode(r['variant'])}"
            r[f"speedup_vs_{ref}"] = r["tokens_per_s"] / rates[of] if of in rates else None
            r[f"{ref}_reference"] = of if of in rates else None


def _tflops(x: float) -> str:
    """TFLOP/s with three significant digits (a CPU run's are small)."""
    return f"{x:.3g}"


def _mode(variant: str) -> str:
    """A variant's compile suffix: ``""``, ``"-compile"`` or ``"-cudagraphs"``."""
    return next((m for m in MODES if m and variant.endswith(m)), "")


def _torch_cp(variant: str) -> bool:
    """Whether ``variant`` runs under torch's context parallelism (``transformer-torchcp``)."""
    return variant.startswith("transformer-torchcp")


def _join(cfg: TrainBenchConfig, device: torch.device, world: int):
    """This process's device, a ``(data, context)`` DeviceMesh over the ``world`` processes
    torchrun started (``cfg.cp`` per row, the rest data-parallel groups), and its
    :class:`lapse.layers.ContextParallel` (``None`` when ``cfg.cp`` is 1); a one-line error
    outside torchrun or with a number of processes ``cfg.cp`` does not divide."""
    from torch.distributed.device_mesh import init_device_mesh

    from lapse.layers import ContextParallel

    if world % cfg.cp or "WORLD_SIZE" not in os.environ:
        found = "not under torchrun" if "WORLD_SIZE" not in os.environ else f"torchrun started {world}"
        raise ValueError(
            f"--cp {cfg.cp} needs a multiple of {cfg.cp} processes, each holding its share of every row "
            f"({found}): launch it as torchrun --standalone --nproc-per-node {cfg.cp} -m lapse.cli bench "
            f"train --cp {cfg.cp} ..."
        )
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # long: a process may compile while the others wait at a barrier
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=30),
                                device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (world // cfg.cp, cfg.cp), mesh_dim_names=("data", "context"))
    ctx = ContextParallel.of(mesh.get_group("context"), cfg.cp_mode) if cfg.cp > 1 else None
    return device, mesh, ctx


def _shard(model: torch.nn.Module) -> None:
    """FSDP2 over every process, as ``lapse train`` shards (``lapse.train.distributed.
    parallelize``, which the benchmark may not import): one unit per block, then the root
    (embedding, final norm, head), which the backward needs again at once. The parameters
    stay float32 (bf16 autocast does the low precision); gradients are averaged over the
    processes, each of which holds its share of the rows' mean loss."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model, reshard_after_forward=False)


def _torch_cp_step(mesh, ctx, s: dict, x: torch.Tensor, y: torch.Tensor, micro: int,
                   check: bool) -> torch.Tensor:
    """:func:`optimizer_step` of ``s["model"]`` (set up with ``set_context(ctx,
    attention=False)``) inside torch's ``context_parallel``, given the whole padded rows
    ``x, y`` ``[B, T]``; torch shards them in place on the device.

    torch (2.13, ``_context_parallel/_attention.py``: ``context_parallel`` makes
    ``_create_default_load_balancer``'s ``_HeadTailLoadBalancer`` of
    ``_context_parallel/_load_balancer.py`` when ``2N`` divides the length, else none)
    gives rank ``r`` chunks ``r`` and ``2N - 1 - r`` of ``2N``, in that order: the
    layout of ``ContextParallel.split``, so the model's global positions
    (``ContextParallel.positions``: RoPE) and the loss's share are those of torch's tokens.
    ``check``: compare torch's shard with ``ctx.split`` first (one step of each variant),
    so another torch that shards otherwise fails instead of training other positions."""
    from torch.distributed.tensor.experimental import context_parallel

    device = next(s["model"].parameters()).device
    xb, yb = (t.to(device, copy=True, memory_format=torch.contiguous_format) for t in (x, y))
    with context_parallel(mesh, buffers=[xb, yb], buffer_seq_dims=[1, 1], no_restore_buffers={xb, yb}):
        if check and not (torch.equal(xb.cpu(), ctx.split(x)) and torch.equal(yb.cpu(), ctx.split(y))):
            raise RuntimeError(
                "torch's context_parallel shards the rows otherwise than lapse.layers.ContextParallel.split "
                "(chunks r and 2N-1-r): the positions would disagree"
            )
        # forward and backward in the context: torch's SDPA patch serves both
        return optimizer_step(s["model"], s["opt"], xb, yb, micro, s["regularizer"])


def _all_reduce(value: float, device: torch.device, op) -> float:
    """``value`` reduced over every process by ``op``."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def _torch_rotate_method() -> str | None:
    """How torch's ring attention passes keys and values (its ``set_rotate_method``:
    all-gather by default, or all-to-all)."""
    try:
        from torch.distributed.tensor.experimental._attention import _cp_options

        return _cp_options.rotate_method.name.lower()
    except (ImportError, AttributeError):
        return None
