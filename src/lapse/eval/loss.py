"""Per-token loss ``L(i)`` and perplexity at several context lengths (SPEC section 4).

``L(i)`` is the mean cross-entropy of the prediction at position ``i`` (of token ``i + 1``
from tokens ``0..i``) over many validation windows. A model that uses long contexts shows
it as a negative slope of ``L(i)`` at large ``i``, so curves are compared, not only means.

- :func:`run_per_token_loss` (:class:`PerTokenLossConfig`): ``L(i)`` of several models on
  the same windows, smoothed by :func:`smooth`, overlaid on one plot.
- :func:`run_ppl` (:class:`PplConfig`): mean loss and perplexity at several context lengths,
  lengths beyond a model's training context marked as extrapolation, and ``L(i)`` at the
  longest length. Every length is read off the same windows of the longest length (their
  prefixes), in one pass.

Both stream: one batch of windows at a time goes through every model and is reduced at
once to per-position sums (float64 ``[T]`` per model), and :func:`per_position_loss` makes
the logits of ``logits_chunk`` positions at a time from the final hidden states, so no
``[N, T, V]`` (nor ``[B, T, V]``) tensor exists. Attention memory is that of the model's
own op: the chunked FoX path (O(T x chunk)) on CPU, Triton on CUDA, SDPA for Transformers.

All models see the same windows, cut by :func:`lapse.eval.common.eval_windows` from the
first model's validation data (or ``corpus``), so they must share a tokenizer; different
tokenizers are a ``ValueError``. Each evaluation writes ``results.json``, a PNG and
``summary.md`` into its output folder (default ``<first model>/eval/<evaluation>/``, and
``<evaluation>-<policy>`` under a policy).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from lapse.data import CorpusConfig
from lapse.data.tokenizer import tokenizer_info
from lapse.eval.common import (
    LoadedModel,
    check_out_dir,
    default_eval_dir,
    eval_name,
    eval_windows,
    load_model,
)
from lapse.eval.config import LossEvalConfig, PerTokenLossConfig, PplConfig
from lapse.eval.lm import as_causal_lm, load_lm, text_windows
from lapse.eval.policy import streamed_loss
from lapse.files import save_figure, write_text_atomic
from lapse.interrupt import StopFlag, stop_signals
from lapse.models import Decoder
from lapse.ops.backend import resolve_device

SMOOTHING_RULE = (
    "centred moving average; near the ends the window shrinks symmetrically to the positions "
    "available on both sides (2 * min(h, i, T - 1 - i) + 1 values, h = window // 2), so the first "
    "and last values are kept as they are and a straight line is unchanged"
)


@torch.no_grad()
def per_position_loss(model: Decoder, windows: Tensor, *, logits_chunk: int = 1024) -> Tensor:
    """Cross-entropy of every next-token prediction in ``windows``, without full logits.

    Args:
        model: a :class:`~lapse.models.Decoder`, or a Hugging Face causal LM (``--hf``), in
            ``eval()`` mode.
        windows: int64 ``[B, T + 1]`` token ids. Position ``i`` predicts ``windows[:, i + 1]``
            from ``windows[:, : i + 1]``.
        logits_chunk: positions whose logits are made at once; peak memory of the head is
            ``[B, logits_chunk, V]``.

    Returns:
        float32 ``[B, T]``: ``-log p(windows[:, i + 1] | windows[:, : i + 1])``, the same as
        ``F.cross_entropy(model(windows[:, :-1])[0], ..., reduction="none")`` up to rounding.
    """
    if not isinstance(windows, Tensor) or windows.dim() != 2 or windows.is_floating_point():
        raise ValueError(f"windows must be an integer tensor [batch, time + 1], got {windows!r:.80}")
    if windows.shape[1] < 2:
        raise ValueError(f"windows need at least 2 tokens (one prediction), got shape {tuple(windows.shape)}")
    if logits_chunk < 1:
        raise ValueError(f"logits_chunk must be positive, got {logits_chunk}")
    vocab = model.config.vocab_size
    if int(windows.max()) >= vocab or int(windows.min()) < 0:
        raise ValueError(
            f"token ids in [{int(windows.min())}, {int(windows.max())}] do not fit the model's "
            f"vocab_size {vocab}: were the windows made with another tokenizer?"
        )
    ids, labels = windows[:, :-1], windows[:, 1:]  # [B, T] each
    if isinstance(model, Decoder):
        hidden, head = model.hidden_states(ids), model.lm_head  # [B, T, C]
    else:
        hidden, head = model.get_decoder()(input_ids=ids).last_hidden_state, model.get_output_embeddings()
    losses = torch.empty(labels.shape, dtype=torch.float32, device=labels.device)  # [B, T]
    for s in range(0, labels.shape[1], logits_chunk):
        e = min(s + logits_chunk, labels.shape[1])
        logits = head(hidden[:, s:e]).float()  # [B, t, V]
        losses[:, s:e] = F.cross_entropy(logits.transpose(1, 2), labels[:, s:e], reduction="none")  # [B, t]
    return losses


def smooth(values, window: int = 101) -> np.ndarray:
    """Centred moving average of a 1-D curve, float64, the same length as ``values``.

    Value ``i`` is the mean of ``values[i - w : i + w + 1]`` with ``w = min(window // 2, i,
    T - 1 - i)``: near the ends the window shrinks *symmetrically* to what is available on
    both sides, so it stays centred on ``i``. Hence the first and last values are kept as
    they are, and a straight line is unchanged everywhere. A one-sided (truncated) window
    would instead pull the steep start of ``L(i)`` towards the later, lower losses.

    ``window`` must be odd; ``window=1`` returns the values unchanged.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"smooth takes a 1-D curve, got shape {x.shape}")
    if not isinstance(window, int) or window < 1 or window % 2 == 0:
        raise ValueError(f"window must be a positive odd integer, got {window!r}")
    t = len(x)
    i = np.arange(t)
    w = np.minimum(window // 2, np.minimum(i, t - 1 - i))  # [T] half-widths
    csum = np.concatenate([[0.0], np.cumsum(x)])  # [T + 1]
    return (csum[i + w + 1] - csum[i - w]) / (2 * w + 1)


def curve_summary(loss) -> dict:
    """The numbers of a summary table row for one ``L(i)`` curve (raw, not smoothed).

    ``mean_loss``; ``first_10pct`` / ``last_10pct``: the mean over the first / last
    ``max(1, T // 10)`` positions; ``slope_last_half``: the least-squares slope of ``L(i)``
    against ``i`` over ``i >= T // 2``, in loss per position (``None`` for ``T < 4``).
    """
    x = np.asarray(loss, dtype=np.float64)
    t = len(x)
    tenth = max(1, t // 10)
    slope = None
    if t >= 4:
        i = np.arange(t // 2, t, dtype=np.float64)
        y = x[t // 2 :]
        slope = float(np.sum((i - i.mean()) * (y - y.mean())) / np.sum((i - i.mean()) ** 2))
    return {
        "mean_loss": float(x.mean()),
        "first_10pct": float(x[:tenth].mean()),
        "last_10pct": float(x[-tenth:].mean()),
        "slope_last_half": slope,
    }


@dataclass
class _Curves:
    """Per-model results of one set of windows."""

    loss: list[np.ndarray]  # per model: float64 [T], L(i)
    prefix_losses: list[np.ndarray]  # per model: float64 [n, P], each window's mean loss over each prefix
    num_sequences: int
    stopped_early: str | None


def _evaluate(
    models: list[LoadedModel], windows: Tensor, cfg: LossEvalConfig, desc: str, prefixes: tuple[int, ...] = ()
) -> _Curves:
    """Every model on every window, batch by batch (all models per batch, so a time limit
    leaves them all with the same windows), reduced at once to per-position sums and to
    each window's mean loss over its first ``p`` positions for ``p`` in ``prefixes``
    (default: the whole window)."""
    device = next(models[0].model.parameters()).device
    n, t = windows.shape[0], windows.shape[1] - 1
    policy = cfg.make_policy()
    prefix = cfg.prefix if cfg.prefix is not None else max(1, min(prefixes or (t,)) // 4)
    if policy is not None and not prefix <= t - 1:
        raise ValueError(f"--prefix ({prefix}) must leave positions to stream in windows of {t} tokens")
    lms = [None if policy is None else as_causal_lm(m.model) for m in models]
    ends = torch.tensor(prefixes or (t,))  # [P]
    sums = [torch.zeros(t, dtype=torch.float64) for _ in models]
    per_seq: list[list[Tensor]] = [[] for _ in models]
    done, stopped = 0, None
    start = time.perf_counter()
    bar = tqdm(total=n, desc=desc, unit="seq", disable=not cfg.progress, dynamic_ncols=True)
    stop = StopFlag("stopping after this batch of windows; the finished ones are written")
    with stop_signals(stop), bar:
        for b0 in range(0, n, cfg.batch_size):
            if stop.reason is not None and done > 0:  # at a batch's end every model has its sums
                stopped = f"{stop.reason} after {done} of {n} sequences"
                break
            batch = windows[b0 : b0 + cfg.batch_size].to(device)  # [b, T + 1]
            for m, loaded in enumerate(models):
                if policy is None:
                    loss = per_position_loss(loaded.model, batch, logits_chunk=cfg.logits_chunk)  # [b, T]
                else:
                    head = per_position_loss(loaded.model, batch[:, : prefix + 1]).cpu()  # [b, prefix]: dense
                    tail = streamed_loss(lms[m], batch, policy, prefix=prefix, chunk=cfg.chunk, compare=False)
                    loss = torch.cat([head, tail.loss], dim=1)  # [b, T]
                loss = loss.cpu()
                sums[m] += loss.double().sum(0)
                per_seq[m].append(loss.double().cumsum(1)[:, ends - 1] / ends)  # [b, P]
            done += batch.shape[0]
            bar.update(batch.shape[0])
            bar.set_postfix_str(f"{models[0].name}: loss {float(sums[0].sum()) / (done * t):.3f}")
            if cfg.max_seconds is not None and done < n and time.perf_counter() - start > cfg.max_seconds:
                stopped = f"max_seconds ({cfg.max_seconds:g} s) after {done} of {n} sequences"
                break
    return _Curves(
        loss=[(s / done).numpy() for s in sums],
        prefix_losses=[torch.cat(p).numpy() for p in per_seq],
        num_sequences=done,
        stopped_early=stopped,
    )


def _load_models(cfg: LossEvalConfig, evaluation: str) -> list[LoadedModel]:
    """Load every model (all paths checked first, then the output folder), with unique labels
    and one tokenizer."""
    for path in cfg.models:
        if not Path(path).exists():
            raise ValueError(f"model path does not exist: {path}")
    check_out_dir(_out_dir(cfg, evaluation), cfg.overwrite)
    device = resolve_device(cfg.device)
    dtype = {
        "auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
    }[cfg.dtype]
    models = [
        load_model(path, device=device, dtype=dtype, name=cfg.names[i] if cfg.names else None)
        for i, path in enumerate(cfg.models)
    ]
    if cfg.hf is not None:  # a transformers causal LM where the lapse Decoder would be
        hf = load_lm(None, cfg.hf, cfg.gguf_file, device=device, dtype=dtype)
        name = cfg.names[-1] if cfg.names else hf.name
        models.append(LoadedModel(model=hf.lm, tokenizer=hf.tokenizer, name=name, path=hf.path))
    if not cfg.names:
        for loaded, label in zip(models, _unique_labels(models), strict=True):
            loaded.name = label
    check_same_tokenizer(models)
    return models


def _unique_labels(models: list[LoadedModel]) -> list[str]:
    """The folder names, or ``parent/name`` where folder names collide (two runs named
    ``run``), or ``name (k)`` where even those do."""
    labels = [m.name for m in models]
    if len(set(labels)) == len(labels):
        return labels
    labels = [f"{m.path.resolve().parent.name}/{m.path.name}" for m in models]
    if len(set(labels)) == len(labels):
        return labels
    return [f"{label} ({k + 1})" for k, label in enumerate(labels)]


_PROBE_TEXT = "def f(x):\n    return x ** 2  # Grüße, 東京, émoji 🙂 <eos>\n"


def check_same_tokenizer(models: list[LoadedModel]) -> None:
    """Raise ``ValueError`` unless every model whose tokenizer is known has the first known
    one (same class, vocabulary size, eos id and ids of a probe text): the models are
    compared on the same token windows, which only mean the same text under one tokenizer.
    A model without a saved tokenizer is taken on trust; its ``vocab_size`` is still
    checked against the windows."""
    known = [m for m in models if m.tokenizer is not None]
    if not known:
        return
    ref = known[0]

    def fingerprint(m: LoadedModel):
        return tokenizer_info(m.tokenizer), m.tokenizer.encode(_PROBE_TEXT)

    for m in known[1:]:
        if fingerprint(m) != fingerprint(ref):
            raise ValueError(
                f"models {ref.name!r} ({ref.path}) and {m.name!r} ({m.path}) use different tokenizers "
                f"({tokenizer_info(ref.tokenizer)} vs {tokenizer_info(m.tokenizer)}): per-token loss and "
                "perplexity compare models on the same token windows, so they must share a tokenizer"
            )


def _num_windows(cfg: LossEvalConfig, seq_len: int) -> int:
    if cfg.max_tokens is None:
        return cfg.num_sequences
    return min(cfg.num_sequences, max(1, cfg.max_tokens // seq_len))


def _is_hf(m: LoadedModel) -> bool:
    return not isinstance(m.model, Decoder)


def _context(m: LoadedModel) -> int:
    """The training context of a lapse model; a Hugging Face model's ``max_position_embeddings``."""
    return m.model.config.max_position_embeddings if _is_hf(m) else m.context


def _windows(cfg: LossEvalConfig, first: LoadedModel, seq_len: int) -> Tensor:
    if _is_hf(first):  # no run, no token shards: documents encoded with its tokenizer
        return text_windows(first.tokenizer, cfg.corpus, seq_len, _num_windows(cfg, seq_len), seed=cfg.seed)
    return eval_windows(
        first, seq_len, _num_windows(cfg, seq_len), seed=cfg.seed, corpus=cfg.corpus, data_dir=cfg.data_dir
    )  # [n, seq_len + 1]


def run_per_token_loss(cfg: PerTokenLossConfig) -> dict:
    """Per-token loss ``L(i)`` of ``cfg.models`` on the same windows (SPEC section 4).

    Writes into ``cfg.out_dir`` (default ``<first model>/eval/per-token-loss/``):
    ``results.json`` (this function's return value: the config, the number of windows, and
    per model ``L(i)`` raw and smoothed, each window's mean loss and the summary numbers of
    :func:`curve_summary`), ``per_token_loss.png`` (smoothed ``L(i)``, models overlaid) and
    ``summary.md`` (a table and the plot).
    """
    models = _load_models(cfg, "per-token-loss")
    seq_len = cfg.seq_len if cfg.seq_len is not None else _context(models[0])
    windows = _windows(cfg, models[0], seq_len)
    curves = _evaluate(models, windows, cfg, "per-token loss")
    results = {**_results(cfg, "per-token-loss", models, curves, windows), "seq_len": seq_len}
    return _write(cfg, results, _plot_per_token, "per_token_loss.png", _per_token_summary)


def run_ppl(cfg: PplConfig) -> dict:
    """Mean loss and perplexity of ``cfg.models`` at each context length, and ``L(i)`` at
    the longest one.

    Every model reads the same ``num_sequences`` windows of the longest length; the row of
    length ``T`` is computed on their first ``T`` positions: the mean loss over ``i < T``
    and ``ppl = exp(mean loss)``. A causal model's loss at position ``i`` does not depend
    on what follows ``i``, so a window's prefix *is* a window of length ``T`` (the tests
    check this), and one pass gives every row, paired on the same text, so differences
    between lengths are not sampling noise. A row is ``extrapolation`` when ``T`` exceeds
    that model's training context (``LoadedModel.context``). ``max_tokens`` and
    ``max_seconds`` limit the windows of the longest length.

    Writes into ``cfg.out_dir`` (default ``<first model>/eval/ppl/``): ``results.json`` (the
    return value), ``ppl.png`` (loss against context length; smoothed ``L(i)`` at the
    longest length) and ``summary.md``.
    """
    models = _load_models(cfg, "ppl")
    lengths = cfg.context_lengths
    if not lengths:
        t = _context(models[0])
        lengths = tuple(sorted({max(1, t // 2), t, 2 * t, 4 * t}))
    windows = _windows(cfg, models[0], lengths[-1])
    curves = _evaluate(models, windows, cfg, f"ppl (T up to {lengths[-1]})", prefixes=lengths)
    rows: list[list[dict]] = [[] for _ in models]
    for k, m in enumerate(models):
        for p, length in enumerate(lengths):
            summary = curve_summary(curves.loss[k][:length])
            rows[k].append({
                "context_length": length,
                "extrapolation": length > _context(m),
                "mean_loss": summary["mean_loss"],
                "mean_loss_stderr": _stderr(curves.prefix_losses[k][:, p]),
                "ppl": math.exp(summary["mean_loss"]),
                "last_10pct": summary["last_10pct"],
            })
    results = {**_results(cfg, "ppl", models, curves, windows), "context_lengths": list(lengths)}
    for entry, model_rows in zip(results["models"], rows, strict=True):
        entry["lengths"] = model_rows
    return _write(cfg, results, _plot_ppl, "ppl.png", _ppl_summary)


def _results(cfg: LossEvalConfig, name: str, models: list[LoadedModel], curves, windows: Tensor) -> dict:
    """What both evaluations record: the config, the data, the smoothing, how many windows
    were read, and each model's curve."""
    return {
        "evaluation": name,
        "config": _jsonable(asdict(cfg)),
        "num_sequences": curves.num_sequences,
        "num_sequences_requested": windows.shape[0],
        "stopped_early": curves.stopped_early,
        "policy": None if cfg.policy is None else repr(cfg.make_policy()),
        "data": _data_description(cfg, models[0]),
        "smooth_window": cfg.smooth_window,
        "smoothing": SMOOTHING_RULE,
        "models": [
            _model_entry(m, curves.loss[k], curves.prefix_losses[k][:, -1], cfg.smooth_window)
            for k, m in enumerate(models)
        ],
    }


def _out_dir(cfg: LossEvalConfig, evaluation: str) -> Path:
    """``cfg.out_dir``, by default ``<first model>/eval/<evaluation>[-<policy>]/`` (a policy's
    results beside the model's own)."""
    if cfg.out_dir is not None:
        return cfg.out_dir
    first = cfg.models[0] if cfg.models else None  # --hf alone: ./eval/<evaluation>/
    return default_eval_dir(first, eval_name(evaluation, cfg.policy))


def _write(cfg: LossEvalConfig, results: dict, plot, png: str, summary) -> dict:
    """Plot, summary and results into :func:`_out_dir`; the results with ``out_dir`` added."""
    out_dir = _out_dir(cfg, results["evaluation"])
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(results, out_dir / png)
    write_text_atomic(out_dir / "summary.md", summary(results))
    write_text_atomic(out_dir / "results.json", json.dumps(results, indent=1))
    return {**results, "out_dir": str(out_dir)}


def _model_entry(m: LoadedModel, loss: np.ndarray, sequence_losses: np.ndarray, window: int) -> dict:
    return {
        "name": m.name,
        "path": str(m.path),
        "arch": m.model.config.model_type if _is_hf(m) else m.config.name,
        "acp": False if _is_hf(m) else m.config.acp,
        "max_seq_len": _context(m),
        **curve_summary(loss),
        "mean_loss_stderr": _stderr(sequence_losses),
        "loss": loss.tolist(),
        "smoothed": smooth(loss, window).tolist(),
        "sequence_losses": sequence_losses.tolist(),
    }


def _stderr(x: np.ndarray) -> float | None:
    """Standard error of the mean over windows (``None`` for one window)."""
    return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None


def _data_description(cfg: LossEvalConfig, first: LoadedModel) -> str:
    corpus = cfg.corpus
    if corpus is None and first.train_config is not None:
        corpus = first.train_config.corpus
    if corpus is None and _is_hf(first):
        corpus = CorpusConfig()  # text_windows' default: the local Python sources
    if corpus is None:
        return "unknown corpus"
    where = f" {', '.join(corpus.paths)}" if corpus.paths else ""
    return f"validation split of the {corpus.kind} corpus{where}, tokenised as {first.name} was trained"


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def _draw_per_token(ax, entries: list[dict], window: int, title: str) -> None:
    """Smoothed ``L(i)`` of each model and a dotted line at each training context inside the
    plot (``L(i)`` beyond it is extrapolation).

    Near the ends the smoothing window is narrower (see :func:`smooth`), so the curve is
    noisier there: those stretches are drawn faint. The y-limits leave out the first 2% of
    positions (the steep start runs off the top instead of flattening the rest) and the
    narrow-window stretch at the end (noise of few positions, not a trend).
    """
    t = len(entries[0]["smoothed"])
    x = np.arange(t)
    h = window // 2
    full = slice(h, t - h) if t > 2 * h else slice(t // 50, t)
    fit = slice(t // 50, full.stop)
    lows, highs = [], []
    for e in entries:
        y = np.asarray(e["smoothed"])
        (line,) = ax.plot(x[full], y[full], lw=1.4, label=e["name"])
        for edge in (slice(0, full.start + 1), slice(full.stop - 1, t)):
            ax.plot(x[edge], y[edge], lw=1.0, color=line.get_color(), alpha=0.35)
        lows.append(y[fit].min())
        highs.append(y[fit].max())
    contexts = sorted({e["max_seq_len"] for e in entries if e["max_seq_len"] < t - 1})
    for k, context in enumerate(contexts):
        ax.axvline(context, color="0.3", ls=":", lw=1.1, label="training context" if k == 0 else None)
    lo, hi = min(lows), max(highs)
    pad = 0.08 * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1.0)
    ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlim(0, t - 1)
    ax.set_xlabel("position i")
    ax.set_ylabel("loss L(i) (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_per_token(results: dict, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    _draw_per_token(
        ax, results["models"], results["smooth_window"],
        f"per-token loss: {results['num_sequences']} windows of {results['seq_len']} tokens "
        f"(smoothed, width {results['smooth_window']})",
    )
    _save_figure(fig, path)


def _plot_ppl(results: dict, path: Path) -> None:
    plt = _pyplot()
    fig, (ax, ax_tok) = plt.subplots(1, 2, figsize=(12.5, 4.5))
    lengths = results["context_lengths"]
    for e in results["models"]:
        rows = e["lengths"]
        # no error bars: every point reads the same windows, so the spread between windows
        # (the s.e. in the table) is far wider than the uncertainty of the differences shown
        losses = np.array([r["mean_loss"] for r in rows])
        beyond = np.array([r["extrapolation"] for r in rows])
        (line,) = ax.plot(lengths, losses, "-", lw=1.2, label=e["name"])
        color = line.get_color()
        x = np.array(lengths)
        ax.plot(x[~beyond], losses[~beyond], "o", color=color, ms=6)
        ax.plot(x[beyond], losses[beyond], "o", mfc="white", color=color, ms=6)
    for t in sorted({e["max_seq_len"] for e in results["models"]}):
        if t < lengths[-1]:
            ax.axvspan(t, lengths[-1], color="0.5", alpha=0.08, lw=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("context length")
    ax.set_ylabel("mean loss (nats)")
    ax.set_title("loss against context length (open marker, shaded: beyond the training context)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _draw_per_token(
        ax_tok, results["models"], results["smooth_window"],
        f"per-token loss at {lengths[-1]}: {results['num_sequences']} windows "
        f"(smoothed, width {results['smooth_window']})",
    )
    ax_tok.title.set_fontsize(10)
    _save_figure(fig, path)


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def _policy_note(r: dict) -> list[str]:
    if r["policy"] is None:
        return []
    c = r["config"]
    prefix = c["prefix"] or "T / 4 (T the shortest length)"
    return [
        f"Under the eviction policy `{r['policy']}`: each window's first {prefix} tokens "
        f"prefilled (their predictions are the dense model's), the rest streamed {c['chunk']} per forward "
        "through the cache as the policy leaves it (`lapse.eval.policy.streamed_loss`); a length up to the "
        "prefix is therefore the dense model's.",
    ]


def _per_token_summary(r: dict) -> str:
    lines = [
        "# Per-token loss",
        "",
        f"{r['num_sequences']} windows of {r['seq_len']} tokens ({r['data']}), seed {r['config']['seed']}; "
        f"`L(i)` is the mean cross-entropy (nats) of the prediction at position `i`.",
    ]
    lines += _policy_note(r)
    if r["stopped_early"]:
        lines.append(f"Stopped early: {r['stopped_early']}.")
    lines += [
        "",
        "| model | arch | training context | mean loss | ± s.e. | first 10% | last 10% "
        "| slope, last half (per 1k positions) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for e in r["models"]:
        slope = None if e["slope_last_half"] is None else 1000 * e["slope_last_half"]
        lines.append(
            f"| {e['name']} | {e['arch']}{' + ACP' if e['acp'] else ''} | {e['max_seq_len']} "
            f"| {_fmt(e['mean_loss'])} | {_fmt(e['mean_loss_stderr'])} | {_fmt(e['first_10pct'])} "
            f"| {_fmt(e['last_10pct'])} | {_fmt(slope, '+.4f')} |"
        )
    lines += [
        "",
        "First/last 10%: mean over the first/last `max(1, T // 10)` positions. Slope: least squares "
        "of the raw `L(i)` on `i` over the second half; negative means later tokens gain from the "
        f"longer context. The plot is smoothed: {r['smoothing']}. ± s.e.: standard error of the mean "
        "over windows.",
        "",
        "![per-token loss](per_token_loss.png)",
        "",
        "Files: `results.json` (raw and smoothed `L(i)` per model, each window's mean loss, the config).",
    ]
    return "\n".join(lines)


def _ppl_summary(r: dict) -> str:
    t = r["context_lengths"][-1]
    lines = [
        "# Perplexity against context length",
        "",
        f"{r['num_sequences']} windows of {t} tokens ({r['data']}), seed {r['config']['seed']}; the row "
        "of length `T` reads their first `T` positions (a causal model's loss at `i` does not depend on "
        "what follows). Mean loss (nats) over positions `i < T`, `ppl = exp(mean loss)`; ± s.e.: the "
        "standard error over windows (all rows and models share the windows, so their differences are "
        "far more certain than that); last 10%: positions `0.9 T <= i < T`; *extrapolation*: `T` "
        "exceeds the model's training context.",
    ]
    lines += _policy_note(r)
    if r["stopped_early"]:
        lines.append(f"Stopped early: {r['stopped_early']}.")
    lines += [
        "",
        "| model | context length | mean loss | ± s.e. | ppl | last 10% | |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for e in r["models"]:
        for row in e["lengths"]:
            mark = f"extrapolation (trained at {e['max_seq_len']})" if row["extrapolation"] else ""
            lines.append(
                f"| {e['name']} | {row['context_length']} | {_fmt(row['mean_loss'])} "
                f"| {_fmt(row['mean_loss_stderr'])} | {_fmt(row['ppl'], '.3f')} | {_fmt(row['last_10pct'])} "
                f"| {mark} |"
            )
    lines += [
        "",
        f"Per-token loss at {t}:",
        "",
        "| model | first 10% | last 10% | slope, last half (per 1k positions) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for e in r["models"]:
        slope = None if e["slope_last_half"] is None else 1000 * e["slope_last_half"]
        lines.append(
            f"| {e['name']} | {_fmt(e['first_10pct'])} | {_fmt(e['last_10pct'])} | {_fmt(slope, '+.4f')} |"
        )
    lines += [
        "",
        "![perplexity](ppl.png)",
        "",
        f"Left: mean loss per context length. Right: `L(i)` at {t}, smoothed ({r['smoothing']}); "
        "dotted lines mark training contexts.",
        "",
        "Files: `results.json` (every row, raw and smoothed `L(i)` at the longest length, each window's "
        "mean loss there, the config).",
    ]
    return "\n".join(lines)
