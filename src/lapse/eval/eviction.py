"""The eviction study: quality against budget for every policy, on one
model and one prompt set per call, with one report over every set run.

One call of :func:`run_eviction` loads the model once and, for each policy variant and
budget, measures on the same windows and needle prompts:

- the **streamed loss** (:func:`lapse.eval.policy.streamed_loss`): ``prompt_len`` tokens
  prefilled, the policy's cut, then ``steps`` tokens fed one at a time, each scored; beside
  it the dense model's loss, the **KL** of the next-token distributions from the dense
  model's and the **attention-mass recall** of the kept tokens;
- **NIAH** (:func:`lapse.eval.niah.evaluate_model`): needle prompts of ``prompt_len``
  tokens at ``niah_depths``, the prompt less its last token prefilled and cut by the
  policy, the answer generated and scored from the pruned cache (exact match, answer
  log-likelihood).

Budgets are shares of the prompt, turned into whole tokens (``round(budget * prompt_len)``)
so every policy keeps the same number of tokens per kv head: ``window`` keeps ``sinks``
first tokens and the rest as its window; H2O and A2SF split theirs half recent, half
heavy hitters (H2O's paper) and keep no explicit sinks. The variants:

- ``window``: :class:`~lapse.generation.SinkWindow` (StreamingLLM);
- ``h2o``: :class:`~lapse.generation.H2O` per kv head, evicting before every step (the
  evict-one form: re-selecting the top-k each step keeps the same tokens, see
  :class:`~lapse.generation.A2SF`);
- ``h2o-layer``: the same set of tokens for every head of a layer;
- ``h2o-topk``: top-k re-selection only every ``topk_every`` steps (the cache grows by
  that many tokens in between);
- ``a2sf``: :class:`~lapse.generation.A2SF` per head, evict-one, one variant per alpha;
- ``acp``: :class:`~lapse.generation.ACPBoundary` (FoX (Pro) models only) at each eps: no
  budget, its memory is what it measures.

Every variant evicts before every step (``every = 1``) except ``h2o-topk`` and ``acp``
(whose boundary only moves with the forget gates; every ``topk_every`` steps). Each run
writes ``<out_dir>/<set>/<variant>-b<budget>.json``; :func:`write_report` reads every
such file under ``out_dir`` and writes one plot per measure (one panel per prompt set, one
line per variant), ``summary.md`` with the tables, and ``verdict.json``: A2SF against H2O
per budget and set, a difference smaller than its spread across the prompt sets being a
tie.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lapse.eval.common import LoadedModel
from lapse.eval.config import EvictionStudyConfig, Family
from lapse.eval.lm import EvalLM, load_lm
from lapse.eval.niah import NiahConfig, evaluate_model, load_haystack
from lapse.eval.policy import check_fits, model_windows, nan_to_none, streamed_loss
from lapse.files import save_figure, write_text_atomic
from lapse.generation import A2SF, H2O, ACPBoundary, Dense, Policy, SinkWindow

MEASURES = {  # key in a run's JSON: (plot file, axis label)
    "delta_loss": ("loss.png", "streamed loss - dense loss (nats)"),
    "mean_kl": ("kl.png", "KL(dense || policy), nats per token"),
    "recall": ("recall.png", "attention-mass recall"),
    "niah_exact": ("niah.png", "NIAH exact match"),
    "niah_logprob": ("niah_logprob.png", "NIAH answer log-likelihood (nats)"),
}


@dataclass(frozen=True)
class Variant:
    """One policy at one budget: the label its line carries and the policy itself."""

    label: str
    family: Family
    budget: float | None
    """Share of the prompt; ``None`` for ACP (no budget)."""
    policy: Policy

    @property
    def file_name(self) -> str:
        return f"{self.label}-b{self.budget:g}.json" if self.budget is not None else f"{self.label}.json"


def variants(cfg: EvictionStudyConfig) -> list[Variant]:
    """Every (variant, budget) of the study, in the order they run (module doc)."""
    out = []
    for budget in cfg.budgets:
        tokens = max(2, round(budget * cfg.prompt_len))
        recent = tokens // 2
        for family in cfg.families:
            match family:
                case "window":
                    sinks = min(cfg.sinks, tokens - 1)
                    out.append(
                        Variant(
                            "window", family, budget, SinkWindow(sinks=sinks, window=tokens - sinks, every=1)
                        )
                    )
                case "h2o":
                    out.append(Variant("h2o", family, budget, H2O(budget=tokens, recent=recent, sinks=0)))
                case "h2o-layer":
                    out.append(
                        Variant(
                            "h2o-layer",
                            family,
                            budget,
                            H2O(budget=tokens, recent=recent, sinks=0, per="layer"),
                        )
                    )
                case "h2o-topk":
                    out.append(
                        Variant(
                            f"h2o-topk{cfg.topk_every}",
                            family,
                            budget,
                            H2O(budget=tokens, recent=recent, sinks=0, every=cfg.topk_every),
                        )
                    )
                case "a2sf":
                    out += [
                        Variant(
                            f"a2sf-{alpha:g}",
                            family,
                            budget,
                            A2SF(budget=tokens, recent=recent, sinks=0, alpha=alpha),
                        )
                        for alpha in cfg.alphas
                    ]
    if "acp" in cfg.families:
        out += [
            Variant(f"acp-eps{eps:.3g}", "acp", None, ACPBoundary(eps=eps, every=cfg.topk_every))
            for eps in cfg.eps
        ]
    return out


def run_eviction(cfg: EvictionStudyConfig) -> dict:
    """Runs every variant on one prompt set (module doc), writes a JSON per run under
    ``out_dir/<set>/``, then the report over every set in ``out_dir``; returns the report's
    verdict."""
    if cfg.report_only:
        return write_report(cfg.out_dir)
    if cfg.model is not None and not Path(cfg.model).exists():
        raise ValueError(f"model path does not exist: {cfg.model}")
    loaded = load_lm(cfg.model, cfg.hf, cfg.gguf_file, device=cfg.device)
    todo = variants(cfg)
    length = cfg.prompt_len + cfg.steps + 1
    for v in todo:  # every family before the first runs (one that does not fit failed half way)
        check_fits(loaded.lm, v.policy, cfg.prompt_len, length - 1)
    _check_same_study(cfg.out_dir, loaded.name, cfg.prompt_len, cfg.steps)
    windows = model_windows(
        loaded, length - 1, cfg.num_sequences, seed=cfg.seed, corpus=cfg.corpus, data_dir=None
    )  # [N, prompt_len + steps + 1]
    niah = _niah_setup(cfg, loaded)
    folder = cfg.out_dir / cfg.set_name
    folder.mkdir(parents=True, exist_ok=True)
    common = {
        "model": loaded.name,
        "set": cfg.set_name,
        "prompt_len": cfg.prompt_len,
        "steps": cfg.steps,
        "num_sequences": windows.shape[0],
        "command": cfg.command,
        "config": json.loads(json.dumps(asdict(cfg), default=str)),
    }
    if niah is not None:
        started = time.perf_counter()
        dense = evaluate_model(niah[0], niah[1], niah[2], policy=Dense())
        write_text_atomic(
            folder / "dense-niah.json",
            json.dumps(
                {
                    **common,
                    "label": "dense",
                    "niah": _niah_scores(dense),
                    "seconds": time.perf_counter() - started,
                },
                indent=1,
            ),
        )
    for v in todo:
        started = time.perf_counter()
        r = streamed_loss(loaded.lm, windows, v.policy, prefix=cfg.prompt_len)
        loss, dense_loss = r.loss.double().mean(1), r.dense_loss.double().mean(1)  # [N]
        result = {
            **common,
            "label": v.label,
            "family": v.family,
            "budget": v.budget,
            "budget_tokens": getattr(v.policy, "budget", None),
            "policy_repr": repr(v.policy),
            "mean_loss": float(loss.mean()),
            "dense_loss": float(dense_loss.mean()),
            "delta_loss": float((loss - dense_loss).mean()),
            "ppl": math.exp(float(loss.mean())),
            "dense_ppl": math.exp(float(dense_loss.mean())),
            "mean_kl": float(r.kl.double().mean()),
            "recall": nan_to_none(r.recall.double().mean()),
            "token_share": float(r.token_share.mean()),
            "kv_share": float(r.kv_share.mean()),
            "greedy_match": float(r.greedy.double().mean()),
            "per_window": {
                "loss": loss.tolist(),
                "dense_loss": dense_loss.tolist(),
                "kl": r.kl.double().mean(1).tolist(),
                "recall": [nan_to_none(x) for x in r.recall.double().mean((1, 2))],
            },
            "recall_per_layer": [nan_to_none(x) for x in r.recall.double().mean((0, 2))],
        }
        if niah is not None:
            result["niah"] = _niah_scores(evaluate_model(niah[0], niah[1], niah[2], policy=v.policy))
            result["niah_exact"] = result["niah"]["exact_match"]
            result["niah_logprob"] = result["niah"]["answer_logprob"]
        result["seconds"] = round(time.perf_counter() - started, 2)
        write_text_atomic(folder / v.file_name, json.dumps(result, indent=1))
        print(
            f"{cfg.set_name} {v.file_name}: delta {result['delta_loss']:+.4f} kl {result['mean_kl']:.4f} "
            f"recall {'n/a' if result['recall'] is None else format(result['recall'], '.4f')} "
            f"niah {result.get('niah_exact', float('nan')):.2f} "
            f"({result['seconds']:.0f} s)",
            flush=True,
        )
    return write_report(cfg.out_dir)


def _check_same_study(out_dir: Path, model: str, prompt_len: int, steps: int) -> None:
    """The runs already in ``out_dir`` are of the same model, prompt and steps: the report
    puts every set side by side under the first run's model (a second study written into the
    same folder showed its numbers under the first one's name)."""
    for r in load_runs(out_dir):
        if (r["model"], r["prompt_len"], r["steps"]) != (model, prompt_len, steps):
            raise ValueError(
                f"{out_dir} holds a study of {r['model']} (prompt {r['prompt_len']}, steps {r['steps']}), "
                f"not of {model} (prompt {prompt_len}, steps {steps}): give another --out-dir"
            )


def _niah_setup(cfg: EvictionStudyConfig, loaded: EvalLM):
    """``(model, config, haystack)`` for :func:`~lapse.eval.niah.evaluate_model`, or
    ``None`` without depths."""
    if not cfg.niah_depths or cfg.niah_trials < 1:
        return None
    source = {"hf": cfg.hf, "gguf_file": cfg.gguf_file} if cfg.hf is not None else {"models": (cfg.model,)}
    niah_cfg = NiahConfig(
        **source,
        context_lengths=(cfg.prompt_len,),
        depths=tuple(cfg.niah_depths),
        trials=cfg.niah_trials,
        mode=cfg.niah_mode,
        haystack=cfg.haystack,
        seed=cfg.seed,
        batch_size=len(cfg.niah_depths) * cfg.niah_trials,
        out_dir=cfg.out_dir,
        progress=False,
    )
    model = LoadedModel(model=loaded.lm, tokenizer=loaded.tokenizer, name=loaded.name, path=loaded.path)
    return model, niah_cfg, load_haystack(niah_cfg)


def _niah_scores(result: dict) -> dict:
    """Exact match and answer log-likelihood over every NIAH prompt, and each prompt's."""
    trials = [t for cell in result["cells"] for t in cell["trials"]]
    return {
        "exact_match": float(np.mean([t["exact_match"] for t in trials])),
        "answer_logprob": float(np.mean([t["answer_logprob"] for t in trials])),
        "prompts": [
            {k: t[k] for k in ("needle_depth", "answer", "generated", "exact_match", "answer_logprob")}
            for t in trials
        ],
    }


# -- the report over every prompt set ----------------------------------------------------


def load_runs(out_dir: Path) -> list[dict]:
    """Every policy run's JSON under ``out_dir/<set>/`` (the dense NIAH files aside)."""
    runs = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("*/*.json"))]
    return [r for r in runs if r.get("label") != "dense"]


def write_report(out_dir: Path) -> dict:
    """One plot per measure, ``summary.md`` and ``verdict.json`` from the runs in ``out_dir``."""
    out_dir = Path(out_dir)
    runs = load_runs(out_dir)
    if not runs:
        raise ValueError(f"no study runs (<set>/<variant>.json) under {out_dir}")
    sets = sorted({r["set"] for r in runs})
    for key, (name, label) in MEASURES.items():
        if any(r.get(key) is not None for r in runs):
            _plot(runs, sets, key, label, out_dir / name)
    verdict = a2sf_vs_h2o(runs, sets)
    write_text_atomic(out_dir / "verdict.json", json.dumps(verdict, indent=1))
    write_text_atomic(out_dir / "summary.md", _summary(runs, sets, verdict, out_dir))
    return verdict


def _table(runs: list[dict], key: str, sets: Sequence[str]) -> dict[str, dict[float, list]]:
    """``{label: {budget: [value per set]}}`` (``None`` where a set lacks the run)."""
    out: dict[str, dict[float, list]] = {}
    for r in runs:
        if key in r and r["budget"] is not None:
            row = out.setdefault(r["label"], {}).setdefault(r["budget"], [None] * len(sets))
            row[sets.index(r["set"])] = r[key]
    return out


def a2sf_vs_h2o(runs: list[dict], sets: Sequence[str]) -> dict:
    """For each A2SF alpha, measure and budget: the difference from H2O (per head, evict-one)
    in each set, its mean, its spread (max - min over sets) and a call: ``a2sf`` or ``h2o``
    when every set agrees on the sign and ``|mean|`` exceeds the spread, else ``tie``.
    Better means lower loss and KL, higher recall and NIAH scores."""
    higher_better = {
        "delta_loss": False,
        "mean_kl": False,
        "recall": True,
        "niah_exact": True,
        "niah_logprob": True,
    }
    out = []
    for key, higher in higher_better.items():
        table = _table(runs, key, sets)
        for label in sorted(k for k in table if k.startswith("a2sf-")):
            for budget, values in sorted(table[label].items()):
                base = table.get("h2o", {}).get(budget)
                if base is None or None in values or None in base:
                    continue
                diff = np.asarray(values) - np.asarray(base)  # [sets]
                mean, spread = float(diff.mean()), float(diff.max() - diff.min())
                agree = bool((diff > 0).all() or (diff < 0).all())
                call = "tie"
                if len(sets) < 2:  # no spread to weigh the difference against
                    call = "one set"
                elif agree and abs(mean) > spread:
                    call = "a2sf" if (mean > 0) == higher else "h2o"
                out.append(
                    {
                        "measure": key,
                        "variant": label,
                        "budget": budget,
                        "per_set": diff.tolist(),
                        "mean": mean,
                        "spread": spread,
                        "call": call,
                    }
                )
    counts = {c: sum(o["call"] == c for o in out) for c in ("a2sf", "h2o", "tie", "one set")}
    return {"sets": list(sets), "comparisons": out, "counts": counts}


def _plot(runs: list[dict], sets: Sequence[str], key: str, label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 4.2), squeeze=False, sharey=True)
    labels = sorted({r["label"] for r in runs if key in r}, key=_label_order)
    colors = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels)}
    for ax, name in zip(axes[0], sets, strict=True):
        for lab in labels:
            pts = sorted(
                (r["budget"] if r["budget"] is not None else r["token_share"], r[key])
                for r in runs
                if r["set"] == name and r["label"] == lab and r.get(key) is not None
            )
            if not pts:
                continue
            x, y = zip(*pts, strict=True)
            acp = lab.startswith("acp")
            ax.plot(
                x,
                y,
                marker="*" if acp else "o",
                ms=10 if acp else 4,
                lw=0 if acp else 1.4,
                ls="--" if lab.startswith("h2o") else "-",
                color=colors[lab],
                label=lab,
            )
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks([0.05, 0.1, 0.2, 0.5], ["5%", "10%", "20%", "50%"])
        ax.set_xlabel("budget (share of the prompt; ACP: tokens held)")
        ax.set_title(f"{runs[0]['model']}, {name}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(label)
    axes[0, -1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def _label_order(label: str) -> tuple:
    order = ("window", "h2o", "h2o-layer", "h2o-topk", "a2sf", "acp")
    family = next((f for f in reversed(order) if label.startswith(f)), label)
    return (order.index(family) if family in order else len(order), label)


def _summary(runs: list[dict], sets: Sequence[str], verdict: dict, out_dir: Path) -> str:
    budgets = sorted({r["budget"] for r in runs if r["budget"] is not None})
    first = runs[0]
    lines = [
        "# Eviction study: quality against budget",
        "",
        f"Model `{first['model']}`; prompt sets: {', '.join(f'`{s}`' for s in sets)}; a prompt of "
        f"{first['prompt_len']} tokens, then {first['steps']} tokens scored one per step "
        f"({first['num_sequences']} windows per set). Cells: one value per set, in that order.",
        "",
    ]
    dense = {r["set"]: r["dense_loss"] for r in runs}
    lines += ["Dense loss per set: " + ", ".join(f"{s} {dense[s]:.4f}" for s in sets if s in dense), ""]
    dense_niah = {
        p.parent.name: json.loads(p.read_text())["niah"] for p in sorted(out_dir.glob("*/dense-niah.json"))
    }
    if dense_niah:
        lines += [
            "Dense NIAH per set (exact match, answer log-likelihood): "
            + ", ".join(
                f"{s} {v['exact_match']:.0%}, {v['answer_logprob']:.2f}" for s, v in dense_niah.items()
            ),
            "",
        ]
    for key, fmt in (
        ("delta_loss", "{:+.3f}"),
        ("ppl", "{:.2f}"),
        ("mean_kl", "{:.3f}"),
        ("recall", "{:.3f}"),
        ("niah_exact", "{:.0%}"),
        ("niah_logprob", "{:.2f}"),
        ("token_share", "{:.3f}"),
    ):
        table = _table(runs, key, sets)
        if not table:
            continue
        lines += [
            f"## {key}",
            "",
            "| variant | " + " | ".join(f"{b:.0%}" for b in budgets) + " |",
            "|---" * (len(budgets) + 1) + "|",
        ]
        for label in sorted(table, key=_label_order):
            cells = [
                " / ".join(
                    "-" if v is None else fmt.format(v) for v in table[label].get(b, [None] * len(sets))
                )
                for b in budgets
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    acp = [r for r in runs if r["budget"] is None]
    if acp:
        lines += [
            "## ACP (no budget)",
            "",
            "| set | variant | delta loss | KL | recall | tokens held |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['set']} | {r['label']} | {r['delta_loss']:+.4f} | {r['mean_kl']:.4f} | "
            f"{'-' if r['recall'] is None else format(r['recall'], '.4f')} "
            f"| {r['token_share']:.3f} |"
            for r in acp
        ]
        lines.append("")
    c = verdict["counts"]
    call = (
        f"A2SF better in {c['a2sf']}, H2O better in {c['h2o']}, ties in {c['tie']} (a tie: the sets "
        "disagree on the sign, or the mean difference is below its spread across the sets)."
        if len(sets) > 1 else
        "no call: one prompt set has no spread to weigh a difference against (run the study on "
        "another set, --set-name, into the same --out-dir)."
    )
    lines += [
        "## A2SF against H2O (per head, evict-one)",
        "",
        f"Of {sum(c.values())} comparisons (alpha x budget x measure): {call}",
        "",
        "| measure | variant | budget | difference per set | mean | spread | call |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {o['measure']} | {o['variant']} | {o['budget']:.0%} | "
        + " / ".join(f"{d:+.4f}" for d in o["per_set"])
        + f" | {o['mean']:+.4f} | {o['spread']:.4f} | {o['call']} |"
        for o in verdict["comparisons"]
    ]
    lines += ["", *[f"![{k}]({n})" for k, (n, _) in MEASURES.items() if (out_dir / n).exists()], ""]
    return "\n".join(lines)
