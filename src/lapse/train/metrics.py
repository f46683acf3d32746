"""What a run leaves to look at: JSONL metrics, a loss plot and a Markdown report.

``metrics.jsonl`` holds one JSON object per line with a ``kind``: ``train`` (step, tokens,
loss averaged over the logging interval and ``averaged_steps``, how many steps that is:
fewer than ``log_every`` right after a stop or a resume; lr, gradient norm, tokens/s, MFU of
the FLOPs done: with ACP, its pruned tiles left out at the last ``acp`` record's share, none
before one, and ``mfu_dense_equivalent`` beside it, attention counted dense causal), ``val``
(validation loss) and ``acp`` (pruned fraction per layer and head). A DCP model's ``train``
records add ``alpha``, ``sparsity`` and ``sparsity_per_layer`` (the share of earlier tokens
dropped, under the training mask) and ``sparsity_term`` (the unweighted penalty); its
``val`` records add the sparsity under the step mask of inference. Lines are appended and
flushed as they come; on resume the file is cut back to the checkpoint's step so the curve
continues without duplicates.
"""

from __future__ import annotations

import json
from pathlib import Path

from lapse.files import save_figure, write_text_atomic

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: Path) -> list[dict]:
    """Every complete line of ``metrics.jsonl`` (a torn last line is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsLog:
    """Appends records to ``run_dir/metrics.jsonl`` (rank 0 only)."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        if enabled and resume_step is not None:
            kept = [r for r in read_metrics(run_dir) if r.get("step", 0) <= resume_step]
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        # a new run starts a new file (a folder may hold the metrics of a run that died
        # before its first checkpoint); a resumed one appends to what was kept above
        mode = "a" if resume_step is not None else "w"
        self._file = self.path.open(mode) if enabled else None

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def plot_losses(run_dir: Path) -> Path | None:
    """``loss.png``: train and validation loss against tokens seen (and the ACP pruned
    fraction, or the DCP share of context dropped, when recorded). ``None`` when there is
    nothing to plot yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    acp = [r for r in records if r["kind"] == "acp"]
    if not train:
        return None
    dcp = [r for r in train if "sparsity" in r]
    panels = 1 + bool(acp) + bool(dcp)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax = axes[0, 0]
    ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], label="train", lw=1.2)
    if val:
        ax.plot([r["tokens"] for r in val], [r["loss"] for r in val], "o-", label="validation", ms=4)
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if acp:
        ax = axes[0, 1]
        ax.plot([r["tokens"] for r in acp], [r["pruned"] for r in acp], "o-", ms=3, label="all layers")
        layers = len(acp[-1]["pruned_per_layer"])
        for i in range(layers):
            ax.plot(
                [r["tokens"] for r in acp],
                [r["pruned_per_layer"][i] for r in acp],
                lw=0.8,
                alpha=0.7,
                label=f"layer {i}",
            )
        ax.set_xlabel("tokens")
        ax.set_ylabel("fraction of attention tiles pruned")
        ax.set_title("ACP pruning")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if dcp:
        _plot_sparsity(axes[0, panels - 1], dcp, [r for r in val if "sparsity" in r])
    fig.tight_layout()
    return save_figure(fig, Path(run_dir) / "loss.png", dpi=110)


def _plot_sparsity(ax, train: list[dict], val: list[dict]) -> None:
    """DCP: the share of context dropped per layer (training mask), the mean under the
    step mask of inference (validation), and alpha on a second axis."""
    tokens = [r["tokens"] for r in train]
    ax.plot(tokens, [r["sparsity"] for r in train], lw=1.5, color="k", label="all layers (train)")
    for i in range(len(train[-1]["sparsity_per_layer"])):
        ax.plot(tokens, [r["sparsity_per_layer"][i] for r in train], lw=0.8, alpha=0.7, label=f"layer {i}")
    if val:
        ax.plot([r["tokens"] for r in val], [r["sparsity"] for r in val], "s--", ms=4, color="C3",
                label="all layers (val, step mask)")
    ax.set_xlabel("tokens")
    ax.set_ylabel("share of earlier tokens dropped")
    ax.set_title("DCP sparsity")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    twin = ax.twinx()
    twin.plot(tokens, [r["alpha"] for r in train], ":", color="0.5", lw=1)
    twin.set_ylabel("alpha (dotted)")


_EXECUTION = {
    "eager": "run eagerly",
    "compiled": "compiled (kernels launched one by one)",
    "cuda-graphs": "compiled and replayed as CUDA graphs",
}


def _context_text(s: dict) -> str:
    """How each row was split across processes (context parallelism), or nothing."""
    cp = s.get("context_parallel")
    if not cp:
        return ""
    how = ("each attending over the whole row for 1/{n} of the heads" if cp["mode"] == "head"
           else "each gathering the row's keys and values").format(n=cp["cp"])
    return (f", each row split into {2 * cp['cp']} chunks over {cp['cp']} of them "
            f"(context parallelism, {cp['mode']} mode: {how})")


def _mfu_text(s: dict) -> str:
    """The MFU of a summary: of the FLOPs done; with ACP, at the mean of its measured pruned
    shares, beside the dense-equivalent one (attention counted dense causal)."""
    dense = s.get("mfu_dense_equivalent")
    if s.get("mfu") is None and dense is None:
        return " (MFU: peak unknown for this device)"
    if dense is None:
        return f", MFU {100 * s['mfu']:.1f}%"
    if s.get("mfu") is None:
        return f", MFU unknown (no ACP statistics taken), dense-equivalent {100 * dense:.1f}%"
    return (f", MFU {100 * s['mfu']:.1f}% (FLOPs done: ACP's pruned tiles left out at the mean measured "
            f"share, {100 * s['acp_pruned_mean']:.1f}%), dense-equivalent {100 * dense:.1f}%")


def write_report(run_dir: Path, summary: dict) -> Path:
    """``report.md`` (and ``summary.json``): what was trained, on what, how it went."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    acp = [r for r in records if r["kind"] == "acp"]
    s = summary
    lines = [
        f"# lapse training run: {run_dir.name}",
        "",
        f"- status: **{s['status']}** at step {s['step']} of {s['steps']}",
        f"- preset: `{s['preset']}`, model `{s['arch']}` with {s['params'] / 1e6:.2f}M parameters "
        f"(without the embedding), ACP {'on' if s['acp'] else 'off'}",
        f"- data: {s['corpus']}, tokenizer `{s['tokenizer']}` ({s['vocab_size']} ids); "
        f"{s['train_tokens']:,} training tokens available",
        f"- batch: {s['batch_size']} x {s['seq_len']} tokens per step on {s['world_size']} "
        f"{s['device']} process(es){_context_text(s)}; {s['tokens']:,} tokens seen"
        + (f"; blocks {_EXECUTION[s['compile']]}" if s.get("compile") in _EXECUTION else ""),
        f"- time: {s['elapsed_s'] / 60:.1f} min of training, {s['tokens_per_s']:,.0f} tokens/s"
        + _mfu_text(s),
    ]
    if train:
        first, last = train[0], train[-1]
        lines.append(
            f"- train loss: {first['loss']:.3f} at step {first['step']} -> {last['loss']:.3f} at step "
            f"{last['step']}"
        )
    if val:
        lines.append(
            f"- validation loss: {val[0]['loss']:.3f} at step {val[0]['step']} -> "
            f"{val[-1]['loss']:.3f} at step {val[-1]['step']}"
        )
    if acp:
        per_layer = ", ".join(f"{x:.2f}" for x in acp[-1]["pruned_per_layer"])
        lines.append(
            f"- ACP: {100 * acp[-1]['pruned']:.1f}% of attention tiles pruned at step "
            f"{acp[-1]['step']} (per layer: {per_layer})"
        )
    dcp = [r for r in train if "sparsity" in r]
    if dcp and s.get("dcp"):
        last = dcp[-1]
        per_layer = ", ".join(f"{x:.2f}" for x in last["sparsity_per_layer"])
        lines.append(
            f"- DCP: gamma {s['dcp']['gamma']}, alpha {last['alpha']:.2f} at step {last['step']} "
            f"(schedule {s['dcp']['alpha'][0]} -> {s['dcp']['alpha'][1]}); "
            f"{100 * last['sparsity']:.1f}% of the context dropped in training (exact zeros of the mask; "
            f"per layer: {per_layer})"
            + (f", mean kept weight of an earlier token {last['sparsity_term']:.3f} (the soft mask)"
               if "sparsity_term" in last else "")
        )
        val_dcp = [r for r in val if "sparsity" in r]
        if val_dcp:
            lines.append(
                f"- DCP at inference (step mask, validation): {100 * val_dcp[-1]['sparsity']:.1f}% dropped "
                f"at step {val_dcp[-1]['step']}"
            )
    if s.get("init_from"):
        lines.append(f"- fine-tuned from `{s['init_from']}`")
    lines += [
        "",
        "![loss](loss.png)",
        "",
        "Files: `metrics.jsonl` (one JSON record per line), "
        "`config.json` (the full configuration), `checkpoint.json` -> `checkpoint-*/` "
        "(`model.safetensors`, `trainer_state.pt`), `tokenizer/`.",
        "",
    ]
    if s["status"] != "finished":
        lines.append(f"Continue with `lapse resume {run_dir}`.")
        lines.append("")
    path = run_dir / "report.md"
    for name, text in (
        ("report.md", "\n".join(lines)),
        ("summary.json", json.dumps(s, indent=2, default=str)),
    ):
        write_text_atomic(run_dir / name, text)
    return path
