"""Needle in a haystack (SPEC section 4): can the model find one sentence in a long context?

A prompt of exactly ``L`` tokens is a stretch of haystack text with a needle sentence
("The special magic number is 4821937.") inserted at depth ``d`` (a fraction of the
haystack, placed at the nearest line or sentence boundary), followed by a query that
ends where the answer begins ("... Answer: The special magic number is"). Two modes:

- ``standard``: the needle is the answer sentence alone;
- ``easy``: the needle also contains the question, so the query repeats text that is in
  the context word for word (what a base model without instruction tuning can do).

Every prompt is scored two ways:

- greedy exact match: ``len(answer ids)`` tokens decoded greedily with
  :func:`lapse.generation.generate` (prefill, then cached one-token steps) must equal the
  answer ids;
- answer log-likelihood: ``log p(answer | prompt)`` in nats, summed over the answer
  tokens, from one forward over prompt + answer (the uncached path, as in training).

Trial ``i`` draws its number and the haystack segment (line or sentence) it starts at from
``seed`` alone, so the same trial is used in every (length, depth) cell and for every
model; the haystack runs on from there and wraps around to its start if it is too short.

Outputs in ``out_dir``: ``results.json`` (every cell and trial), ``niah.png`` (heat maps
of context length x depth, one row per model, one column per score) and ``summary.md``
(the tables and the plot). :func:`run_niah` does it all; :func:`load_haystack`,
:func:`build_prompt` and :func:`evaluate_model` are the steps, for tests and notebooks.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lapse.data import Tokenizer, python_source_documents, text_documents
from lapse.eval.common import LoadedModel, check_out_dir
from lapse.eval.config import NiahConfig
from lapse.eval.lm import load_lm
from lapse.eval.policy import greedy_continuation, streamed_loss
from lapse.files import save_figure, write_text_atomic
from lapse.generation import Dense, Policy, generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A segment ends after a newline or after a sentence's final punctuation and its space:
# the needle is only ever inserted between two segments.
_BOUNDARY = re.compile(r"(?<=\n)|(?<=[.!?] )")


@dataclass(frozen=True)
class Trial:
    """What one trial draws from the seed: the needle's number and where the haystack starts."""

    index: int
    number: int
    start_segment: int


@dataclass
class Haystack:
    """Haystack text cut into segments (lines and sentences, each ending with its
    newline or with the space after its final punctuation), in reading order."""

    segments: list[str]
    source: str
    """Where the text came from, for the results."""
    _encoded: dict[int, tuple[Tokenizer, np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    def encoded(self, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, starts)``: every segment's ids concatenated (int64 ``[N]``) and the
        offset of each segment in them (``[num segments + 1]``, the last is ``N``).
        Segments are encoded one by one, so a segment boundary is a token boundary."""
        key = id(tokenizer)  # the entry keeps the tokenizer alive, so the id is not reused
        if key not in self._encoded:
            pieces = tokenizer.encode_batch(self.segments)
            lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
            ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64, count=int(lengths.sum()))
            if ids.size == 0:
                raise ValueError(f"the haystack ({self.source}) encodes to no tokens")
            starts = np.concatenate([[0], np.cumsum(lengths)])
            self._encoded[key] = (tokenizer, ids, starts)
        return self._encoded[key][1:]


@dataclass
class Prompt:
    """One prompt of exactly ``len(ids)`` tokens, and the answer it asks for."""

    ids: list[int]
    answer_ids: list[int]
    needle_start: int
    """Index in ``ids`` of the needle's first token."""
    needle_len: int
    haystack_tokens: int
    """Haystack tokens in the prompt (the needle and the query are the rest)."""
    trial: Trial

    @property
    def needle_depth(self) -> float:
        """Where the needle landed, as a fraction of the haystack (the requested depth
        moved to the nearest segment boundary)."""
        return self.needle_start / self.haystack_tokens if self.haystack_tokens else 0.0


def load_haystack(cfg: NiahConfig) -> Haystack:
    """The first ``cfg.haystack_chars`` characters (whole segments) of the haystack,
    documents joined in order, each ending with a newline."""
    if cfg.haystack is None:
        docs = python_source_documents(split="validation", val_fraction=0.01)
        source = "validation split of the local Python installation's source files"
    else:
        if not cfg.haystack.exists():
            raise ValueError(f"haystack path does not exist: {cfg.haystack}")
        docs = text_documents([str(cfg.haystack)], cfg.haystack_patterns)
        source = str(cfg.haystack)
    segments: list[str] = []
    chars = 0
    for _, text in docs:
        if not text.endswith("\n"):
            text += "\n"
        for segment in _BOUNDARY.split(text):
            if segment:
                segments.append(segment)
                chars += len(segment)
                if chars >= cfg.haystack_chars:
                    return Haystack(segments, source)
    if not segments:
        raise ValueError(f"the haystack is empty: {source}")
    return Haystack(segments, source)


def make_trials(cfg: NiahConfig, haystack: Haystack) -> list[Trial]:
    """``cfg.trials`` trials drawn from ``cfg.seed``: the same for every cell and model."""
    rng = np.random.default_rng(cfg.seed)
    low, high = 10 ** (cfg.number_digits - 1), 10**cfg.number_digits
    return [
        Trial(
            index=i,
            number=int(rng.integers(low, high)),
            start_segment=int(rng.integers(len(haystack.segments))),
        )
        for i in range(cfg.trials)
    ]


DEPTH_SLACK = 0.1  # a cell whose needles landed further than this from its depth is flagged


def build_prompt(
    cfg: NiahConfig, tokenizer: Tokenizer, haystack: Haystack, trial: Trial, length: int, depth: float
) -> Prompt:
    """The prompt of ``trial`` with ``length`` tokens and the needle at ``depth``.

    Layout (ids of each part encoded separately, so lengths add up exactly)::

        [haystack before | needle + "\\n" | haystack after (last segment cut to fit) | query]

    The haystack part has ``H = length - len(needle) - len(query)`` tokens starting at
    the trial's segment (wrapping around at the end of the haystack); the needle goes to
    the segment boundary nearest to ``depth * H`` (the earlier one on a tie).
    """
    ids, starts = haystack.encoded(tokenizer)
    needle_ids = tokenizer.encode(cfg.needle_text(trial.number) + "\n")
    query_ids = tokenizer.encode(cfg.query_text())
    answer_ids = tokenizer.encode(cfg.answer_text(trial.number))
    budget = length - len(needle_ids) - len(query_ids)
    if budget < 1:
        raise ValueError(
            f"context length {length} leaves no room for the haystack: the needle and the query take "
            f"{len(needle_ids) + len(query_ids)} tokens of this tokenizer"
        )
    total = ids.size
    first = int(starts[trial.start_segment])
    reps = math.ceil((first + budget) / total)
    cut = ids[np.arange(first, first + budget) % total]  # [H]
    # segment boundaries inside the cut (0 among them), over every repetition of the haystack
    bounds = (starts[None, :] + total * np.arange(reps)[:, None]).ravel() - first  # [reps * (S + 1)]
    bounds = np.unique(bounds[(bounds >= 0) & (bounds <= budget)])
    at = int(bounds[np.argmin(np.abs(bounds - depth * budget))])  # argmin: the earlier on a tie
    prompt = [*cut[:at].tolist(), *needle_ids, *cut[at:].tolist(), *query_ids]
    return Prompt(
        ids=prompt,
        answer_ids=answer_ids,
        needle_start=at,
        needle_len=len(needle_ids),
        haystack_tokens=budget,
        trial=trial,
    )


@torch.no_grad()
def score_prompts(
    model: torch.nn.Module,
    prompts: Sequence[Prompt],
    device: str | torch.device,
    policy: Policy | None = None,
) -> list[dict]:
    """Both scores of prompts of one length, in one batch.

    Greedy: :func:`lapse.generation.generate` continues every prompt by the longest
    answer's token count, and a row matches when its first ``len(answer)`` new tokens are
    the answer ids. Log-likelihood: one forward over prompt + answer (answers of unequal
    length are padded at the end, which no earlier position sees).

    Under ``policy`` (a lapse model or a Hugging Face one): the prompt less its last token
    is prefilled and cut by the policy, then the last prompt token and the answer are fed
    one at a time (:func:`lapse.eval.policy.streamed_loss`,
    :func:`~lapse.eval.policy.greedy_continuation`): every answer token is scored, and
    generated, from the cache as the policy leaves it.
    """
    length = len(prompts[0].ids)
    if any(len(p.ids) != length for p in prompts):
        raise ValueError("prompts of one batch must have the same length")
    n_new = max(len(p.answer_ids) for p in prompts)
    prompt_ids = torch.tensor([p.ids for p in prompts], dtype=torch.long, device=device)  # [B, L]
    answers = torch.zeros(len(prompts), n_new, dtype=torch.long, device=device)  # [B, A]
    valid = torch.zeros(len(prompts), n_new, dtype=torch.bool, device=device)  # [B, A]
    for row, p in enumerate(prompts):
        answers[row, : len(p.answer_ids)] = torch.tensor(p.answer_ids)
        valid[row, : len(p.answer_ids)] = True
    if policy is None:
        new = generate(model, prompt_ids, n_new)[:, length:]  # [B, A]
        logits, _ = model(torch.cat([prompt_ids, answers], dim=1))  # [B, L + A, V]
        logp = F.log_softmax(logits[:, length - 1 : length - 1 + n_new].float(), dim=-1)  # [B, A, V]
        token_logp = logp.gather(-1, answers[..., None])[..., 0]  # [B, A]
    else:
        new = greedy_continuation(model, prompt_ids, n_new, policy)  # [B, A]
        windows = torch.cat([prompt_ids, answers], dim=1)  # [B, L + A]
        token_logp = -streamed_loss(model, windows, policy, prefix=length - 1, compare=False).loss.to(device)
    exact = ((new == answers) | ~valid).all(dim=1)  # [B]
    token_logp = token_logp * valid  # [B, A]
    return [
        {
            "generated_ids": new[row, : len(p.answer_ids)].tolist(),
            "exact_match": bool(exact[row]),
            "answer_logprob": float(token_logp[row].sum()),
        }
        for row, p in enumerate(prompts)
    ]


def evaluate_model(
    loaded: LoadedModel,
    cfg: NiahConfig,
    haystack: Haystack,
    *,
    policy: Policy | None = None,
    deadline: float | None = None,
    bar=None,
) -> dict:
    """Every cell of the grid for one model; returns its part of ``results.json``.

    ``policy``: score under it (:func:`score_prompts`). ``deadline`` (a
    ``time.monotonic()`` value): no cell starts after it. ``bar``: a tqdm bar advanced
    once per cell.
    """
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ValueError(f"no tokenizer beside the model at {loaded.path}: the prompts cannot be encoded")
    trials = make_trials(cfg, haystack)
    query = len(tokenizer.encode(cfg.query_text()))
    overhead = max(len(tokenizer.encode(cfg.needle_text(t.number) + "\n")) + query for t in trials)
    if cfg.context_lengths[0] <= overhead:
        raise ValueError(
            f"context length {cfg.context_lengths[0]} leaves no room for the haystack: with the tokenizer of "
            f"{loaded.name}, the needle and the query take {overhead} tokens; use lengths above that"
        )
    model = loaded.model
    device = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
    train_config = loaded.train_config
    cells, started = [], time.perf_counter()
    for length in cfg.context_lengths:
        for depth in cfg.depths:
            if deadline is not None and time.monotonic() > deadline:
                break
            prompts = [build_prompt(cfg, tokenizer, haystack, t, length, depth) for t in trials]
            scores = []
            for i in range(0, len(prompts), cfg.batch_size):
                scores += score_prompts(model, prompts[i : i + cfg.batch_size], device, policy)
            details = [
                {
                    "trial": p.trial.index,
                    "number": p.trial.number,
                    "haystack_start_segment": p.trial.start_segment,
                    "needle_start": p.needle_start,
                    "needle_depth": round(p.needle_depth, 4),
                    "answer": tokenizer.decode(p.answer_ids),
                    "answer_tokens": len(p.answer_ids),
                    "generated": tokenizer.decode(s["generated_ids"]),
                    "exact_match": s["exact_match"],
                    "answer_logprob": s["answer_logprob"],
                }
                for p, s in zip(prompts, scores, strict=True)
            ]
            n_answer = sum(d["answer_tokens"] for d in details)
            landed = sum(p.needle_depth for p in prompts) / len(prompts)
            if abs(landed - depth) > DEPTH_SLACK:
                room = prompts[0].haystack_tokens
                warnings.warn(
                    f"at context length {length} the needle went to depth {landed:.2f} on average, not "
                    f"{depth:g}: the haystack's segments (lines, sentences) are long against its {room} "
                    "tokens there; take longer contexts or a haystack of shorter lines", stacklevel=2)
            cells.append(
                {
                    "context_length": length,
                    "depth": depth,
                    "needle_depth": round(landed, 4),
                    "exact_match": sum(d["exact_match"] for d in details) / len(details),
                    "answer_logprob": sum(d["answer_logprob"] for d in details) / len(details),
                    "answer_logprob_per_token": sum(d["answer_logprob"] for d in details) / n_answer,
                    "trials": details,
                }
            )
            if bar is not None:
                bar.set_postfix_str(f"{loaded.name} L={length} d={depth:g} EM={cells[-1]['exact_match']:.0%}")
                bar.update(1)
    return {
        "name": loaded.name,
        "path": str(loaded.path),
        "train_context": getattr(train_config, "context", None),
        "policy": None if policy is None else repr(policy),
        "cells": cells,
        "complete": len(cells) == len(cfg.context_lengths) * len(cfg.depths),
        "seconds": round(time.perf_counter() - started, 2),
    }


def run_niah(cfg: NiahConfig) -> dict:
    """Run the grid for every model and write ``results.json``, ``niah.png`` and
    ``summary.md`` into ``cfg.out_dir``; returns the results."""
    from tqdm.auto import tqdm

    for path in cfg.models:  # before the bar: a mistyped path is one line, not a bar and a line
        if not Path(path).exists():
            raise ValueError(f"model path does not exist: {path}")
    check_out_dir(cfg.out_dir, cfg.overwrite)
    haystack = load_haystack(cfg)
    deadline = None if cfg.time_limit_minutes is None else time.monotonic() + 60 * cfg.time_limit_minutes
    cells = len(cfg.context_lengths) * len(cfg.depths)
    example = make_trials(cfg, haystack)[0]
    results = {
        "evaluation": "niah",
        "config": _jsonable(asdict(cfg)),
        "haystack": {"source": haystack.source, "segments": len(haystack.segments)},
        "example": {
            "needle": cfg.needle_text(example.number),
            "query": cfg.query_text(),
            "answer": cfg.answer_text(example.number),
        },
        "models": [],
    }
    with tqdm(
        total=cells * len(cfg.models), desc="niah", disable=not cfg.progress, dynamic_ncols=True
    ) as bar:
        policy = cfg.make_policy()
        sources = [(path, None) for path in cfg.models] + ([(None, cfg.hf)] if cfg.hf is not None else [])
        for path, hf in sources:
            model = load_lm(path, hf, cfg.gguf_file, device=cfg.device, dtype=DTYPES[cfg.dtype])
            loaded = LoadedModel(model=model.lm, tokenizer=model.tokenizer, name=model.name, path=model.path,
                                 train_config=getattr(model.loaded, "train_config", None))
            if policy is None and hf is None:  # a lapse model's plain path
                loaded.model = model.loaded.model
            scored = policy if policy is not None or hf is None else Dense()
            results["models"].append(
                evaluate_model(loaded, cfg, haystack, policy=scored, deadline=deadline, bar=bar)
            )
            del loaded, model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next model gets the memory back
    write_outputs(results, cfg.out_dir)
    return results


def write_outputs(results: dict, out_dir: Path) -> None:
    """``results.json``, ``niah.png`` and ``summary.md`` in ``out_dir`` (each replaced atomically)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "results.json", json.dumps(results, indent=2) + "\n")
    plot_heatmaps(results, out_dir / "niah.png")
    write_text_atomic(out_dir / "summary.md", summary_markdown(results, "niah.png"))


def _grid(model: dict, lengths: Sequence[int], depths: Sequence[float], key: str) -> np.ndarray:
    """``[depths, lengths]`` of ``key`` per cell; NaN where a cell was not run."""
    grid = np.full((len(depths), len(lengths)), np.nan)
    for cell in model["cells"]:
        grid[depths.index(cell["depth"]), lengths.index(cell["context_length"])] = cell[key]
    return grid


def plot_heatmaps(results: dict, path: Path) -> Path:
    """Heat maps of context length (x) by needle depth (y, the start of the context at
    the top): one row per model, exact match and answer log-likelihood side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    cfg = results["config"]
    lengths, depths = list(cfg["context_lengths"]), list(cfg["depths"])
    models = results["models"]
    logp = [_grid(m, lengths, depths, "answer_logprob") for m in models]
    finite = np.concatenate([g[np.isfinite(g)] for g in logp]) if models else np.zeros(0)
    # A fixed scale, so that noise between equal cells does not span the colours: from 0
    # (certain) down to guessing the digits uniformly, or lower when a model is worse.
    lo, hi = min(-cfg["number_digits"] * math.log(10), float(finite.min()) if finite.size else 0.0), 0.0
    width = max(3.2, 0.75 * len(lengths) + 1.6)
    height = max(2.4, 0.42 * len(depths) + 1.2)
    fig, axes = plt.subplots(
        len(models), 2, figsize=(2 * width + 0.6, height * len(models) + 0.7), squeeze=False
    )
    percent = PercentFormatter(1.0)
    marked = False  # whether a training-context line was drawn
    for row, model in enumerate(models):
        exact = _grid(model, lengths, depths, "exact_match")
        panels = [
            (exact, "exact match", "RdYlGn", 0.0, 1.0, "{:.0%}", percent),
            (logp[row], "answer log-likelihood (nats)", "viridis", lo, hi, "{:.1f}", None),
        ]
        for col, (grid, title, cmap, vmin, vmax, fmt, ticks) in enumerate(panels):
            ax = axes[row, col]
            cmap = plt.get_cmap(cmap).with_extremes(bad="#dddddd")  # cells not run
            image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
            fontsize = 8 if len(lengths) <= 8 else 6
            for (i, j), value in np.ndenumerate(grid):
                if np.isfinite(value):
                    r, g, b, _ = cmap((value - vmin) / (vmax - vmin))
                    dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
                    color = "white" if dark else "black"
                    ax.text(j, i, fmt.format(value), ha="center", va="center", fontsize=fontsize, color=color)
            ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("needle depth")
            ax.set_title(f"{model['name']}: {title}", fontsize=10)
            train = model.get("train_context")
            if train is not None and lengths[0] <= train < lengths[-1]:
                # between the last length within the training context and the first beyond it
                x = sum(n <= train for n in lengths) - 0.5
                ax.axvline(x, color="black", ls="--", lw=1.2)
                marked = True
            fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02, format=ticks)
    fig.suptitle(
        f"needle in a haystack, {cfg['mode']} mode, {_trials(cfg['trials'])} per cell"
        + (" (dashed line: training context)" if marked else "")
        + ("; grey: not run (time limit)" if not all(m["complete"] for m in models) else ""),
        fontsize=11,
    )
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def summary_markdown(results: dict, image: str) -> str:
    """The Markdown page: the setup, the plot and, per model, both scores as tables."""
    cfg = results["config"]
    lengths, depths = list(cfg["context_lengths"]), list(cfg["depths"])
    ex = results["example"]
    digits = cfg["number_digits"]
    lines = [
        "# Needle in a haystack",
        "",
        f"{cfg['mode'].capitalize()} mode, {_trials(cfg['trials'])} per cell (seed {cfg['seed']}), haystack: "
        f"{results['haystack']['source']}. Each prompt has exactly the stated number of tokens; the needle "
        "sits at the segment boundary nearest to the depth, as a fraction of the haystack.",
        "",
        f"- needle: `{_inline(ex['needle'])}`",
        f"- query (ends the prompt): `{_inline(ex['query'])}`",
        f"- answer (scored): `{_inline(ex['answer'])}`",
        "",
        "Exact match: greedy decoding of the answer's tokens gives exactly its ids. Answer log-likelihood: "
        "log p(answer | prompt) in nats, summed over its tokens; a model that knows only that a "
        f"{digits}-digit number follows scores about {-digits * math.log(10):.1f}.",
        "",
        f"![needle in a haystack]({image})",
        "",
    ]
    header = "| depth \\ length | " + " | ".join(_tokens(n) for n in lengths) + " | mean |"
    rule = "|---" * (len(lengths) + 2) + "|"
    for model in results["models"]:
        lines += [f"## {model['name']}", ""]
        if model.get("policy"):
            lines += [f"Under the eviction policy `{model['policy']}`: the prompt less its last token "
                      "prefilled and cut, then the rest fed one token at a time.", ""]
        if not model["complete"]:
            lines += [f"Stopped by the time limit after {len(model['cells'])} cells; '-' was not run.", ""]
        for key, label, fmt in (
            ("exact_match", "Exact match", "{:.0%}"),
            ("answer_logprob", "Mean answer log-likelihood (nats)", "{:.2f}"),
        ):
            grid = _grid(model, lengths, depths, key)
            lines += [f"{label}:", "", header, rule]
            for i, depth in enumerate(depths):
                row = [fmt.format(v) if np.isfinite(v) else "-" for v in grid[i]]
                lines.append(f"| {depth:.0%} | " + " | ".join(row) + f" | {_mean(grid[i], fmt)} |")
            lines.append(
                "| mean | "
                + " | ".join(_mean(grid[:, j], fmt) for j in range(len(lengths)))
                + f" | {_mean(grid, fmt)} |"
            )
            lines.append("")
        off = [c for c in model["cells"] if abs(c.get("needle_depth", c["depth"]) - c["depth"]) > DEPTH_SLACK]
        if off:
            where = ", ".join(f"{_tokens(c['context_length'])} at {c['depth']:.0%}: {c['needle_depth']:.0%}"
                              for c in off)
            lines += ["The needle landed off its depth (the haystack's segment boundaries are far apart at "
                      f"these lengths): {where}.", ""]
        if model.get("train_context"):
            lines += [f"Trained at context {model['train_context']}.", ""]
    lines += ["Every trial (number, needle position, generated text, scores) is in `results.json`.", ""]
    return "\n".join(lines)


def _mean(values: np.ndarray, fmt: str) -> str:
    finite = values[np.isfinite(values)]
    return fmt.format(float(finite.mean())) if finite.size else "-"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _inline(text: str) -> str:
    return text.replace("\n", "\\n").replace("`", "'")


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _trials(n: int) -> str:
    return f"{n} trial" + ("" if n == 1 else "s")
