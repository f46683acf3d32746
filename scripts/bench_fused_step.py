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

from __future__ import annotations

import argparse
import copy
import json

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
            store = DenseStore(cfg.n_layers, capacity=prompt + args.repeats * (args.warmup + args.steps) + 2)
            token = prefill(model, ids, store).argmax(-1, keepdim=True)
            step = compiled_decode_one_token()
            first[variant] = step(model, token, store).float().clone()
            stores[variant], steps[variant] = store, step
        times = {"fused": [], "separate": []}
        for _ in range(args.repeats):
            for variant, model in models.items():
                store, step = stores[variant], steps[variant]
                token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
                times[variant].append(round(_timed_steps(lambda tok: step(model, tok, store), token, timing,
                                                         torch.device("cuda")), 4))
    limit = bandwidth_limit_ms(cfg, batch, prompt + 0.5 * args.steps, 2, args.bandwidth)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return dict(arch=arch, batch=batch, prompt=prompt, ms=times, median_ms=med, limit_ms=round(limit, 3),
                x_limit={k: round(v / limit, 3) for k, v in med.items()},
                first_logits_max_diff=(first["fused"] - first["separate"]).abs().max().item(),
                first_logits_max=first["separate"].abs().max().item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--arch", nargs="+", default=["fox-pro"])
    ap.add_argument("--workloads", nargs="+", default=["8x4096", "4x16384", "2x32768"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM: 3.35e12)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for arch in args.arch:
        for w in args.workloads:
            b, t = (int(x) for x in w.split("x"))
            row = bench(arch, b, t, args)
            rows.append(row)
            print(f"{arch} {w}: fused {row['median_ms']['fused']:.3f} ms ({row['x_limit']['fused']}x limit), "
                  f"separate {row['median_ms']['separate']:.3f} ms ({row['x_limit']['separate']}x), "
                  f"limit {row['limit_ms']} ms; rounds {row['ms']}; first logits differ by "
                  f"{row['first_logits_max_diff']:.3g} (max |logit| {row['first_logits_max']:.3g})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
