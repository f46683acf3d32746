"""``lapse eval dcp``: a gamma sweep of DCP fine-tunes, read as the DCP paper reads one.

SPEC section 6. The input is a set of runs fine-tuned from one dense
Transformer with ``lapse train --init-from BASE --model.attention dcp --dcp.gamma G``
(``scripts/study_dcp.sh`` makes them), and optionally that base. Every model runs in eval
mode, so DCP drops with the step mask of inference ``1[z > 0]``, over the same validation
windows:

- a table, per gamma: the loss (nats per token; per byte with the byte tokenizer), the
  perplexity ``exp(loss)``, its cost relative to the gamma = 0 run (the same fine-tuning
  without the push to drop), and the share of context dropped, overall and per layer.
  *Dropped* at position ``k`` is ``#{j < k: I[k, j] = 0} / k`` (the trainer's statistic,
  :func:`lapse.ops.dcp.dcp_sparsity`); the table gives its mean over positions
  ``k >= 1`` and its value at the last position (what a decode cache holds at the end of
  the window). The training's own last validation record is kept beside it;
- ``ppl_vs_dropped.png``: perplexity against the share dropped, one labelled point per
  gamma (the dense base as a line), and ``dropped_per_layer.png``;
- which tokens are dropped: for a few validation snippets, each chosen model's keep mask
  as of the snippet's last token, per layer (``drops_<run>.png``: layers x positions) and
  as coloured text (``drops.html``: a token's colour is the number of layers that dropped
  it; per-layer text under each snippet).

Outputs (``out_dir``): ``results.json`` (every number of the page), ``summary.md``,
the PNGs and ``drops.html``. The page names the commit and the command that made it.
"""

from __future__ import annotations

import html
import json
import math
import platform
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from lapse.data import TokenShards, cached_with, prepare_data
from lapse.eval.common import LoadedModel, eval_windows, load_model
from lapse.eval.config import DcpStudyConfig
from lapse.eval.loss import check_same_tokenizer
from lapse.files import save_figure, write_json_atomic, write_text_atomic
from lapse.layers import DCPAttention
from lapse.models.checkpoint import read_run
from lapse.ops.backend import resolve_device
from lapse.ops.dcp import LOG_FLOOR, dcp_sparsity

SNIPPET_TOKENS = 480  # the snippets' default length, where the window is longer


def _check_base(base: Path, runs: tuple[Path, ...]) -> None:
    """Warns of a DCP run that was not fine-tuned from ``base`` (its ``init_from``): the study
    would set it beside another model's reference row without a word."""
    def run_of(path: Path) -> Path:  # a checkpoint's run folder, or the folder itself
        path = path.resolve()
        return path.parent if path.name.startswith("checkpoint-") else path

    for run in runs:
        source = read_run(run).config.get("init_from")
        if source is not None and run_of(Path(source)) != run_of(base):
            warnings.warn(f"{run} was fine-tuned from {source}, not from --base {base}", stacklevel=3)


@dataclass
class _Eval:
    loss: float
    dropped_per_layer: list[float]  # mean over windows and positions k >= 1
    dropped_last_per_layer: list[float]  # at the last position of the window


def dcp_layers(model: torch.nn.Module) -> list[DCPAttention]:
    return [m for m in model.modules() if isinstance(m, DCPAttention)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int) -> _Eval:
    """Mean loss over ``windows`` ``[N, T + 1]`` and the share of context each DCP layer
    drops, the model in eval mode (the step mask)."""
    model.eval()
    device = next(model.parameters()).device
    layers = dcp_layers(model)
    for layer in layers:
        layer.keep_log_mask = True
    loss_sum = 0.0
    dropped = torch.zeros(len(layers), dtype=torch.float64)  # [L] summed over windows
    last = torch.zeros(len(layers), dtype=torch.float64)  # [L]
    try:
        for chunk in windows.split(batch_size):
            x, y = chunk[:, :-1].to(device), chunk[:, 1:].to(device)  # [b, T]
            _, loss = model(x, y)
            loss_sum += float(loss) * len(chunk)
            for i, layer in enumerate(layers):
                share = dcp_sparsity(layer.take_log_mask())  # [b, T]
                dropped[i] += share[:, 1:].mean(dim=1).sum().item()
                last[i] += share[:, -1].sum().item()
    finally:
        for layer in layers:
            layer.keep_log_mask = False
            layer.last_log_mask = None
    n = len(windows)
    return _Eval(loss_sum / n, (dropped / n).tolist(), (last / n).tolist())


@torch.no_grad()
def dropped_at_last(model: torch.nn.Module, ids: torch.Tensor) -> np.ndarray:
    """Which tokens of ``ids`` ``[T]`` each DCP layer has dropped as of the last token
    (its row of ``log I``): bool ``[L, T]``, the model in eval mode (the step mask)."""
    model.eval()
    device = next(model.parameters()).device
    layers = dcp_layers(model)
    for layer in layers:
        layer.keep_log_mask = True
    try:
        model(ids[None].to(device))
        rows = [layer.take_log_mask()[0, -1] <= LOG_FLOOR for layer in layers]  # [T] each
    finally:
        for layer in layers:
            layer.keep_log_mask = False
            layer.last_log_mask = None
    return torch.stack(rows).cpu().numpy()


def validation_snippets(loaded: LoadedModel, n: int, tokens: int, seed: int) -> list[np.ndarray]:
    """``n`` token snippets of length ``tokens`` from different documents of the run's
    validation split, each starting just after a newline (a line start), chosen by
    ``seed``; fewer when fewer documents are long enough."""
    run = loaded.train_config
    if run is None:
        raise ValueError(f"{loaded.path} is not a training run folder: no validation split to draw from")
    tokenizer, vocab_size = run.tokenizer, run.model.vocab_size
    saved = loaded.tokenizer_path
    if tokenizer == "bpe" and not cached_with(
        run.corpus, tokenizer, vocab_size=vocab_size, data_dir=run.data_dir, tokenizer_path=saved
    ):
        tokenizer = str(loaded.tokenizer_path)  # the run's own BPE, as eval_windows does
    data = prepare_data(run.corpus, tokenizer, vocab_size=vocab_size, data_dir=run.data_dir, progress=False)
    if data.validation is None:
        raise ValueError(f"the corpus of {loaded.name} has no validation split")
    return _snippets(data.validation, data.tokenizer, n, tokens, seed)


def _snippets(shards: TokenShards, tokenizer, n: int, tokens: int, seed: int) -> list[np.ndarray]:
    docs = [d for d in shards.documents() if len(d) >= 2 * tokens]
    if not docs or n == 0:
        return []
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(docs), size=min(n, len(docs)), replace=False)
    newline = set(tokenizer.encode("\n"))
    out = []
    for p in sorted(picks):
        doc = docs[p]
        start = int(rng.integers(0, len(doc) - 2 * tokens + 1))
        while start < len(doc) - tokens and int(doc[start]) not in newline:
            start += 1
        start = min(start + 1, len(doc) - tokens)
        out.append(np.asarray(doc[start:start + tokens], dtype=np.int64))
    return out


def git_commit() -> str:
    """``git rev-parse --short HEAD`` of this source tree (with ``-dirty`` when files
    changed), or ``"unknown"``."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "") if head else "unknown"


def _last(records: list[dict], kind: str) -> dict | None:
    return next((r for r in reversed(records) if r.get("kind") == kind), None)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line
    return records


def _run_dcp(loaded: LoadedModel) -> dict:
    """The DCP training settings the run's ``config.json`` holds (gamma, the alpha schedule);
    empty without one."""
    run = loaded.train_config
    return (run.config.get("dcp") or {}) if run is not None else {}


def _run_row(loaded: LoadedModel, result: _Eval) -> dict:
    """What the table says about one run: the evaluation and what its training logged."""
    run = loaded.train_config
    records = _read_jsonl(loaded.path / "metrics.jsonl")
    summary_path = loaded.path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    val, train = _last(records, "val"), _last(records, "train")
    dcp = _run_dcp(loaded)
    per_layer = result.dropped_per_layer
    return {
        "name": loaded.name,
        "path": str(loaded.path),
        "arch": loaded.config.name,
        "gamma": dcp.get("gamma"),
        "alpha": [dcp.get("alpha_start"), dcp.get("alpha_end")],
        "interaction_only": dcp.get("interaction_only"),
        "steps_done": summary.get("step", train["step"] if train else None),
        "steps_planned": summary.get("steps", run.config.get("steps") if run else None),
        "status": summary.get("status"),
        "tokens": summary.get("tokens"),
        "alpha_final": train.get("alpha") if train else None,
        "loss": result.loss,
        "ppl": math.exp(result.loss),
        "dropped": sum(per_layer) / len(per_layer) if per_layer else 0.0,
        "dropped_per_layer": per_layer,
        "dropped_last": (sum(result.dropped_last_per_layer) / len(per_layer)) if per_layer else 0.0,
        "dropped_last_per_layer": result.dropped_last_per_layer,
        "train_val": None if val is None else {
            k: val.get(k) for k in ("step", "loss", "sparsity", "sparsity_per_layer")
        },
    }


def run_dcp_study(cfg: DcpStudyConfig) -> dict:
    """Evaluates every run, draws the drops, writes the files into ``cfg.out_dir`` and
    returns the results (the content of ``results.json``). Raises ``ValueError``, before any
    evaluation, for a run without DCP attention, runs (or ``--base``) of another tokenizer or
    depth, two runs of one gamma, or ``--show`` gammas no run has."""
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    out_dir = cfg.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    first = load_model(cfg.runs[0], device=device)
    if first.train_config is None:  # the windows and snippets come from the run's own validation text
        raise ValueError(f"{cfg.runs[0]} is not a training run: lapse eval dcp draws from a run's own "
                         "validation text (evaluate the run a `lapse export` folder was written from)")
    t = first.context if cfg.seq_len is None else cfg.seq_len
    windows = eval_windows(first, t, cfg.num_sequences, seed=cfg.seed)  # [N, T + 1]
    snippet_tokens = cfg.snippet_tokens or min(SNIPPET_TOKENS, t)
    snippets = validation_snippets(first, cfg.snippets, snippet_tokens, cfg.seed) if cfg.snippets else []
    tokenizer = first.tokenizer
    del first

    # every check before the first evaluation: the runs are loaded (kept for the drawings), then
    # evaluated on the first run's windows, which mean the same text only under one tokenizer
    loaded_runs = [load_model(path, device=device) for path in cfg.runs]
    for loaded in loaded_runs:
        if not dcp_layers(loaded.model):
            raise ValueError(f"{loaded.path} is a {loaded.config.name} run, not DCP: fine-tune it with "
                             "--model.attention dcp (lapse train --init-from)")
        if loaded.config.n_layers != loaded_runs[0].config.n_layers:
            raise ValueError(f"{loaded.path} has {loaded.config.n_layers} layers and {cfg.runs[0]} "
                             f"{loaded_runs[0].config.n_layers}: the study compares runs of one model")
    base_model = None
    if cfg.base is not None:  # its loss is taken on the same windows: the same checks first
        _check_base(cfg.base, cfg.runs)
        base_model = load_model(cfg.base, device=device)
    check_same_tokenizer([*loaded_runs, *([base_model] if base_model is not None else [])])
    gammas = [_run_dcp(loaded).get("gamma") for loaded in loaded_runs]
    if len(set(gammas)) != len(gammas):
        raise ValueError(f"two runs share a gamma: {gammas}")
    _shown([{"gamma": g} for g in gammas], cfg.show)  # the gammas --show names are there

    rows, models = [], {}
    for loaded in loaded_runs:
        rows.append(_run_row(loaded, evaluate(loaded.model, windows, cfg.batch_size)))
        models[loaded.name] = loaded
        print(f"{loaded.name}: gamma {rows[-1]['gamma']}, loss {rows[-1]['loss']:.4f}, "
              f"dropped {rows[-1]['dropped']:.1%}", flush=True)
    order = sorted(range(len(rows)), key=lambda i: rows[i]["gamma"])
    rows = [rows[i] for i in order]
    zero = next((r for r in rows if r["gamma"] == 0), None)
    for r in rows:
        r["ppl_cost"] = None if zero is None else r["ppl"] / zero["ppl"] - 1.0

    base = None
    if base_model is not None:
        result = evaluate(base_model.model, windows, cfg.batch_size)
        base = {"name": base_model.name, "path": str(cfg.base), "arch": base_model.config.name,
                "loss": result.loss, "ppl": math.exp(result.loss)}
        del base_model

    shown = _shown(rows, cfg.show)
    drops = []
    for ids in snippets:
        entry = {"tokens": ids.tolist(), "text": tokenizer.decode(ids.tolist()), "models": {}}
        for r in shown:
            mask = dropped_at_last(models[r["name"]].model, torch.from_numpy(ids))  # [L, T]
            entry["models"][r["name"]] = {
                "gamma": r["gamma"],
                "dropped": mask.astype(int).tolist(),
                "dropped_share_per_layer": mask[:, :-1].mean(axis=1).tolist(),
            }
        drops.append(entry)

    on_gpu = device.type == "cuda"
    results = {
        "title": cfg.title,
        "commit": cfg.commit or git_commit(),
        "command": cfg.command,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": torch.cuda.get_device_name(device) if on_gpu else f"CPU {platform.machine()}",
        "torch": torch.__version__,
        "seq_len": t,
        "num_sequences": cfg.num_sequences,
        "seed": cfg.seed,
        "unit": "nats per byte" if rows and _is_byte(tokenizer) else "nats per token",
        "dropped_definition": "mean over positions k >= 1 of #{j < k: I[k, j] = 0} / k, step mask 1[z > 0]",
        "base": base,
        "runs": rows,
        "shown": [r["name"] for r in shown],
        "snippets": drops,
        "seconds": None,
    }
    # an earlier study in this folder: its drawings of runs this one does not draw would stay
    # beside the new summary as if they were part of it
    stale = [out_dir / "drops.html", *out_dir.glob("drops_*.png")]
    if any(p.exists() for p in stale):
        print(f"replacing the earlier study in {out_dir}", file=sys.stderr)
        for p in stale:
            p.unlink(missing_ok=True)
    _plot_ppl(results, out_dir / "ppl_vs_dropped.png")
    _plot_layers(results, out_dir / "dropped_per_layer.png")
    for r in shown:
        if drops:
            _plot_drops(results, r["name"], out_dir / f"drops_{r['name']}.png")
    if drops:
        write_text_atomic(out_dir / "drops.html", _drops_html(results, tokenizer))
    results["seconds"] = time.perf_counter() - t0
    write_json_atomic(out_dir / "results.json", results)
    write_text_atomic(out_dir / "summary.md", _summary_md(results))
    return {**results, "out_dir": str(out_dir)}


def _is_byte(tokenizer) -> bool:
    return getattr(tokenizer, "vocab_size", None) == 258 and type(tokenizer).__name__ == "ByteTokenizer"


def _shown(rows: list[dict], show: tuple[float, ...] | None) -> list[dict]:
    """The runs whose drops are drawn: those of ``show``, else the largest gamma and the
    one in the middle of the rest (gamma = 0 only when nothing else is there)."""
    if show is not None:
        picked = [r for r in rows if any(math.isclose(r["gamma"], g, abs_tol=1e-12) for g in show)]
        if len(picked) != len(set(show)):
            raise ValueError(f"show names gammas {list(show)}; the runs have {[r['gamma'] for r in rows]}")
        return picked
    pruning = [r for r in rows if r["gamma"] > 0] or rows
    top = pruning[-1]
    rest = pruning[:-1]
    return ([rest[len(rest) // 2]] if rest else []) + [top]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _gamma_label(g: float) -> str:
    return f"γ={g:g}"


def _plot_ppl(results: dict, path: Path) -> None:
    plt = _plt()
    rows = results["runs"]
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    xs = [100 * r["dropped"] for r in rows]
    ys = [r["ppl"] for r in rows]
    ax.plot(xs, ys, "o-", color="tab:blue", label="DCP, step mask (eval mode)")
    # labels on alternate sides, so that close points stay legible
    for i, (x, y, r) in enumerate(zip(xs, ys, rows, strict=True)):
        ax.annotate(_gamma_label(r["gamma"]), (x, y), textcoords="offset points",
                    xytext=(6, 6) if i % 2 == 0 else (-8, -14), ha="left" if i % 2 == 0 else "right")
    if results["base"] is not None:
        base = results["base"]
        ax.axhline(base["ppl"], color="grey", ls="--", label=f"dense base ({base['name']})")
    ax.set_xlabel("context dropped (% of earlier tokens, mean over positions)")
    ax.set_ylabel(f"perplexity (exp of {results['unit']})")
    ax.set_xlim(left=min(0, *xs) - 2, right=max(100, *xs) + 2)
    ax.set_title(f"Perplexity vs context dropped, T = {results['seq_len']}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def _plot_layers(results: dict, path: Path) -> None:
    plt = _plt()
    rows = results["runs"]
    n_layers = len(rows[0]["dropped_per_layer"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        x = np.arange(n_layers) + (i - (len(rows) - 1) / 2) * width
        ax.bar(x, 100 * np.array(r["dropped_per_layer"]), width, label=_gamma_label(r["gamma"]))
    ax.set_xticks(np.arange(n_layers))
    ax.set_xlabel("layer")
    ax.set_ylabel("context dropped (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Context dropped per layer (step mask)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def _plot_drops(results: dict, name: str, path: Path) -> None:
    """Layers x positions per snippet: dark where the layer has dropped the token as of
    the snippet's last token."""
    plt = _plt()
    snippets = results["snippets"]
    n_layers = len(snippets[0]["models"][name]["dropped"])
    height = 1.2 + 0.45 * n_layers * len(snippets)
    fig, axes = plt.subplots(len(snippets), 1, figsize=(14, height), squeeze=False)
    for ax, (i, s) in zip(axes[:, 0], enumerate(snippets), strict=True):
        entry = s["models"][name]
        mask = np.array(entry["dropped"])  # [L, T]
        ax.imshow(mask, aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        ax.set_yticks(range(mask.shape[0]))
        ax.set_yticklabels([f"L{j} ({100 * d:.0f}%)" for j, d in enumerate(entry["dropped_share_per_layer"])],
                           fontsize=7)
        ax.set_xlabel("position in the snippet (token)", fontsize=8)
        ax.set_title(f"snippet {i}: tokens dropped as of the last token (black)", fontsize=9)
    fig.suptitle(f"{name} ({_gamma_label(snippets[0]['models'][name]['gamma'])}), step mask", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def _token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text for display (bytes of a split UTF-8 character show as U+FFFD)."""
    return [tokenizer.decode([i]) for i in ids]


def _drops_html(results: dict, tokenizer) -> str:
    parts = [
        "<!doctype html><meta charset='utf-8'><title>DCP: dropped tokens</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
        "pre{white-space:pre-wrap;font-size:12px;line-height:1.5;border:1px solid #ccc;padding:6px}"
        ".q{outline:2px solid #06c}.d{color:#aaa;text-decoration:line-through}</style>",
        "<h1>Which tokens DCP drops</h1>",
        "<p>Each snippet is run alone through the model in eval mode (the step mask "
        "1[z &gt; 0]). Shown: the keep mask as of the snippet's <span class='q'>last token</span>. "
        "Colour: the number of layers that have dropped the token (white: kept by every layer, "
        "dark red: dropped by all). Per-layer text below each snippet: dropped tokens grey and struck.</p>",
    ]
    for i, s in enumerate(results["snippets"]):
        texts = _token_texts(tokenizer, s["tokens"])
        parts.append(f"<h2>Snippet {i}</h2>")
        for name, entry in s["models"].items():
            mask = np.array(entry["dropped"], dtype=bool)  # [L, T]
            n_layers = mask.shape[0]
            count = mask.sum(axis=0)
            shares = ", ".join(f"L{j} {100 * d:.0f}%" for j, d in enumerate(entry["dropped_share_per_layer"]))
            heading = f"{html.escape(name)} ({_gamma_label(entry['gamma'])}): dropped {shares}"
            parts.append(f"<h3>{heading}</h3><pre>")
            for j, (piece, c) in enumerate(zip(texts, count, strict=True)):
                alpha = c / n_layers
                cls = " class='q'" if j == len(texts) - 1 else ""
                parts.append(f"<span{cls} style='background:rgba(200,0,0,{alpha:.2f})' "
                             f"title='dropped by {c}/{n_layers} layers'>{html.escape(piece)}</span>")
            parts.append("</pre><details><summary>per layer</summary>")
            for layer in range(n_layers):
                parts.append(f"<p>layer {layer}</p><pre>")
                parts.extend(f"<span class='d'>{html.escape(p)}</span>" if mask[layer, j] else html.escape(p)
                             for j, p in enumerate(texts))
                parts.append("</pre>")
            parts.append("</details>")
    return "".join(parts) + "\n"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _summary_md(r: dict) -> str:
    rows = r["runs"]
    unit = r["unit"]
    lines = [
        f"# {r['title']}",
        "",
        f"Commit `{r['commit']}`, {r['date']}, {r['device']}, torch {r['torch']}.",
        "",
    ]
    if r["command"]:
        lines += ["Command:", "", "```bash", r["command"], "```", ""]
    lines += [
        f"Every model in eval mode (DCP drops with the step mask `1[z > 0]`), on the same "
        f"{r['num_sequences']} validation windows of {r['seq_len']} tokens (seed {r['seed']}). "
        f"Loss in {unit}; perplexity = exp(loss); cost = perplexity / perplexity at gamma 0 - 1. "
        "Dropped: at position k, the share of the k earlier tokens whose `I[k, j]` is 0, its mean over "
        "positions k >= 1 (\"mean\") and at the window's last position (\"last\"). \"train val\": the "
        "training's last validation record (its own windows).",
        "",
        "| gamma | steps | final alpha | loss | ppl | cost vs gamma 0 | dropped (mean) | dropped (last) "
        "| dropped per layer (mean, %) | train val loss / dropped |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        steps = f"{x['steps_done']}/{x['steps_planned']}"
        alpha = "n/a" if x["alpha_final"] is None else f"{x['alpha_final']:.2f}"
        cost = "n/a" if x["ppl_cost"] is None else f"{100 * x['ppl_cost']:+.2f}%"
        layers = " / ".join(f"{100 * d:.0f}" for d in x["dropped_per_layer"])
        tv = x["train_val"]
        tval = "n/a" if tv is None else f"{tv['loss']:.4f} / {_pct(tv.get('sparsity'))}"
        lines.append(f"| {x['gamma']:g} | {steps} | {alpha} | {x['loss']:.4f} | {x['ppl']:.4f} | {cost} | "
                     f"{_pct(x['dropped'])} | {_pct(x['dropped_last'])} | {layers} | {tval} |")
    if r["base"] is not None:
        b = r["base"]
        lines.append(f"| dense base ({b['name']}) | | | {b['loss']:.4f} | {b['ppl']:.4f} | | 0% | 0% | | |")
    lines += ["", "![perplexity vs dropped](ppl_vs_dropped.png)", ""]
    lines += ["![dropped per layer](dropped_per_layer.png)", ""]
    if r["snippets"]:
        lines += [
            "## Which tokens are dropped",
            "",
            f"{len(r['snippets'])} validation snippets of {len(r['snippets'][0]['tokens'])} tokens, each run "
            "alone; "
            "the keep mask as of each snippet's last token, per layer (black: dropped). Coloured text "
            "(and per-layer text): [drops.html](drops.html).",
            "",
        ]
        for name in r["shown"]:
            lines += [f"![drops of {name}](drops_{name}.png)", ""]
    lines += [f"Numbers: `results.json`. Took {r['seconds']:.0f} s.", ""]
    return "\n".join(lines)
