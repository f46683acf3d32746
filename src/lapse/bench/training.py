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
"""

from __future__ import annotations

import contextlib
import json
import platform
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, replace

import torch

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
    if not cuda:
        warnings.warn("no CUDA GPU is visible: timing on the CPU, which checks the wiring only "
                      "(minutes a step beyond the tiny preset: --preset tiny)", stacklevel=2)
    set_value_checks(False)
    if cfg.run is not None:
        saved = read_run(cfg.run)
        model_cfg = saved.model
        folder = latest_checkpoint(cfg.run)
        data = prepare_data(
            saved.corpus, saved.tokenizer, vocab_size=model_cfg.vocab_size, data_dir=saved.data_dir,
            progress=False,
        )
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
        if sampler is not None:
            return sampler.batch(step)
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, model_cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]

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
        prepare_blocks(model, activation_checkpointing=cfg.activation_checkpointing,
                       compile=MODES[_mode(name)])
        opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=cfg.lr, betas=(0.9, 0.95), fused=cuda)
        states[name] = {"model": model, "opt": opt, "regularizer": regularizer, "times": [], "losses": []}

    def step(name: str, i: int, timed: bool) -> None:
        s = states[name]
        x, y = batch(i)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = optimizer_step(s["model"], s["opt"], x, y, cfg.micro_batch_size, s["regularizer"])
        loss = loss.item()  # syncs
        if timed:
            s["times"].append(time.perf_counter() - t0)
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

    rows = []
    for name, s in states.items():
        model = s["model"]
        pruned = None
        if name.startswith("acp"):
            model.set_collect_stats(True)
            x, _ = batch(0)
            # Eager: statistics take the eager op anyway, and this one-off forward then
            # records no graphs of its own (set_stance: torch 2.6 and later).
            stance = getattr(torch.compiler, "set_stance", None)
            with (
                torch.no_grad(),
                torch.autocast(device.type, dtype=torch.bfloat16),
                stance("force_eager") if stance is not None else contextlib.nullcontext(),
            ):
                model(x[: cfg.micro_batch_size].to(device))
            pruned = model.pruned_fractions()  # [n_layers, H]
            model.set_collect_stats(False)
        elif name.startswith("dcp"):
            pruned = s["regularizer"].dropped[:, None] / max(s["regularizer"].forwards, 1)  # [n_layers, 1]
        t = statistics.median(s["times"])
        tok_s = tokens / t
        # Each variant's own model (the Transformer has no gates); ACP's pruned tiles left
        # out of the FLOPs done (DCP's mask skips no computation)
        dense_flops = flops_per_token(model.config, cfg.seq_len)
        skipped = float(pruned.mean()) if name.startswith("acp") else 0.0
        flops = flops_per_token(model.config, cfg.seq_len, pruned=skipped)
        rows.append(
            {
                "variant": name,
                "step_s": t,
                "tokens_per_s": tok_s,
                "flops_per_token": flops,
                "dense_flops_per_token": dense_flops,
                "tflops": tok_s * flops / 1e12,
                "dense_equivalent_tflops": tok_s * dense_flops / 1e12,
                "mfu": tok_s * flops / (peak * 1e12) if peak else None,
                "peak_gib": s["peak_gib"],
                "loss": statistics.mean(s["losses"]),
                "pruned": None if pruned is None else float(pruned.mean()),
                "pruned_per_layer": None if pruned is None else pruned.mean(1).tolist(),
            }
        )
    _add_speedups(rows)

    result = {
        "bench": "train",
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu {platform.processor()}".strip(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "commit": cfg.commit or _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "source": source,
        "model": asdict(model_cfg),
        "config": json.loads(json.dumps(asdict(cfg), default=str)),
        "peak_tflops": peak,
        "rows": rows,
    }
    lines = [
        f"Training throughput, {model_cfg.name} {cfg.preset if cfg.run is None else cfg.run.name}, "
        f"T={cfg.seq_len}, {cfg.batch_size} rows/step ({cfg.micro_batch_size} per forward), bf16 autocast, "
        f"{result['device']}; weights: {source}; median of {cfg.steps} steps",
        "",
        "vs dense, vs transformer: tokens/s over that of the `dense` / `transformer` variant of the same "
        "compile mode (above 1: faster; -: not run). TFLOP/s and MFU count the FLOPs done: 6 N + attention "
        "over the causal pairs, ACP's pruned tiles left out"
        + (f", against {peak:g} TFLOP/s" if peak else ", MFU: peak unknown for this device")
        + ". Dense-eq. TFLOP/s counts every causal pair (the rate a run without pruning would need for "
        "these tokens/s). pruned: ACP's pruned share of the attention tiles, DCP's dropped share of the "
        "context.",
        "",
        "| variant | step s | tokens/s | vs dense | vs transformer | TFLOP/s | MFU | dense-eq. TFLOP/s "
        "| pruned | peak GiB | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        pruned = f"{100 * r['pruned']:.1f}%" if r["pruned"] is not None else "-"
        vs_dense, vs_transformer = (
            f"{r[k]:.2f}x" if r[k] is not None else "-"
            for k in ("speedup_vs_dense", "speedup_vs_transformer")
        )
        lines.append(
            f"| {r['variant']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {vs_dense} | "
            f"{vs_transformer} | {_tflops(r['tflops'])} | {mfu} | {_tflops(r['dense_equivalent_tflops'])} | "
            f"{pruned} | {r['peak_gib']:.1f} | {r['loss']:.3f} |"
        )
    text = "\n".join(lines)
    print(text)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (cfg.out_dir / "results.md").write_text(text + "\n")
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
    mean LM loss (a device tensor)."""
    device = next(model.parameters()).device
    graphs = getattr(model, "cuda_graphs", False)
    if graphs:
        from lapse.models import keep_grads

        keep_grads(model)
    pieces = list(zip(x.split(micro), y.split(micro), strict=True))
    total = torch.zeros((), device=device)
    for xm, ym in pieces:
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


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def _add_speedups(rows: list[dict]) -> None:
    """Gives each row ``speedup_vs_dense`` and ``speedup_vs_transformer``: its tokens/s over
    those of the ``dense`` / ``transformer`` variant of its compile mode (above 1: faster),
    named in ``dense_reference`` / ``transformer_reference``; ``None`` where that variant
    is not among ``rows``."""
    rates = {r["variant"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        for ref in ("dense", "transformer"):
            of = f"{ref}{_mode(r['variant'])}"
            r[f"speedup_vs_{ref}"] = r["tokens_per_s"] / rates[of] if of in rates else None
            r[f"{ref}_reference"] = of if of in rates else None


def _tflops(x: float) -> str:
    """TFLOP/s with three significant digits (a CPU run's are small)."""
    return f"{x:.3g}"


def _mode(variant: str) -> str:
    """A variant's compile suffix: ``""``, ``"-compile"`` or ``"-cudagraphs"``."""
    return next((m for m in MODES if m and variant.endswith(m)), "")
