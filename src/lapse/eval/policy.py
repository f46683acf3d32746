"""Loss under an eviction policy, streamed through the cache as the policy leaves it, and
two label-free measures, for lapse and Hugging Face models alike.

:func:`streamed_loss` feeds each window the way :func:`lapse.generation.generate` decodes,
through an :class:`~lapse.hf.EvictingCache` (a lapse model in its Hugging Face adapter, or
a LLaMA-family model: one code path): the first ``prefix`` tokens are prefilled into its
paged store, the policy cuts it, then the remaining tokens go in one at a time, with an
eviction pass before every ``policy.every``-th step. ``chunk`` c > 1 is a chunked prefill
with eviction between chunks: a pass before every ``policy.every``-th chunk of c tokens,
none inside one; the tokens still go one per forward (the paged store takes a prefill,
then one token per step), which gives the same logits as a c-token forward over the kept
tokens, at the cost of c forwards. Each step's logits score the next token of the window
(teacher forcing). The same tokens run in lockstep through a store that keeps everything
(the dense model), which gives

- the **KL divergence** ``KL(p_dense || p_policy)`` of the next-token distributions, per
  position;
- the **attention-mass recall**: at each step and layer, the share of the dense model's
  attention (of that step's query, over every key up to its position) that falls on the
  positions the policy's store holds at that step (its snapshot after the step's token is
  appended, :meth:`lapse.kv.PagedStore.snapshot`), averaged over heads. Dense gives 1.

Positions scored: a window of ``L`` tokens predicts at positions ``prefix .. L - 2`` (the
tokens fed one by one; the prefill's own last prediction comes before any eviction, so it
is the dense one and is left out). ``lapse eval policy-loss`` (:class:`PolicyLossConfig`,
:func:`run_policy_loss`) runs it on a model's validation windows (picked as ``lapse eval
ppl`` picks them) and writes ``results.json``, ``summary.md`` and ``policy_loss.png``.

Cost: two decodes per token (policy and dense), each ``O(position)`` attention, so
``O(L^2)`` per window and layer (no faster than a full forward, and one step per token:
a tool for studies on small models or short windows, not for long-document throughput);
the recall costs one snapshot of the policy's store per layer and step (a gather of what
it holds) and reads the dense run's attention probabilities, which its decode step
returns anyway (``return_key_probs``, the same per-slot probabilities H2O accumulates),
so no extra attention pass is made.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from lapse.data import CorpusConfig
from lapse.eval.common import check_out_dir, default_eval_dir, eval_name, eval_windows
from lapse.eval.config import PolicyLossConfig
from lapse.eval.lm import EvalLM, as_causal_lm, load_lm, text_windows
from lapse.files import save_figure, write_text_atomic
from lapse.generation import Dense, Policy
from lapse.hf import CACHE_ARG, EvictingCache, LapseForCausalLM
from lapse.hf.evicting import records_scores
from lapse.kv import LayerSnapshot
from lapse.ops.backend import resolve_device


@dataclass(frozen=True, kw_only=True)
class _LastStepProbs(Dense):
    """Keeps everything, and has the store track scores with decay 0, so that each slot's
    score is the last step's attention on it (per logical slot, summed over each kv head's
    query heads): the dense model's attention, read for the recall."""

    @property
    def score_decay(self) -> float:
        return 0.0


@dataclass
class StreamedLoss:
    """What :func:`streamed_loss` measured. ``S = L - 1 - prefix`` scored positions; the
    dense run's measures are ``None`` with ``compare=False``."""

    positions: Tensor
    """``[S]`` int64: the position of each prediction (``prefix .. L - 2``)."""
    loss: Tensor
    """``[N, S]`` float32: cross-entropy of the next token under the policy."""
    dense_loss: Tensor | None
    """``[N, S]`` float32: the same with every token kept."""
    kl: Tensor | None
    """``[N, S]`` float32: ``KL(p_dense || p_policy)`` of the next-token distributions (nats)."""
    recall: Tensor | None
    """``[N, n_layers, S]`` float32: share of the dense attention on the kept positions,
    averaged over heads."""
    kv_share: Tensor
    """``[N]`` float64: ``bytes_held / bytes_if_dense`` of the policy's store, averaged over
    the steps (after each step; both in whole pages, the pages reserved for the next steps
    included, as ``lapse generate`` reports)."""
    kv_bytes: Tensor
    """``[N]`` float64: ``bytes_held`` averaged over the steps."""
    token_share: Tensor
    """``[N]`` float64: tokens held after each step (over layers and kv heads) against the
    positions so far, averaged over the steps: the share without page rounding."""
    greedy: Tensor
    """``[N, S]`` bool: the policy's most likely next token is the window's."""


def streamed_loss(
    model: nn.Module,
    windows: Tensor,
    policy: Policy,
    *,
    prefix: int,
    chunk: int = 1,
    compare: bool = True,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> StreamedLoss:
    """Per-position loss of ``model`` on ``windows`` under ``policy``, beside the dense
    model's, with the KL divergence and the attention-mass recall (module doc).

    Args:
        model: a lapse :class:`~lapse.models.Decoder` that decodes over a paged store
            (``lapse.generation.supports_paged``), the lapse adapter, or a LLaMA-family
            Hugging Face causal LM; in ``eval()`` mode.
        windows: int64 ``[N, L]`` token ids; position ``i`` predicts ``windows[:, i + 1]``.
        policy: an eviction policy; ``Dense()`` gives loss = dense loss, KL 0, recall 1
            (NaN where the layers record no attention scores: DCP's).
        prefix: tokens prefilled before the first eviction, ``1 <= prefix <= L - 2``.
        chunk: tokens after the prefix fed per forward (the policy's pass runs before every
            ``policy.every``-th forward); 1 is ``lapse generate``'s schedule (module doc).
        compare: run the dense model beside it (loss, KL, recall); ``False``: the policy only.
        device: where to run; default the model's.
        batch_size: windows decoded together (each keeps its own tokens); default all.
        progress: a tqdm bar over the steps.

    Returns:
        a :class:`StreamedLoss`. Raises ``ValueError`` for windows that are not
        ``[N, L]`` token ids of the model's vocabulary, a prefix or chunk out of range, a
        policy that does not fit the model (naming its family), or a window longer than
        the model's context.
    """
    lm = as_causal_lm(model)
    if not isinstance(windows, Tensor) or windows.dim() != 2 or windows.is_floating_point():
        raise ValueError(f"windows must be an integer tensor [num, length], got {windows!r:.80}")
    n, length = windows.shape
    if isinstance(prefix, bool) or not isinstance(prefix, int) or not 1 <= prefix <= length - 2:
        raise ValueError(
            f"prefix must be an integer in [1, {length - 2}] (a window of {length} tokens predicts at "
            f"positions prefix .. {length - 2}), got {prefix!r}"
        )
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    vocab = lm.config.vocab_size
    if n == 0 or int(windows.max()) >= vocab or int(windows.min()) < 0:
        raise ValueError(
            f"windows must hold at least one row of token ids in [0, {vocab}), got {tuple(windows.shape)}"
        )
    device = next(lm.parameters()).device if device is None else resolve_device(device)
    batch_size = n if batch_size is None else batch_size
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    steps = length - 1 - prefix
    check_fits(lm, policy, prefix, length - 1)
    parts = []
    bar = tqdm(total=n * steps, desc=f"{type(policy).__name__} streamed", unit="tok", disable=not progress)
    try:
        for b0 in range(0, n, batch_size):
            ids = windows[b0 : b0 + batch_size].to(device)  # [B, L]
            parts.append(_stream(lm, ids, policy, prefix, chunk, compare, bar))
    finally:
        bar.close()
    return StreamedLoss(
        positions=torch.arange(prefix, length - 1),
        **{k: None if parts[0][k] is None else torch.cat([p[k] for p in parts]) for k in parts[0]},
    )


def check_fits(model: nn.Module, policy: Policy, prompt_len: int, total: int) -> None:
    """Raises ``ValueError`` when ``policy`` does not fit ``model`` (a policy for another
    family, naming it; a lapse kind that does not decode over a paged store), or when
    ``total`` positions (prompt + what is scored after it) exceed the model's context."""
    lm = as_causal_lm(model)
    EvictingCache(policy, model=lm)  # checks the policy against the model (and switches HF attention)
    limit = lm.config.max_position_embeddings
    if total > limit and not isinstance(lm, LapseForCausalLM):  # a lapse model runs past its
        # training context (the dense path's results mark it as extrapolation); a Hugging Face
        # model's position embeddings may not
        raise ValueError(
            f"{total} positions (the prompt of {prompt_len} and what follows it) exceed the model's context "
            f"of {limit} (max_position_embeddings): shorten the prompt or the windows"
        )
    policy.check_context(prompt_len, total)


def policy_cache(lm: nn.Module, policy: Policy, total: int, chunk: int = 1) -> EvictingCache:
    """An :class:`~lapse.hf.EvictingCache` for ``total`` positions whose passes run every
    ``policy.every`` forwards of ``chunk`` tokens, the tokens being fed one at a time (the
    paged store takes a prefill, then one token per step): no eviction inside a chunk, so
    every logit equals that of a chunked prefill with eviction between chunks."""
    return EvictingCache(replace(policy, every=policy.every * chunk), model=lm, max_context=total)


@torch.no_grad()
def next_logits(lm: nn.Module, ids: Tensor, cache: EvictingCache) -> Tensor:
    """One forward of ``ids`` ``[B, T]`` through ``cache``; the last position's logits
    ``[B, V]`` in float32."""
    return lm(input_ids=ids, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1).logits[:, -1].float()


@torch.no_grad()
def greedy_continuation(model: nn.Module, ids: Tensor, n: int, policy: Policy) -> Tensor:
    """``n`` tokens ``[B, n]`` that continue ``ids`` ``[B, T]`` greedily under ``policy``, by
    the protocol of :func:`streamed_loss` with ``prefix = T - 1``: the prompt less its last
    token prefilled, the policy's cut, then the last token and each new one fed one at a
    time, so every new token is predicted from the cache as the policy leaves it."""
    lm = as_causal_lm(model)
    t = ids.shape[1]
    if t < 2:
        raise ValueError(f"a prompt continued under a policy needs at least 2 tokens, got {t}")
    check_fits(lm, policy, t - 1, t + n - 1)
    cache = policy_cache(lm, policy, t + n - 1)
    next_logits(lm, ids[:, :-1], cache)
    token, new = ids[:, -1:], []
    for _ in range(n):
        token = next_logits(lm, token, cache).argmax(-1, keepdim=True)  # [B, 1]
        new.append(token)
    return torch.cat(new, dim=1)


@torch.no_grad()
def _stream(
    lm: nn.Module, ids: Tensor, policy: Policy, prefix: int, chunk: int, compare: bool, bar: tqdm
) -> dict[str, Tensor | None]:
    """One batch of windows ``[B, L]`` through the policy's cache and the dense one."""
    b, length = ids.shape
    steps = length - 1 - prefix
    n_layers = lm.config.num_hidden_layers
    cache = policy_cache(lm, policy, length - 1, chunk)
    scored = records_scores(lm)  # else (DCP) no recall: the dense run keeps no scores to read it from
    reference = _LastStepProbs() if scored else Dense()
    dense = EvictingCache(reference, model=lm, max_context=length - 1) if compare else None
    for c in (cache, dense) if compare else (cache,):
        next_logits(lm, ids[:, :prefix], c)
    loss, greedy = torch.empty(b, steps), torch.empty(b, steps, dtype=torch.bool)
    dense_loss, kl = torch.empty(b, steps), torch.empty(b, steps)
    recall = torch.full((b, n_layers, steps), float("nan"))  # NaN where the layers record no scores
    share, held, tokens = (torch.zeros(b, dtype=torch.float64) for _ in range(3))
    for i in range(steps):
        token = ids[:, prefix + i : prefix + i + 1]  # [B, 1] position prefix + i
        target = ids[:, prefix + i + 1]  # [B]
        logp = F.log_softmax(next_logits(lm, token, cache), dim=-1)  # [B, V]
        loss[:, i] = -logp.gather(1, target[:, None])[:, 0].cpu()
        greedy[:, i] = (logp.argmax(-1) == target).cpu()
        store = cache.store
        if compare:
            logq = F.log_softmax(next_logits(lm, token, dense), dim=-1)  # [B, V] dense
            dense_loss[:, i] = -logq.gather(1, target[:, None])[:, 0].cpu()
            kl[:, i] = (logq.exp() * (logq - logp)).sum(-1).clamp_min(0).cpu()
        for layer in range(n_layers):
            snap = store.snapshot(layer)
            if compare and scored:
                seen = dense.store.snapshot(layer)  # slot j holds position j: it never evicts
                recall[:, layer, i] = kept_mass(seen.scores * seen.valid, snap).cpu()
            held_now = snap.valid.sum((1, 2)) / (snap.valid.shape[1] * snap.seqlens)  # [B]
            tokens += held_now.double().cpu() / n_layers
        now = store.bytes_held()  # the whole batch's: each window is given its share
        held += now / b
        share += now / store.bytes_if_dense()
        bar.update(b)
    return {"loss": loss, "dense_loss": dense_loss if compare else None, "kl": kl if compare else None,
            "recall": recall if compare else None, "kv_share": share / steps, "kv_bytes": held / steps,
            "token_share": tokens / steps, "greedy": greedy}


def kept_mass(probs: Tensor, snap: LayerSnapshot) -> Tensor:
    """The share of attention ``probs`` ``[B, K, W]`` (slot ``j`` = position ``j``, summed
    over each kv head's query heads) that falls on the positions ``snap`` holds, per
    sequence, averaged over the kv heads: ``[B]``. Each query head's row sums to 1, so
    this is the average over query heads of each one's kept mass."""
    w = probs.shape[-1]
    held = snap.valid & (snap.positions < w)  # [B, K, Ws]
    index = torch.where(held, snap.positions, w)  # [B, K, Ws]: not held -> a spare column
    kept = torch.zeros(*probs.shape[:2], w + 1, dtype=torch.bool, device=probs.device)
    kept.scatter_(2, index, True)
    mass = (probs * kept[..., :w]).sum(-1) / probs.sum(-1)  # [B, K]
    return mass.mean(-1)


# -- lapse eval policy-loss ---------------------------------------------------------------


def model_windows(
    model: EvalLM, seq_len: int, num: int, *, seed: int, corpus: CorpusConfig | None, data_dir: Path | None
) -> Tensor:
    """``[num, seq_len + 1]`` validation windows for ``model``: a lapse run's as ``lapse
    eval ppl`` picks them, a Hugging Face model's from :func:`~lapse.eval.lm.text_windows`."""
    if model.loaded is not None:
        return eval_windows(model.loaded, seq_len, num, seed=seed, corpus=corpus, data_dir=data_dir)
    return text_windows(model.tokenizer, corpus, seq_len, num, seed=seed)


def run_policy_loss(cfg: PolicyLossConfig) -> dict:
    """Loads the model, picks the windows, runs :func:`streamed_loss`, writes
    ``results.json`` (this return value), ``summary.md`` and ``policy_loss.png`` into
    ``cfg.out_dir`` (default ``<model>/eval/policy-loss-<policy>/``)."""
    if cfg.model is not None and not Path(cfg.model).exists():
        raise ValueError(f"model path does not exist: {cfg.model}")
    out_dir = cfg.out_dir or default_eval_dir(cfg.model, eval_name("policy-loss", cfg.policy))
    check_out_dir(out_dir, cfg.overwrite)
    loaded = load_lm(cfg.model, cfg.hf, cfg.gguf_file, device=cfg.device)
    seq_len = cfg.seq_len if cfg.seq_len is not None else loaded.context
    prefix = cfg.prefix if cfg.prefix is not None else seq_len // 2
    if not 1 <= prefix < seq_len:
        raise ValueError(f"--prefix ({prefix}) must be in [1, --seq-len = {seq_len})")
    policy = cfg.make_policy()
    check_fits(loaded.lm, policy, prefix, seq_len)  # before the data is read
    windows = model_windows(loaded, seq_len, cfg.num_sequences, seed=cfg.seed, corpus=cfg.corpus,
                            data_dir=cfg.data_dir)  # [N, T + 1]
    r = streamed_loss(loaded.lm, windows, policy, prefix=prefix, chunk=cfg.chunk, batch_size=cfg.batch_size,
                      progress=cfg.progress)
    loss, dense = r.loss.double().mean(0), r.dense_loss.double().mean(0)  # [S]
    results = {
        "evaluation": "policy-loss",
        "config": _jsonable(asdict(cfg)),
        "model": loaded.name,
        "path": str(loaded.path),
        "arch": _arch(loaded),
        "policy": cfg.policy,
        "policy_repr": repr(policy),
        "seq_len": seq_len,
        "prefix": prefix,
        "num_sequences": windows.shape[0],
        "mean_loss": float(loss.mean()),
        "dense_mean_loss": float(dense.mean()),
        "delta": float((loss - dense).mean()),
        "mean_kl": float(r.kl.double().mean()),
        "recall": nan_to_none(r.recall.double().mean()),
        "recall_per_layer": [nan_to_none(x) for x in r.recall.double().mean((0, 2))],
        "kv_share": float(r.kv_share.mean()),
        "kv_bytes": float(r.kv_bytes.mean()),
        "token_share": float(r.token_share.mean()),
        "positions": r.positions.tolist(),
        "loss": loss.tolist(),
        "dense_loss": dense.tolist(),
        "kl": r.kl.double().mean(0).tolist(),
        "recall_per_position": [nan_to_none(x) for x in r.recall.double().mean((0, 1))],
        "sequence_losses": r.loss.double().mean(1).tolist(),
        "sequence_dense_losses": r.dense_loss.double().mean(1).tolist(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(results, out_dir / "policy_loss.png")
    write_text_atomic(out_dir / "summary.md", _summary(results))
    write_text_atomic(out_dir / "results.json", json.dumps(results, indent=1))
    return {**results, "out_dir": str(out_dir)}


def _arch(model: EvalLM) -> str:
    """A lapse model's kind name, or a Hugging Face model's ``model_type``."""
    return model.loaded.config.name if model.loaded is not None else model.lm.config.model_type


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else obj


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    x = np.asarray(r["positions"])
    ax.plot(x, r["loss"], lw=1.4, label=r["policy_repr"][:60])
    ax.plot(x, r["dense_loss"], lw=1.0, ls="--", color="0.2", label="dense")  # on top: visible where equal
    ax.set_xlabel("position i (predicting token i + 1)")
    ax.set_ylabel("loss (nats), mean over windows")
    ax.set_title(f"{r['model']}: streamed loss after a {r['prefix']}-token prefix, "
                 f"{r['num_sequences']} windows", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def nan_to_none(x) -> float | None:
    """A float for JSON, ``None`` for NaN (a recall the layers give no scores for)."""
    x = float(x)
    return None if x != x else x


def _summary(r: dict) -> str:
    per_layer = ", ".join("n/a" if x is None else f"{x:.4f}" for x in r["recall_per_layer"])
    recall = "n/a" if r["recall"] is None else f"{r['recall']:.4f}"
    if r["recall"] is None:
        per_layer = "n/a: this model's layers (DCP) record no attention scores to read it from"
    return "\n".join([
        "# Loss under an eviction policy",
        "",
        f"{r['model']} ({r['arch']}), {r['num_sequences']} validation windows of {r['seq_len']} tokens, "
        f"seed {r['config']['seed']}: the first {r['prefix']} tokens prefilled, the policy applied, then "
        f"one token per step (evicting as `lapse generate` does); loss over positions {r['prefix']} .. "
        f"{r['seq_len'] - 1}. Policy: `{r['policy_repr']}`.",
        "",
        "| policy | loss | dense loss | delta | mean KL | attention-mass recall | KV share | tokens held |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {r['policy']} | {r['mean_loss']:.4f} | {r['dense_mean_loss']:.4f} | {r['delta']:+.4f} "
        f"| {r['mean_kl']:.4g} | {recall} | {100 * r['kv_share']:.1f}% "
        f"| {100 * r['token_share']:.1f}% |",
        "",
        "Mean KL: `KL(p_dense || p_policy)` of the next-token distributions (nats), averaged over "
        "positions. Recall: the share of the dense model's attention (each step's query over all keys up "
        "to its position) on the positions the policy's store holds at that step, averaged over heads, "
        f"positions and layers (per layer: {per_layer}). KV share: bytes the policy's paged store holds "
        "against a dense cache's, averaged over the steps (whole pages, the next steps' included, so above "
        "100% for short windows); tokens held: the same without page rounding (tokens held over layers and "
        "heads against the positions so far).",
        "",
        "![loss per position](policy_loss.png)",
        "",
        "Files: `results.json` (per-position loss, dense loss, KL and recall; each window's mean loss).",
    ])
