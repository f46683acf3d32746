"""``lapse eval acp``: what Adaptive Computation Pruning does on a FoX model, on real data.

SPEC section 3; the figures of the ACP paper (Lin et al., 2025) it reproduces:

- Figures 4 and 5: the pruned fraction of every head (pruned tile area / causal tile area,
  what the attention op reports in :class:`~lapse.ops.AttentionStats`), its histogram over
  all heads in 20 bins of 5%, and per layer.
- Local and global heads, classified by the forget gate alone (the rule below), beside the
  pruned fraction: whether the heads split into two groups (bimodal) shows in both.
- Figure 6: for chosen heads, the decay matrix ``D_ij = c_i - c_j`` with the pruning
  boundary (the staircase of 64 x 64 tiles the op skipped) and the attention map
  ``softmax(scale q k^T + D)`` beside it.
- Figure 7: the effect of ``eps`` on the pruned fraction and on the validation loss, with
  ACP off as the reference.

Local vs global (:data:`LOCAL_RULE`). ``D`` over a distance of ``n`` tokens is a sum of
``n`` log gates, so a head's mean log gate ``r = mean_t log f_t`` (over every position of
every window) gives its expected decay, ``n * r``. Its memory length ``1 / -r`` is the
distance over which that falls by one nat (for a constant gate ``f = exp(-m)``, ALiBi with
slope ``m``, it is ``1 / m``). A head is *local* when its memory length is below
``local_fraction * seq_len``: with the default 0.1, the expected decay across the whole
window is more than 10 nats, the default ACP tolerance ``eps = e^-10``.

Capture. The maps need each layer's ``q``, ``k`` and log gates as the op saw them; forward
hooks on the attention layers' submodules read them (``q_norm`` / ``k_norm`` outputs for
Pro, which follow the KV-shift; ``q_proj`` / ``k_proj`` for LLaMA; ``fgate`` for the
gates) without touching the model. For every drawn head the boundary is checked against a
direct tile-by-tile test of ``D`` (:func:`direct_tile_pruning`, written from SPEC section
3 and sharing no code with the op); ``results.json`` records whether the two agree.

Outputs (``out_dir``, default ``<model>/eval/acp/``): ``results.json``, ``heads.png``
(histogram and memory length vs pruned fraction), ``layers.png`` (per-layer bars and
per-layer distribution), ``eps.png``, ``head_L<layer>_H<head>.png`` per drawn head, and
``summary.md``.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from lapse.eval.common import LoadedModel, check_out_dir, default_eval_dir, eval_windows, load_model
from lapse.eval.config import AcpEvalConfig, _check_seq_len
from lapse.files import save_figure, write_text_atomic
from lapse.models import Decoder, attention_class
from lapse.ops.backend import resolve_device
from lapse.ops.forgetting import ACP_BLOCK, LOG_GATE_FLOOR

LOCAL_RULE = (
    "memory length = 1 / -(mean log forget gate over all positions of all windows), the distance "
    "over which the expected decay bias falls by one nat; a head is local when its memory length "
    "is below local_fraction * seq_len (its expected decay across the window exceeds "
    "1 / local_fraction nats), global otherwise"
)

MAX_MEMORY = 1e12
"""Memory lengths are capped here (a head whose gates are all exactly 1 never decays)."""

HIST_BINS = 20  # [0%, 5%), ..., [95%, 100%], as in the ACP paper's Figure 4


def spec_delta(u: float, length: int, eps: float) -> float:
    """``delta = -2U - log L + log eps`` (SPEC section 3): a pair with ``D_ij < delta`` has
    weight below ``exp(2U + D_ij) < eps / L``."""
    return -2.0 * u - math.log(length) + math.log(eps)


def direct_tile_pruning(c: Tensor, delta: float, block: int = ACP_BLOCK) -> Tensor:
    """Which ``block x block`` tiles of one head's causal ``T x T`` decay matrix are prunable.

    Tile ``(m, n)`` (query block ``m``, key block ``n``) is prunable when it lies strictly
    below the diagonal (its last key precedes its first query; diagonal tiles hold
    ``D_ii = 0`` and are never pruned) and *every* entry ``D_ij = c_i - c_j`` in it is below
    ``delta``. The maximum is taken over the whole tile, one query block of ``D`` at a time
    (memory ``block x T``), with no use of the top-right-corner shortcut or of the
    staircase shape: this is the check the op's boundary indices are held to.

    Args:
        c: ``[T]`` cumulative log gates (float64 preferred), non-increasing.
        delta: the threshold, e.g. :func:`spec_delta`.

    Returns:
        ``[M, N]`` bool, ``M = N = ceil(T / block)``.
    """
    t = c.shape[0]
    n_blocks = -(-t // block)
    c = c.double()
    keys = torch.arange(t, device=c.device)
    last_key = torch.arange(n_blocks, device=c.device) * block + block - 1  # [N]
    out = torch.zeros(n_blocks, n_blocks, dtype=torch.bool, device=c.device)
    for m in range(n_blocks):
        rows = torch.arange(m * block, min((m + 1) * block, t), device=c.device)  # [R]
        d = c[rows, None] - c[None, :]  # [R, T]
        d = d.masked_fill(keys[None, :] > rows[:, None], float("-inf"))  # causal
        d = F.pad(d, (0, n_blocks * block - t), value=float("-inf"))  # [R, N * block]
        tile_max = d.view(len(rows), n_blocks, block).amax(dim=(0, 2))  # [N]
        out[m] = (last_key < m * block) & (tile_max < delta)
    return out


def tile_areas(t: int, block: int = ACP_BLOCK) -> tuple[Tensor, Tensor]:
    """``(area, causal)``, both ``[M, N]``: positions covered by each tile (clipped at
    ``T``) and whether the tile holds any causal pair (key block <= query block)."""
    n_blocks = -(-t // block)
    sizes = torch.tensor([min(block, t - i * block) for i in range(n_blocks)], dtype=torch.float64)
    idx = torch.arange(n_blocks)
    return sizes[:, None] * sizes[None, :], idx[None, :] <= idx[:, None]


def direct_pruned_fraction(mask: Tensor, block: int = ACP_BLOCK, t: int | None = None) -> float:
    """Pruned tile area / causal tile area (SPEC section 3, Accounting) of a tile mask from
    :func:`direct_tile_pruning`; ``t`` defaults to ``M * block``."""
    n_blocks = mask.shape[0]
    area, causal = tile_areas(n_blocks * block if t is None else t, block)
    return float((area * mask.cpu()).sum() / (area * causal).sum())


def max_pruned_fraction(t: int, block: int = ACP_BLOCK, kept_diagonals: int = 1) -> float:
    """The most ACP can prune at length ``t``: every tile but the ``kept_diagonals`` nearest
    the diagonal of each query block (1: every tile off the diagonal). With 2: the most
    without a single gate below delta, since the tile beside the diagonal holds a pair
    one step apart, whose bias is one log gate."""
    area, causal = tile_areas(t, block)
    n = area.shape[0]
    far = torch.arange(n)[None, :] <= torch.arange(n)[:, None] - kept_diagonals
    return float((area * far).sum() / (area * causal).sum())


@contextmanager
def gate_sums(model: Decoder):
    """Sums ``log f`` of every FoX layer and head over the forwards run inside.

    Yields ``(sums, counts)``: float64 ``[n_layers, H]`` sums and a one-element list with
    the number of positions seen (the same for every head).
    """
    n_layers, h = len(model.blocks), model.config.n_heads
    sums = torch.zeros(n_layers, h, dtype=torch.float64)
    counts = [0]

    def hook(layer: int):
        def fn(module, args, out):
            r = F.logsigmoid(out.float())  # [B, T, H], as Attention.forward computes it
            sums[layer] += r.double().sum(dim=(0, 1)).cpu()
            if layer == 0:
                counts[0] += r.shape[0] * r.shape[1]

        return fn

    handles = [b.attn.fgate.register_forward_hook(hook(i)) for i, b in enumerate(model.blocks)]
    try:
        yield sums, counts
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def capture_heads(model: Decoder, heads: list[tuple[int, int]]):
    """Keeps ``q``, ``k`` and ``log f`` of the chosen ``(layer, head)`` pairs, first sequence
    of the batch, from the next forward: exactly the tensors the attention op receives.

    Yields a dict ``(layer, head) -> {"q": [T, D], "k": [T, D], "log_fgate": [T]}`` (float32,
    CPU), filled when the forward has run. ``k`` is the key of the head's key/value group.
    """
    got: dict[tuple[int, int], dict[str, Tensor]] = {p: {} for p in heads}
    handles = []
    for layer in sorted({p[0] for p in heads}):
        attn = model.blocks[layer].attn
        mine = [p for p in heads if p[0] == layer]
        group = attn.n_heads // attn.n_kv_heads

        def store(name: str, mine=mine, group=group, d=attn.head_dim):
            def fn(module, args, out):
                x = out[0].detach().float().cpu()  # [T, ...] first sequence
                if name != "log_fgate":
                    x = x.reshape(x.shape[0], -1, d)  # [T, heads, D]
                else:
                    x = F.logsigmoid(x)  # [T, H]
                for p in mine:
                    got[p][name] = x[:, p[1] // group] if name == "k" else x[:, p[1]]

            return fn

        q_mod, k_mod = attn.qk_sources()  # forgetting attention has no RoPE
        handles += [
            q_mod.register_forward_hook(store("q")),
            k_mod.register_forward_hook(store("k")),
            attn.fgate.register_forward_hook(store("log_fgate")),
        ]
    try:
        yield got
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def _window_loss_sum(model: Decoder, windows: Tensor) -> float:
    """Sum of the next-token cross-entropies of ``windows`` ``[B, T + 1]``."""
    _, loss = model(windows[:, :-1], labels=windows[:, 1:])
    return float(loss) * windows.shape[0] * (windows.shape[1] - 1)


def _load(cfg: AcpEvalConfig, device: torch.device, **overrides) -> LoadedModel:
    return load_model(cfg.model, device=device, dtype=torch.float32, **overrides)


def _sweep(cfg: AcpEvalConfig, model_eps: float) -> list[float]:
    values = list(cfg.eps)
    if not any(math.isclose(e, model_eps, rel_tol=1e-9) for e in values):
        values.append(model_eps)
    return sorted(values, reverse=True)


def _eps_label(e: float, tex: bool = False) -> str:
    k = math.log(e)
    if abs(k - round(k)) > 1e-9:
        return f"{e:.2g}"
    return f"$e^{{{k:.0f}}}$" if tex else f"e^{k:.0f}"


@dataclass
class _Pass:
    """Totals of one pass over the windows."""

    loss_sum: float = 0.0
    tokens: int = 0
    pruned_sum: Tensor | None = None  # [n_layers, H], summed over sequences
    sequences: int = 0


def _run_pass(model: Decoder, windows: Tensor, cfg: AcpEvalConfig, device, bar, stats: bool) -> _Pass:
    out = _Pass()
    model.set_collect_stats(stats)
    try:
        for s in range(0, windows.shape[0], cfg.batch_size):
            batch = windows[s : s + cfg.batch_size].to(device)  # [b, T + 1]
            out.loss_sum += _window_loss_sum(model, batch)
            out.tokens += batch.shape[0] * (batch.shape[1] - 1)
            if stats:
                pruned = model.pruned_fractions().double().cpu() * batch.shape[0]  # [n_layers, H]
                out.pruned_sum = pruned if out.pruned_sum is None else out.pruned_sum + pruned
            out.sequences += batch.shape[0]
            bar.update(1)
    finally:
        model.set_collect_stats(False)
    return out


def _bimodality_coefficient(x: np.ndarray) -> float | None:
    """Sarle's bimodality coefficient ``(g^2 + 1) / (k + 3 (n-1)^2 / ((n-2)(n-3)))`` with
    the sample skewness ``g`` and excess kurtosis ``k`` (bias-corrected). Above 5/9 (the
    value of a uniform distribution) hints at two modes. ``None`` for ``n < 4`` or no spread."""
    n = len(x)
    if n < 4 or float(np.std(x)) < 1e-12:
        return None
    d = x - x.mean()
    m2, m3, m4 = (d**2).mean(), (d**3).mean(), (d**4).mean()
    g = math.sqrt(n * (n - 1)) / (n - 2) * m3 / m2**1.5
    k = (n - 1) / ((n - 2) * (n - 3)) * ((n + 1) * (m4 / m2**2 - 3) + 6)
    return float((g**2 + 1) / (k + 3 * (n - 1) ** 2 / ((n - 2) * (n - 3))))


def _head_bound(attn, head: int, q: Tensor, k: Tensor) -> float:
    """U of one head as the model gives it to the op: ``acp_bound()`` (from the QK-norm
    gains for Pro), or for ``"auto"`` ``max ||q_i|| * max ||k_j|| * scale`` (SPEC section 3)."""
    bound = attn.acp_bound()
    if isinstance(bound, str):
        return float(q.norm(dim=-1).max() * k.norm(dim=-1).max() * attn.scale)
    return float(bound[head])


def _head_map(attn, head: int, got: dict[str, Tensor], eps: float, stats, n_map: int) -> dict:
    """One drawn head: its boundary from the op (``stats`` of the window's forward) checked
    against :func:`direct_tile_pruning`, and the top-left ``n_map x n_map`` corner of ``D``
    and of the attention weights (complete: causal rows need no later keys). The mean
    attention distance ``sum_j A_ij (i - j)`` is averaged over the rows of that corner."""
    q, k, r = got["q"].double(), got["k"].double(), got["log_fgate"].double()  # [T, D], [T, D], [T]
    t = q.shape[0]
    u = _head_bound(attn, head, q, k)
    delta = spec_delta(u, t, eps)
    c = torch.cumsum(r.clamp_min(LOG_GATE_FLOOR), dim=0)  # [T], floored as the op does
    mask = direct_tile_pruning(c, delta)  # [M, N]
    direct_start = mask.sum(dim=1)  # [M] pruned tiles of each query block
    staircase = bool((mask == (torch.arange(mask.shape[1])[None] < direct_start[:, None])).all())
    op_start = stats.block_start[0, head].long().cpu()  # [M]
    d = c[:n_map, None] - c[None, :n_map]  # [n, n]
    d = d.masked_fill(~torch.ones(n_map, n_map, dtype=torch.bool).tril(), float("-inf"))
    a = torch.softmax(q[:n_map] @ k[:n_map].T * attn.scale + d, dim=-1)  # [n, n]
    dist = (torch.arange(n_map)[:, None] - torch.arange(n_map)[None, :]).clamp_min(0).double()
    return {
        "u": u,
        "delta": delta,
        "op_pruned_fraction": float(stats.pruned_fraction[0, head]),
        "direct_pruned_fraction": direct_pruned_fraction(mask, t=t),
        "boundary_agrees": bool(torch.equal(direct_start, op_start)) and staircase,
        "query_blocks_disagreeing": int((direct_start != op_start).sum()),
        "block_start": op_start.tolist(),
        "mean_attention_distance": float((a * dist).sum(-1).mean()),
        "D": d.float().numpy(),
        "A": a.float().numpy(),
    }


def run_acp(cfg: AcpEvalConfig) -> dict:
    """Runs the evaluation, writes the files into ``cfg.out_dir`` and returns the results
    (the content of ``results.json``). Raises ``ValueError`` for a model without a forget
    gate, a missing path or a head that does not exist."""
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    out_dir = check_out_dir(cfg.out_dir or default_eval_dir(cfg.model, "acp"), cfg.overwrite)
    dense = _load(cfg, device, acp=False)
    mc = dense.config
    bound_from_gains = dense.model.blocks[0].attn.logit_bound() is not None  # QK-norm gains
    if not attention_class(mc.attention).supports_acp:
        raise ValueError(
            f"ACP needs a forgetting-attention model (fox-llama or fox-pro); {cfg.model} is a "
            f"{mc.name} model, which has no forget gate to prune with"
        )
    t = mc.max_seq_len if cfg.seq_len is None else cfg.seq_len
    _check_seq_len(t, models_own=cfg.seq_len is None)
    n_layers, n_heads = mc.n_layers, mc.n_heads
    if cfg.heads != "auto":
        for layer, head in cfg.heads:
            if layer >= n_layers or head >= n_heads:
                raise ValueError(
                    f"head ({layer}, {head}) does not exist: the model has {n_layers} layers of "
                    f"{n_heads} heads (both counted from 0)"
                )
    windows = eval_windows(
        dense, t, cfg.num_sequences, seed=cfg.seed, corpus=cfg.corpus, data_dir=cfg.data_dir
    )  # [N, T + 1]
    model_eps = mc.acp_eps
    sweep = _sweep(cfg, model_eps)
    batches = -(-cfg.num_sequences // cfg.batch_size)
    bar = tqdm(total=batches * (len(sweep) + 1) + 1, desc="acp eval", unit="pass", disable=not cfg.progress)

    # ACP off: the reference loss, and the gate statistics (they do not depend on ACP)
    with gate_sums(dense.model) as (sums, counts):
        ref = _run_pass(dense.model, windows, cfg, device, bar, stats=False)
    mean_log_gate = (sums / max(counts[0], 1)).float()  # [n_layers, H]
    memory = 1.0 / (-mean_log_gate).clamp_min(1.0 / MAX_MEMORY)  # [n_layers, H] tokens
    local = memory < cfg.local_fraction * t  # [n_layers, H]
    del dense

    sweep_rows, own = [], None
    for e in sweep:
        loaded = _load(cfg, device, acp=True, acp_eps=e)
        run = _run_pass(loaded.model, windows, cfg, device, bar, stats=True)
        pruned = (run.pruned_sum / run.sequences).float()  # [n_layers, H]
        sweep_rows.append({"eps": e, "log_eps": math.log(e), "loss": run.loss_sum / run.tokens,
                           "pruned": float(pruned.mean()), "pruned_per_layer": pruned.mean(1).tolist()})
        if math.isclose(e, model_eps, rel_tol=1e-9):
            own, own_model = pruned, loaded
        else:
            del loaded
    dense_loss = ref.loss_sum / ref.tokens
    for row in sweep_rows:
        row["loss_change"] = row["loss"] - dense_loss

    # the heads to draw
    if cfg.heads == "auto":
        flat = [(layer, h) for layer in range(n_layers) for h in range(n_heads)]
        key_local = lambda p: (float(memory[p]), -float(own[p]))  # noqa: E731
        chosen = [min(flat, key=key_local), max(flat, key=key_local)]
        chosen = list(dict.fromkeys(chosen))
    else:
        chosen = list(cfg.heads)
    n_map = min(cfg.map_tokens, t)
    model = own_model.model
    model.set_collect_stats(True)
    try:
        with capture_heads(model, chosen) as got, torch.no_grad():
            model(windows[:1, :-1].to(device))
        maps = []
        for layer, head in chosen:
            attn = model.blocks[layer].attn
            entry = _head_map(attn, head, got[(layer, head)], model_eps, attn.last_stats, n_map)
            maps.append({"layer": layer, "head": head, "kind": "local" if local[layer, head] else "global",
                         "memory_length": float(memory[layer, head]), **entry})
    finally:
        model.set_collect_stats(False)
    bar.update(1)
    bar.close()

    per_head = [
        {"layer": layer, "head": h, "pruned": float(own[layer, h]),
         "mean_log_gate": float(mean_log_gate[layer, h]), "memory_length": float(memory[layer, h]),
         "kind": "local" if local[layer, h] else "global"}
        for layer in range(n_layers) for h in range(n_heads)
    ]
    fractions = own.flatten().numpy().astype(np.float64)
    results = {
        "model": str(cfg.model),
        "name": own_model.name,
        "arch": mc.name,
        "seq_len": t,
        "num_sequences": cfg.num_sequences,
        "seed": cfg.seed,
        "block": ACP_BLOCK,
        "acp_eps": model_eps,
        "acp_bound": "QK-norm gains" if bound_from_gains else "data (max query norm x max key norm)",
        "max_pruned_fraction": max_pruned_fraction(t),
        "max_pruned_fraction_no_reset": max_pruned_fraction(t, kept_diagonals=2),
        "pruned_fraction": float(own.mean()),
        "pruned_per_layer": own.mean(1).tolist(),
        "pruned_per_head": own.tolist(),
        "heads": per_head,
        "local_rule": LOCAL_RULE,
        "local_fraction": cfg.local_fraction,
        "local_heads": int(local.sum()),
        "global_heads": int((~local).sum()),
        "histogram": np.histogram(fractions, bins=HIST_BINS, range=(0.0, 1.0))[0].tolist(),
        "bimodality_coefficient": _bimodality_coefficient(fractions),
        "dense_loss": dense_loss,
        "eps_sweep": sweep_rows,
        "maps": [{k: v for k, v in m.items() if k not in ("D", "A")} for m in maps],
        "map_tokens": n_map,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    files = _write_plots(results, maps, out_dir)
    for stale in out_dir.glob("head_L*_H*.png"):  # an earlier evaluation's maps of other heads
        if stale.name not in files.values():
            stale.unlink()
    results["files"] = files
    results["elapsed_s"] = time.perf_counter() - t0
    write_text_atomic(out_dir / "results.json", json.dumps(results, indent=2))
    write_text_atomic(out_dir / "summary.md", _summary(results))
    return results


_COLORS = {"local": "tab:orange", "global": "tab:blue"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _write_plots(results: dict, maps: list[dict], out_dir: Path) -> dict:
    """Writes every PNG; returns ``{role: file name}`` (names relative to ``out_dir``)."""
    files = {
        "heads": _plot_heads(results, out_dir / "heads.png"),
        "layers": _plot_layers(results, out_dir / "layers.png"),
        "eps": _plot_eps(results, out_dir / "eps.png"),
    }
    for m in maps:
        name = f"head_L{m['layer']}_H{m['head']}.png"
        _plot_head_map(results, m, out_dir / name)
        m_json = next(x for x in results["maps"] if (x["layer"], x["head"]) == (m["layer"], m["head"]))
        m_json["file"] = name
        files[f"map L{m['layer']} H{m['head']}"] = name
    return files


def _save(fig, path: Path) -> str:
    return save_figure(fig, path, dpi=120).name


def _plot_heads(r: dict, path: Path) -> str:
    """Figure 4 of the ACP paper (the histogram), stacked by head class, and each head's
    memory length against its pruned fraction."""
    plt = _plt()
    heads = r["heads"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    edges = np.linspace(0, 100, HIST_BINS + 1)
    bottom = np.zeros(HIST_BINS)
    for kind in ("local", "global"):
        vals = [100 * h["pruned"] for h in heads if h["kind"] == kind]
        counts = np.histogram(vals, bins=edges)[0] / len(heads)
        ax.bar(edges[:-1], counts, width=5, bottom=bottom, align="edge", color=_COLORS[kind],
               edgecolor="white", label=f"{kind} heads ({len(vals)})")
        bottom += counts
    ax.axvline(100 * r["max_pruned_fraction"], color="grey", ls="--", lw=1,
               label="most ACP can prune at this length")
    ax.axvline(100 * r["max_pruned_fraction_no_reset"], color="grey", ls=":", lw=1,
               label="... without a one-step reset (tile beside the diagonal kept)")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 1.0)
    ax.set_xlabel("pruned attention FLOPs of the head (%)")
    ax.set_ylabel("share of heads")
    bc = r["bimodality_coefficient"]
    ax.set_title(f"per-head pruning, {len(heads)} heads, T = {r['seq_len']}"
                 + (f" (bimodality coef. {bc:.2f})" if bc is not None else ""))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax.grid(alpha=0.3, axis="y")
    for kind in ("local", "global"):
        hs = [h for h in heads if h["kind"] == kind]
        bx.scatter([h["memory_length"] for h in hs], [100 * h["pruned"] for h in hs],
                   c=_COLORS[kind], s=28, label=kind, edgecolor="black", linewidth=0.3)
    for m in r["maps"]:  # the drawn heads, named as their map files are
        h = next(h for h in heads if (h["layer"], h["head"]) == (m["layer"], m["head"]))
        bx.scatter([h["memory_length"]], [100 * h["pruned"]], s=110, facecolors="none", edgecolors="black")
        bx.annotate(f"L{h['layer']} H{h['head']}", (h["memory_length"], 100 * h["pruned"]), fontsize=8,
                    xytext=(6, 6), textcoords="offset points")
    bx.axvline(r["local_fraction"] * r["seq_len"], color="grey", ls="--", lw=1)
    bx.text(r["local_fraction"] * r["seq_len"], 2, f" local | global\n ({r['local_fraction']:g} T)",
            fontsize=8, color="grey", ha="center")
    bx.set_xscale("log")
    bx.margins(x=0.12)
    bx.set_ylim(-3, 103)
    bx.set_xlabel("memory length 1 / -mean(log f)  (tokens, log scale)")
    bx.set_ylabel("pruned attention FLOPs (%)")
    bx.set_title("local vs global heads (circled: the heads drawn)")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return _save(fig, path)


def _plot_layers(r: dict, path: Path) -> str:
    """Per-layer mean pruned fraction with each head's value, and Figure 5 of the ACP paper
    (each layer's distribution of per-head pruned fractions)."""
    plt = _plt()
    pruned = np.array(r["pruned_per_head"]) * 100  # [L, H]
    n_layers, n_heads = pruned.shape
    kinds = np.array([[h["kind"] for h in r["heads"] if h["layer"] == i] for i in range(n_layers)])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    ax.bar(np.arange(n_layers), pruned.mean(1), color="lightgrey", edgecolor="grey", label="layer mean")
    rng = np.random.default_rng(0)  # jitter only spreads the dots sideways
    for kind in ("local", "global"):
        li, hi = np.nonzero(kinds == kind)
        ax.scatter(li + rng.uniform(-0.25, 0.25, len(li)), pruned[li, hi], s=14, c=_COLORS[kind],
                   label=f"{kind} head", zorder=3)
    ax.axhline(100 * r["max_pruned_fraction"], color="grey", ls="--", lw=1, label="most ACP can prune")
    ax.set_xticks(np.arange(n_layers))
    ax.set_xlabel("layer")
    ax.set_ylabel("pruned attention FLOPs (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"pruned fraction per layer (eps = {_eps_label(r['acp_eps'], tex=True)}, all heads "
                 f"{100 * r['pruned_fraction']:.1f}%)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4)
    ax.grid(alpha=0.3, axis="y")
    edges = np.linspace(0, 100, HIST_BINS + 1)
    dist = np.stack([np.histogram(pruned[i], bins=edges)[0] / n_heads for i in range(n_layers)])  # [L, bins]
    im = bx.imshow(100 * dist.T, origin="lower", aspect="auto", cmap="Greens", vmin=0, vmax=100,
                   extent=(-0.5, n_layers - 0.5, 0, 100))
    bx.set_xticks(np.arange(n_layers))
    bx.set_xlabel("layer")
    bx.set_ylabel("pruned attention FLOPs (%), bins of 5%")
    bx.set_title("share of each layer's heads per bin")
    fig.colorbar(im, ax=bx, label="% of the layer's heads")
    fig.tight_layout()
    return _save(fig, path)


def _plot_eps(r: dict, path: Path) -> str:
    """Figure 7 of the ACP paper: pruned fraction against eps, each point labelled with its
    validation loss; and the loss against eps with ACP off as the reference."""
    plt = _plt()
    rows = r["eps_sweep"]
    x = [row["log_eps"] for row in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax.plot(x, [100 * row["pruned"] for row in rows], "o-", color="tab:green")
    for row in rows:
        ax.annotate(f"loss {row['loss']:.4f}", (row["log_eps"], 100 * row["pruned"]), fontsize=7,
                    xytext=(0, 7), textcoords="offset points", ha="center")
    own = next(row for row in rows if math.isclose(row["eps"], r["acp_eps"], rel_tol=1e-9))
    ax.plot([own["log_eps"]], [100 * own["pruned"]], "*", ms=14, color="tab:red", label="the model's eps")
    ax.axhline(100 * r["max_pruned_fraction"], color="grey", ls="--", lw=1, label="most ACP can prune")
    ax.set_ylabel("pruned attention FLOPs, all heads (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"effect of eps (T = {r['seq_len']}, {r['num_sequences']} windows)")
    ax.legend(fontsize=8, loc="lower right")
    bx.plot(x, [row["loss"] for row in rows], "o-", color="tab:purple", label="ACP on")
    bx.axhline(r["dense_loss"], color="black", ls="--", lw=1, label=f"ACP off ({r['dense_loss']:.4f})")
    bx.set_ylabel("validation loss (nats / token)")
    bx.set_title("loss with ACP at each eps")
    bx.legend(fontsize=8)
    span = max(abs(row["loss_change"]) for row in rows)
    if span < 1e-4:  # identical losses: a readable window instead of matplotlib's offset axis
        bx.set_ylim(r["dense_loss"] - 1e-3, r["dense_loss"] + 1e-3)
    bx.ticklabel_format(axis="y", useOffset=False)
    for a in (ax, bx):
        a.margins(x=0.08)
        a.set_xlabel("eps (log scale)")
        a.set_xticks(x, [_eps_label(row["eps"], tex=True) for row in rows])
        a.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def _staircase(block_start: list[int], n: int, block: int = ACP_BLOCK) -> tuple[list[float], list[float]]:
    """The pruning boundary as a line in matrix coordinates (x: key, y: query), cut at ``n``."""
    xs, ys = [], []
    for m, s in enumerate(block_start):
        y0, y1 = m * block, min((m + 1) * block, n)
        if y0 >= n:
            break
        x = min(s * block, n)
        xs += [x, x]
        ys += [y0, y1]
    return xs, ys


def _plot_head_map(r: dict, m: dict, path: Path) -> str:
    """Figure 6 of the ACP paper for one head: ``D`` with the pruning boundary, and the
    attention weights beside it."""
    plt = _plt()
    d, a = m["D"], m["A"]
    n = d.shape[0]
    delta = m["delta"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5.4))
    ext = (0, n, n, 0)
    dmin = 2 * delta  # clip: the boundary (D = delta) then sits mid-scale
    upper = np.triu(np.ones((n, n), dtype=bool), 1)
    cmap_d = plt.get_cmap("viridis").with_extremes(bad="whitesmoke")
    im = ax.imshow(np.ma.masked_where(upper, np.clip(d, dmin, 0)), cmap=cmap_d, vmin=dmin, vmax=0,
                   extent=ext, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03,
                 label=f"D_ij = c_i - c_j (clipped at 2 delta = {dmin:.1f})")
    if np.isfinite(d[~upper]).any() and (d[~upper] < delta).any() and (d[~upper] > delta).any():
        centres = np.arange(n) + 0.5
        ax.contour(centres, centres, np.where(upper, np.nan, d), levels=[delta], colors="white",
                   linewidths=0.8, linestyles="--")
    cmap_a = plt.get_cmap("magma").with_extremes(bad="whitesmoke")
    la = np.log10(np.clip(a, 1e-6, 1))
    im = bx.imshow(np.ma.masked_where(upper, la), cmap=cmap_a, vmin=-4, vmax=0, extent=ext,
                   interpolation="nearest")
    fig.colorbar(im, ax=bx, fraction=0.046, pad=0.03, label="log10 attention weight (below -4: darkest)")
    xs, ys = _staircase(m["block_start"], n)
    n_tiles = -(-n // ACP_BLOCK)
    for axis in (ax, bx):
        if n_tiles <= 32:
            for g in range(ACP_BLOCK, n, ACP_BLOCK):
                axis.axhline(g, color="white", lw=0.4, alpha=0.35)
                axis.axvline(g, color="white", lw=0.4, alpha=0.35)
        label = "pruning boundary (tiles left of it skipped)" if any(m["block_start"]) else (
            "pruning boundary: no tile pruned")
        axis.plot(xs, ys, color="tab:orange", lw=2.2, label=label)
        axis.set_xlim(0, n)
        axis.set_ylim(n, 0)
        axis.set_xlabel("key position j")
        axis.set_ylabel("query position i")
    ax.plot([], [], color="white", ls="--", lw=0.8, label="D = delta (pair level)")
    ax.legend(fontsize=7, loc="upper right", facecolor="lightgrey")
    crop = "" if n == r["seq_len"] else f", first {n} of {r['seq_len']} tokens"
    ax.set_title(f"decay D, layer {m['layer']} head {m['head']} ({m['kind']}){crop}\n"
                 f"delta = {delta:.1f} (U = {m['u']:.2f}, eps = {_eps_label(r['acp_eps'], tex=True)}), "
                 f"pruned {100 * m['op_pruned_fraction']:.1f}% of this window", fontsize=10)
    bx.set_title(f"attention weights softmax(scale q k^T + D)\nmemory length {m['memory_length']:.3g} "
                 f"tokens, mean attention distance {m['mean_attention_distance']:.1f}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def _summary(r: dict) -> str:
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    lines = [
        f"# ACP statistics: {r['name']}",
        "",
        f"`{r['arch']}` on {r['num_sequences']} validation windows of {r['seq_len']} tokens (seed "
        f"{r['seed']}), ACP tiles of {r['block']} x {r['block']}, eps = {_eps_label(r['acp_eps'])} "
        f"(the model's), bound U from {r['acp_bound']}.",
        "",
        f"- pruned attention FLOPs, all heads: **{pct(r['pruned_fraction'])}** (at most "
        f"{pct(r['max_pruned_fraction'])} can be pruned at this length: every off-diagonal tile; "
        f"{pct(r['max_pruned_fraction_no_reset'])} unless a single gate falls below delta, since the "
        "tile beside the diagonal holds pairs one step apart)",
        f"- per layer: {', '.join(pct(x) for x in r['pruned_per_layer'])}",
        f"- heads: {r['local_heads']} local, {r['global_heads']} global ({r['local_rule']}; "
        f"local_fraction = {r['local_fraction']:g})",
    ]
    bc = r["bimodality_coefficient"]
    if bc is not None:
        verdict = "two modes or a strong skew" if bc > 5 / 9 else "no sign of two modes"
        lines.append(f"- bimodality coefficient of the per-head pruned fractions: {bc:.2f} ({verdict}: "
                     "above 5/9, the value of a uniform distribution, hints at two modes, but a "
                     "skewed single mode can also pass it; read the histogram)")
    lines += [
        "",
        "![per-head pruning](heads.png)",
        "",
        "![per-layer pruning](layers.png)",
        "",
        "## Decay and attention maps",
        "",
        "Orange: the pruning boundary the attention op used (tiles left of it were skipped); white "
        "dashes: where `D_ij` crosses delta pair by pair. Each boundary is checked against a direct "
        "tile-by-tile test of `D` (max of `D` over the tile < delta = -2U - log T + log eps).",
        "",
        "| layer | head | kind | memory length | pruned (this window) | direct check | boundary agrees |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in r["maps"]:
        lines.append(f"| {m['layer']} | {m['head']} | {m['kind']} | {m['memory_length']:.3g} | "
                     f"{pct(m['op_pruned_fraction'])} | {pct(m['direct_pruned_fraction'])} | "
                     f"{'yes' if m['boundary_agrees'] else 'NO'} |")
    lines.append("")
    for m in r["maps"]:
        lines += [f"![layer {m['layer']} head {m['head']}]({m['file']})", ""]
    lines += [
        "## Effect of eps",
        "",
        f"ACP off: loss {r['dense_loss']:.5f}.",
        "",
        "| eps | pruned | loss | loss change vs ACP off |",
        "|---|---|---|---|",
    ]
    for row in r["eps_sweep"]:
        own = " (the model's)" if math.isclose(row["eps"], r["acp_eps"], rel_tol=1e-9) else ""
        lines.append(f"| {_eps_label(row['eps'])}{own} | {pct(row['pruned'])} | {row['loss']:.5f} | "
                     f"{row['loss_change']:+.2e} |")
    lines += ["", "![effect of eps](eps.png)", "", "Files: `results.json` (every number above).", ""]
    return "\n".join(lines)
