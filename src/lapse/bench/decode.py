"""Decode-step speed: ms per token of a lapse model against Hugging Face's compiled Llama
and the memory-bandwidth limit (``lapse bench decode``).

For each workload (batch x prompt length) and architecture, a random-init model of the
preset's shapes prefills the prompt into a store with room for the steps, then runs
``warmup`` untimed and ``steps`` timed greedy decode steps; the figure is the wall time
of the timed steps over their number (the step is bound by the CPU when it is not
compiled, so device time alone would flatter it). Providers, measured in one process on
the same GPU:

- ``lapse``: :func:`lapse.generation.decode_one_token`, eager;
- ``lapse-compile``: :func:`lapse.generation.compiled_decode_one_token` (``torch.compile``
  with ``mode="reduce-overhead"``, ``fullgraph=True``: one CUDA graph per step);
- ``paged-<policy>`` (``--policies``): the compiled step over a
  :class:`~lapse.kv.PagedStore` under an eviction policy, the evictions (every
  ``--every`` steps, outside the step) inside the timed region; ``kv-<policy>``: the
  share of a dense cache's KV bytes the store holds at the end (whole pages, the next
  steps' pages included; the same pools on both sides), ``kv-vs-softmax-<policy>``: the
  bytes held over a softmax model's dense keys and values of the same tokens (a DCP
  model's interaction keys and drop flags counted against it); ``dcp`` on a DCP run;
- ``hf-llama-compile``: ``transformers``' ``LlamaForCausalLM`` of the same sizes (the
  LLaMA block: SwiGLU of the same width, RoPE, SDPA) with a ``StaticCache`` and its decode
  step compiled the same way, the recipe of the transformers documentation: what a user
  who compiles HF's Llama gets;
- ``hf-llama-eager``: the same model with its default ``DynamicCache``, eager.

The bandwidth limit is the bytes one step must read (every weight but the input
embedding once, the held keys and values, and FoX's float64 ``c``) over the HBM
bandwidth of the device.

Legend: B batch, T prompt, N steps, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from lapse.bench.commit import git_commit
from lapse.files import write_text_atomic
from lapse.generation import (
    POLICIES,
    compiled_decode_one_token,
    decode_one_token,
    evict,
    logit_bounds,
    paged_store_for,
    prefill,
)
from lapse.kv import DenseStore
from lapse.models import Decoder, param_count, preset
from lapse.models.checkpoint import latest_checkpoint, load_weights, read_run
from lapse.ops.backend import resolve_device

from .config import DECODE_PROVIDERS, POLICY_DEFAULTS, DecodeBenchConfig

# the attention kind whose state a policy reads (FoX's gates, DCP's drop flags): skipped on others
POLICY_NEEDS = {"acp": "forgetting", "dcp": "dcp"}
# HBM bandwidth (bytes/s) by device name, for the limit
HBM_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def _timed_steps(
    step: Callable[[torch.Tensor], torch.Tensor],
    token: torch.Tensor,
    cfg: DecodeBenchConfig,
    device: torch.device,
) -> float:
    """ms per step of ``warmup`` untimed then ``steps`` timed greedy steps (wall time)."""
    for _ in range(cfg.warmup):
        token = step(token).argmax(-1, keepdim=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(cfg.steps):
        token = step(token).argmax(-1, keepdim=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / cfg.steps * 1e3


@torch.no_grad()
def time_lapse(
    model: Decoder,
    ids: torch.Tensor,
    cfg: DecodeBenchConfig,
    *,
    compile: bool,
    make_store: Callable[..., object] = DenseStore,
) -> float:
    """ms per decode step of a lapse model after a prefill of the prompts ``ids`` ``[B, T]``."""
    device = next(model.parameters()).device
    store = make_store(model.config.n_layers, capacity=ids.shape[1] + cfg.warmup + cfg.steps + 1)
    token = prefill(model, ids, store).argmax(-1, keepdim=True)
    fn = _compiled_step(cfg) if compile else decode_one_token
    with model.fused_projections(keep=True):
        return _timed_steps(lambda tok: fn(model, tok, store), token, cfg, device)


def _compiled_step(cfg: DecodeBenchConfig) -> Callable[[Decoder, torch.Tensor, object], torch.Tensor]:
    if cfg.compile_backend == "aot_eager":
        return compiled_decode_one_token(mode=None, backend="aot_eager")
    return compiled_decode_one_token()


def _policy(name: str, cfg: DecodeBenchConfig):
    kwargs = {"every": cfg.value("every")}
    if name in ("h2o", "a2sf"):
        kwargs.update(budget=cfg.value("budget"))
    if name == "window":
        kwargs.update(window=cfg.value("window"))
    return POLICIES[name](**({} if name == "dense" else kwargs))


@torch.no_grad()
def time_paged(
    model: Decoder, ids: torch.Tensor, cfg: DecodeBenchConfig, name: str, detail: dict | None = None
) -> tuple[float, float, float, float]:
    """ms per compiled decode step over the paged store under policy ``name`` (evictions
    included) after a prefill of the prompts ``ids`` ``[B, T]``; the share of a dense
    cache's KV bytes it holds at the end (the same pools: a model's per-slot extras on
    both sides); that share against a softmax model's dense keys and values alone (what a
    DCP model's interaction keys and drop flags cost on top); and the ms per step of the
    evictions alone (timed between synchronisations, amortised).

    ``detail``, when given, is filled with where the time went: ``passes`` (per timed
    pass, ms of the layers' passes with the host's page accounting, and of the
    ``reserve`` after it) and, on CUDA, ``steps_after_pass`` / ``steps_other`` (the median
    ms of the device time between one step's start and the next's, for the 4 steps that
    follow a pass and for the rest: a pass whose cost spills into later steps shows there)."""
    device = next(model.parameters()).device
    policy = _policy(name, cfg)
    batch, prompt = ids.shape
    store = paged_store_for(model, batch, prompt, cfg.warmup + cfg.steps + 1, policy)
    token = prefill(model, ids, store).argmax(-1, keepdim=True)
    bounds = logit_bounds(model)
    fn = _compiled_step(cfg)
    count, evicting, passes, marks = [0], [0.0], [], []
    passes_backend = "aot_eager" if cfg.compile_backend == "aot_eager" else None  # None: compiled on CUDA
    cuda = device.type == "cuda"

    def step(tok: torch.Tensor) -> torch.Tensor:
        timed = count[0] >= cfg.warmup
        if cuda and timed and detail is not None:
            marks.append((count[0], torch.cuda.Event(enable_timing=True)))
            marks[-1][1].record()
        if count[0] % policy.every == 0:
            if cuda:  # the steps queued before the pass are not the pass's time
                torch.cuda.synchronize()
            start = time.perf_counter()
            evict(model, store, policy, bounds, compile=passes_backend)
            if cuda:
                torch.cuda.synchronize()
            middle = time.perf_counter()
            store.reserve(min(policy.every, cfg.warmup + cfg.steps - count[0]))
            if cuda:
                torch.cuda.synchronize()
            if timed:
                evicting[0] += time.perf_counter() - start
                passes.append((count[0], (middle - start) * 1e3, (time.perf_counter() - middle) * 1e3))
        count[0] += 1
        return fn(model, tok, store)

    with model.fused_projections(keep=True):
        ms = _timed_steps(step, token, cfg, device)
    if detail is not None:
        detail["passes"] = [dict(step=c, evict_ms=round(e, 3), reserve_ms=round(r, 3)) for c, e, r in passes]
        if len(marks) > 1:
            torch.cuda.synchronize()
            gaps = [(c, a.elapsed_time(b)) for (c, a), (_, b) in zip(marks, marks[1:], strict=False)]
            after = [g for c, g in gaps if 0 < c % policy.every <= 4]
            other = [g for c, g in gaps if c % policy.every > 4]
            for key, values in (("steps_after_pass", after), ("steps_other", other)):
                detail[key] = round(float(torch.tensor(values).median()), 4) if values else None
            plain = torch.tensor([g for c, g in gaps if c % policy.every])  # the steps without a pass
            if len(plain):
                detail["steps_mean"] = round(float(plain.mean()), 4)
                detail["steps_over_2x_median"] = int((plain > 2 * plain.median()).sum())
                detail["slowest"] = [(c, round(g, 3)) for c, g in sorted(gaps, key=lambda x: -x[1])[:6]]
    held = store.bytes_held()
    mc = model.config
    per_token = 2 * mc.n_layers * mc.kv_heads * mc.head_dim * store.k[0].element_size()  # K and V
    softmax_kv = per_token * int(store.seqlens.sum())
    return ms, held / store.bytes_if_dense(), held / softmax_kv, evicting[0] / cfg.steps * 1e3


@torch.no_grad()
def time_hf_llama(
    model_cfg,
    batch: int,
    prompt: int,
    cfg: DecodeBenchConfig,
    device: torch.device,
    dtype: torch.dtype,
    compile: bool = True,
) -> float:
    """ms per decode step of HF's LlamaForCausalLM of the same sizes: StaticCache + compile,
    or (``compile=False``) its default DynamicCache, eager."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

    from lapse.hf import CACHE_ARG

    capacity = prompt + cfg.warmup + cfg.steps + 1
    hf_cfg = LlamaConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.d_model,
        intermediate_size=model_cfg.mlp_hidden,
        num_hidden_layers=model_cfg.n_layers,
        num_attention_heads=model_cfg.n_heads,
        num_key_value_heads=model_cfg.kv_heads,
        max_position_embeddings=capacity,
        rope_theta=model_cfg.rope_base,
        tie_word_embeddings=False,
    )
    hf_cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype).eval()
    cache = StaticCache(config=hf_cfg, max_cache_len=capacity) if compile else DynamicCache(config=hf_cfg)
    ids = torch.randint(0, model_cfg.vocab_size, (batch, prompt), device=device)
    out = model(
        ids,
        cache_position=torch.arange(prompt, device=device),
        **{CACHE_ARG: cache},
        use_cache=True,
        logits_to_keep=1,
    )
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    position = torch.tensor([prompt], device=device)

    def hf_step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model(
            tok,
            position_ids=pos[None].expand(tok.shape[0], 1),
            cache_position=pos,
            use_cache=True,
            **{CACHE_ARG: cache},
        ).logits[:, -1]

    compiled = torch.compile(hf_step, mode="reduce-overhead", fullgraph=True) if compile else hf_step

    def step(tok: torch.Tensor) -> torch.Tensor:
        logits = compiled(tok, position)
        position.add_(1)
        return logits

    return _timed_steps(step, token, cfg, device)


def bandwidth_limit_ms(model_cfg, batch: int, tokens: float, itemsize: int, bandwidth: float) -> float:
    """ms to read every weight but the input embedding once, plus ``tokens`` held keys
    and values per sequence (and FoX's float64 ``c``) at ``bandwidth`` bytes/s."""
    with torch.device("meta"):
        weights = param_count(Decoder(model_cfg), non_embedding=True) * itemsize
    kv = 2 * model_cfg.n_layers * batch * tokens * model_cfg.kv_heads * model_cfg.head_dim * itemsize
    if model_cfg.attention == "forgetting":
        kv += model_cfg.n_layers * batch * tokens * model_cfg.n_heads * 8
    return (weights + kv) / bandwidth * 1e3


def _prompts(cfg: DecodeBenchConfig, model_cfg, batch: int, prompt: int, device) -> torch.Tensor:
    """``[B, T]`` prompt ids: uniform random tokens, or windows of ``cfg.run``'s validation data."""
    if cfg.prompts == "random":
        return torch.randint(0, model_cfg.vocab_size, (batch, prompt), device=device)
    from lapse.data import WindowSampler, prepare_data

    saved = read_run(cfg.run)
    data = prepare_data(
        saved.corpus,
        saved.tokenizer,
        vocab_size=model_cfg.vocab_size,
        data_dir=saved.data_dir,
        progress=False,
    )
    if data.validation is None:
        raise ValueError(f"--run {cfg.run}'s corpus has no validation split (val_fraction 0): random prompts")
    ids, _ = WindowSampler(shards=data.validation, seq_len=prompt, batch_size=batch, seed=7).batch(0)
    return ids.to(device)


def _model(cfg: DecodeBenchConfig, arch: str, prompt: int, device, dtype) -> tuple[object, Decoder]:
    """A random-init model of ``cfg.preset`` and ``arch``, or the trained ``cfg.run``; its
    context set to ``prompt`` (FoX has no position limit; RoPE tables follow)."""
    if cfg.run is None:
        model_cfg = preset(cfg.preset, arch, max_seq_len=prompt, castle_fold_every=cfg.castle_fold_every)
        return model_cfg, Decoder(model_cfg).to(device=device, dtype=dtype).eval()
    if not cfg.run.is_dir():
        raise FileNotFoundError(f"--run {cfg.run} is not a run folder")
    folder = latest_checkpoint(cfg.run)
    if folder is None:
        raise ValueError(f"--run {cfg.run} holds no checkpoint yet")
    model_cfg = dataclasses.replace(
        read_run(cfg.run).model, max_seq_len=max(prompt, read_run(cfg.run).model.max_seq_len)
    )
    model = Decoder(model_cfg)
    load_weights(folder, model)
    return model_cfg, model.to(device=device, dtype=dtype).eval()


def run(cfg: DecodeBenchConfig) -> dict:
    """Times every (workload, arch, provider), writes ``results.json`` and ``results.md``
    into ``cfg.out_dir``, prints the table and returns the results. Dynamo's recompile
    limit is raised to 64 for the call only (one compiled step per model and shape)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    with config.patch(name, max(getattr(config, name), 64)):
        return _run(cfg)


def _run(cfg: DecodeBenchConfig) -> dict:
    device = resolve_device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    bandwidth = cfg.bandwidth or next((bw for key, bw in HBM_BANDWIDTH.items() if key in name), None)
    rows = []
    for workload in cfg.workloads:
        batch, prompt = (int(x) for x in workload.split("x"))
        for arch in cfg.archs if cfg.run is None else ("run",):
            torch.manual_seed(0)
            model_cfg, model = _model(cfg, arch, prompt, device, dtype)
            arch = model_cfg.name if cfg.run is None else f"{model_cfg.name} ({cfg.run.name})"
            row = {"workload": workload, "batch": batch, "prompt": prompt, "arch": arch}
            ids = _prompts(cfg, model_cfg, batch, prompt, device)
            for provider in ("lapse", "lapse-compile"):
                if provider in cfg.providers:
                    row[provider] = time_lapse(model, ids, cfg, compile=provider == "lapse-compile")
                    print(f"{workload} {arch} {provider}: {row[provider]:.3f} ms/step", flush=True)
            for policy in cfg.policies:
                if POLICY_NEEDS.get(policy, model_cfg.attention) != model_cfg.attention:
                    continue
                detail: dict = {}
                ms, share, vs_softmax, evict_ms = time_paged(model, ids, cfg, policy, detail)
                row[f"paged-{policy}"], row[f"kv-{policy}"], row[f"evict-{policy}"] = ms, share, evict_ms
                row[f"detail-{policy}"] = detail
                row[f"kv-vs-softmax-{policy}"] = vs_softmax
                print(
                    f"{workload} {arch} paged {policy}: {ms:.3f} ms/step ({evict_ms:.3f} evicting), "
                    f"KV {100 * share:.1f}% of dense ({100 * vs_softmax:.1f}% of a softmax model's K, V)",
                    flush=True,
                )
            if bandwidth is not None:
                row["limit"] = bandwidth_limit_ms(
                    model_cfg,
                    batch,
                    prompt + cfg.warmup + cfg.steps / 2,
                    torch.finfo(dtype).bits // 8,
                    bandwidth,
                )
            rows.append(row)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        hf_row = {"workload": workload, "batch": batch, "prompt": prompt, "arch": "hf-llama"}
        for provider in ("hf-llama-compile", "hf-llama-eager"):
            if provider in cfg.providers:
                if cfg.run is None:
                    model_cfg = preset(cfg.preset, "transformer-llama")
                else:  # the run's sizes in a LLaMA block
                    model_cfg = dataclasses.replace(model_cfg, attention="softmax", block="llama", acp=False,
                                                    castle_window=None)
                compiled = provider == "hf-llama-compile"
                ms = time_hf_llama(model_cfg, batch, prompt, cfg, device, dtype, compile=compiled)
                hf_row[provider] = ms
                print(f"{workload} {provider}: {hf_row[provider]:.3f} ms/step", flush=True)
        if len(hf_row) > 4:
            rows.append(hf_row)
    env = {
        "device": name,
        "torch": torch.__version__,
        "commit": cfg.commit or git_commit() or "unknown",
        "date": time.strftime("%Y-%m-%d"),
        "dtype": cfg.dtype,
        "preset": cfg.preset if cfg.run is None else None,
        "run": None if cfg.run is None else str(cfg.run),
        "prompts": cfg.prompts,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "bandwidth": bandwidth,
    }
    config = {**asdict(cfg), **{k: cfg.value(k) for k in POLICY_DEFAULTS}}  # the values timed
    results = {"env": env, "config": {k: str(v) for k, v in config.items()}, "rows": rows}
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(cfg.out_dir / "results.json", json.dumps(results, indent=2))
    table = markdown_table(results)
    write_text_atomic(cfg.out_dir / "results.md", table)
    print(table)
    return results


def markdown_table(results: dict) -> str:
    """ms per decode step, one row per (workload, arch), providers as columns."""
    env = results["env"]
    extra = [k for r in results["rows"] for k in r if k.startswith(("paged-", "kv-", "evict-"))]
    cols = (
        [p for p in DECODE_PROVIDERS if any(p in r for r in results["rows"])]
        + list(dict.fromkeys(extra))
        + ["limit"]
    )
    what = f"{env['preset']} shapes, random init" if env.get("run") is None else f"trained run {env['run']}"
    what += f", {env.get('prompts', 'random')} prompts"
    lines = [
        f"Decode step, {what}, {env['dtype']}, {env['device']}, "
        f"torch {env['torch']}, "
        f"commit {env['commit']}, {env['date']}: ms per step (wall time of {env['steps']} greedy steps after "
        f"{env['warmup']} warm-up step{'s' if env['warmup'] != 1 else ''}; "
        + (f"limit: bytes read once at {env['bandwidth']} B/s)" if env.get("bandwidth") else
           "limit: none, no memory bandwidth known for this device)"),
        "",
        "| workload | model | " + " | ".join(cols) + " |",
        "| --- | --- | " + " | ".join("---" for _ in cols) + " |",
    ]
    for r in results["rows"]:
        cells = [f"{r[c]:.3f}" if c in r else "" for c in cols]
        lines.append(f"| {r['workload']} | {r['arch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
