"""The dense decode step under other ``torch.compile`` settings (issue 12, experiment): ms
per step of a random-init model after a prefill, for each compile mode and Inductor
option, in one process, so the rows compare. ``reduce-overhead`` is what ``generate`` and
``lapse bench decode`` use; ``max-autotune`` also captures CUDA graphs and lets Inductor
choose between cuBLAS and its Triton GEMM templates (which it can fuse neighbours into);
``+cdt`` adds coordinate-descent tuning of the generated kernels' launch options.

    python scripts/bench_decode_modes.py --arch fox-pro transformer-llama --batch 8 --prompt 4096
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch._inductor.config as inductor_config

from lapse.bench.decode import DecodeBenchConfig, _timed_steps
from lapse.generation import compiled_decode_one_token, prefill
from lapse.kv import DenseStore
from lapse.models import Decoder, preset

VARIANTS = {
    "reduce-overhead": ("reduce-overhead", {}),
    "reduce-overhead+cdt": ("reduce-overhead", {"coordinate_descent_tuning": True}),
    "max-autotune": ("max-autotune", {}),
    "max-autotune+cdt": ("max-autotune", {"coordinate_descent_tuning": True}),
}


@torch.no_grad()
def time_variant(arch: str, variant: str, args) -> dict:
    torch.manual_seed(0)
    torch._dynamo.reset()
    cfg = preset(args.preset, arch, max_seq_len=args.prompt)
    model = Decoder(cfg).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), device="cuda")
    bench = DecodeBenchConfig(steps=args.steps, warmup=args.warmup)
    mode, options = VARIANTS[variant]
    store = DenseStore(cfg.n_layers, capacity=args.prompt + args.warmup + args.steps + 1)
    token = prefill(model, ids, store).argmax(-1, keepdim=True)
    with inductor_config.patch(options), model.fused_projections(keep=True):
        step = compiled_decode_one_token(mode=mode)
        t0 = time.perf_counter()
        step(model, token, store)  # compile (and autotune) outside the timing
        compile_s = time.perf_counter() - t0
        ms = _timed_steps(lambda tok: step(model, tok, store), token, bench, torch.device("cuda"))
    return dict(arch=arch, variant=variant, batch=args.batch, prompt=args.prompt, ms=round(ms, 3),
                compile_s=round(compile_s, 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--arch", nargs="+", default=["fox-pro", "transformer-llama"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", default="decode_modes.json")
    args = ap.parse_args()
    rows = []
    for arch in args.arch:
        for variant in args.variants:
            try:
                row = time_variant(arch, variant, args)
            except Exception as e:  # noqa: BLE001 (report and go on)
                row = dict(arch=arch, variant=variant, error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
