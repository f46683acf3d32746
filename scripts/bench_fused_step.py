"""The FoX decode step with its fused kernels against the separate steps (issue 12): ms
per compiled step (CUDA graphs) of a random-init model after a prefill, the two variants
timed alternately in one process (``--repeats`` rounds each, so the spread between rounds
shows the noise), and the largest difference of their first steps' logits.

"fused": ``ForgettingAttention._fused_step`` (the input side in one kernel, the output norm
and gate in the attention kernel's epilogue); "separate": the same model with that step
switched off (Inductor's kernels for the gates, the KV-shift, the QK-norm, the writes, the
output norm and gate).

    python scripts/bench_fused_step.py --workloads 8x4096 4x16384 2x32768 --out fused.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from lapse.bench.decode import DecodeBenchConfig, _timed_steps, bandwidth_limit_ms
from lapse.generation import compiled_decode_one_token, prefill
from lapse.kv import DenseStore
from lapse.models import Decoder, preset


@torch.no_grad()
def bench(arch: str, batch: int, prompt: int, args) -> dict:
    torch.manual_seed(0)
    cfg = preset(args.preset, arch, max_seq_len=prompt)
    fused_model = Decoder(cfg).cuda().to(torch.bfloat16).eval()
    separate_model = copy.deepcopy(fused_model)
    for block in separate_model.blocks:
        block.attn._fused_step = lambda *a, **k: None
    models = {"fused": fused_model, "separate": separate_model}
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device="cuda")
    timing = DecodeBenchConfig(steps=args.steps, warmup=args.warmup)
    stores, steps, first = {}, {}, {}
    with fused_model.fused_projections(keep=True), separate_model.fused_projections(keep=True):
        for variant, model in models.items():
            store = DenseStore(
                cfg.n_layers, capacity=prompt + (args.repeats + 1) * (args.warmup + args.steps) + 8
            )
            token = prefill(model, ids, store).argmax(-1, keepdim=True)
            step = compiled_decode_one_token()
            first[variant] = step(model, token, store).float().clone()
            stores[variant], steps[variant] = store, step
        times = {"fused": [], "separate": []}
        host = {}
        for _ in range(args.repeats):
            for variant, model in models.items():
                store, step = stores[variant], steps[variant]
                token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
                times[variant].append(
                    round(
                        _timed_steps(
                            lambda tok: step(model, tok, store), token, timing, torch.device("cuda")
                        ),
                        4,
                    )
                )
        for variant, model in models.items():  # host time per step: enqueue without waiting
            store, step = stores[variant], steps[variant]
            token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                token = step(model, token, store).argmax(-1, keepdim=True)
            host[variant] = round((time.perf_counter() - t0) / args.steps * 1e3, 4)
            torch.cuda.synchronize()
        if args.graph:
            times["fused+graph"] = graph_times(fused_model, cfg, ids, args, timing)
    limit = bandwidth_limit_ms(cfg, batch, prompt + 0.5 * args.steps, 2, args.bandwidth)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return dict(
        arch=arch,
        batch=batch,
        prompt=prompt,
        ms=times,
        median_ms=med,
        host_ms=host,
        limit_ms=round(limit, 3),
        x_limit={k: round(v / limit, 3) for k, v in med.items()},
        first_logits_max_diff=(first["fused"] - first["separate"]).abs().max().item(),
        first_logits_max=first["separate"].abs().max().item(),
    )


def graph_times(model, cfg, ids, args, timing) -> list[float]:
    """The fused step compiled without CUDA graphs (``mode=None``) and captured whole into
    one ``torch.cuda.CUDAGraph`` by hand, the next token's argmax inside it: a step is one
    replay (no guards, no graph-tree bookkeeping on the host). An experiment: the store's
    host-side length is not kept up to date."""
    batch, prompt = ids.shape
    store = DenseStore(cfg.n_layers, capacity=prompt + args.repeats * (args.warmup + args.steps) + 64)
    with model.fused_projections(keep=True):
        token = prefill(model, ids, store).argmax(-1, keepdim=True)
        step = compiled_decode_one_token(mode=None)
        static = token.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # compile and warm up outside the capture
                static.copy_(step(model, static, store).argmax(-1, keepdim=True))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static.copy_(step(model, static, store).argmax(-1, keepdim=True))
        out = []
        for _ in range(args.repeats):
            for _ in range(timing.warmup):
                graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(timing.steps):
                graph.replay()
            torch.cuda.synchronize()
            out.append(round((time.perf_counter() - t0) / timing.steps * 1e3, 4))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--arch", nargs="+", default=["fox-pro"])
    ap.add_argument("--workloads", nargs="+", default=["8x4096", "4x16384", "2x32768"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM: 3.35e12)")
    ap.add_argument("--graph", action="store_true", help="also the fused step captured whole by hand")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for arch in args.arch:
        for w in args.workloads:
            b, t = (int(x) for x in w.split("x"))
            row = bench(arch, b, t, args)
            rows.append(row)
            print(
                f"{arch} {w}: fused {row['median_ms']['fused']:.3f} ms ({row['x_limit']['fused']}x limit), "
                f"separate {row['median_ms']['separate']:.3f} ms ({row['x_limit']['separate']}x), "
                f"host {row['host_ms']}, "
                f"limit {row['limit_ms']} ms; rounds {row['ms']}; first logits differ by "
                f"{row['first_logits_max_diff']:.3g} (max |logit| {row['first_logits_max']:.3g})",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1
            )


if __name__ == "__main__":
    main()
