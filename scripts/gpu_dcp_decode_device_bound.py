"""DCP decoding where the step is bound by the device, not the host (issue 14's speed
target): a 125M-shape Transformer (LLaMA) over the dense store against the same weights
with DCP attention over the paged store under ``DCPDrop``, random interaction weights
whose mask drops about half the context (``beta`` searched as in
``scripts/profile_dcp_decode.py``), B x T prompts, compiled steps, passes every ``--every``
steps inside the timed region. At gpu-20m shapes every variant is host-bound (BENCHMARKS.md,
"Eighth session"); at 125M x 64 x 2048 the dense step reads ~4.8 GB of K, V. Writes the JSON
after each measurement (a cut-off run keeps what it measured).

    python scripts/gpu_dcp_decode_device_bound.py --preset 125m --batch 64 --prompt 2048 --out dcp125m.json

One H100 run (870ea90, betas 2.5-4, 48 steps): beta 2.5 kept 76% and no pass fell in the timed
steps, hence the defaults now (BENCHMARKS.md, "Eighth session").
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from dataclasses import replace

import torch
from profile_dcp_decode import dcp_model, held_share

from lapse.bench.decode import DecodeBenchConfig, time_lapse, time_paged
from lapse.generation import (
    POLICIES,
    compiled_decode_one_token,
    evict,
    logit_bounds,
    paged_store_for,
    prefill,
)
from lapse.models import Decoder, preset


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=160)  # passes at 64 and 128 inside the timed steps
    ap.add_argument("--every", type=int, default=64)
    ap.add_argument("--betas", type=float, nargs="+", default=[1.0, 1.5, 2.0, 2.5, 3.0])  # 125M: 2.5 held 76%
    ap.add_argument("--graph", type=int, nargs="+", default=[1, 0],
                    help="the passes as one CUDA graph (1) or per-layer compiled calls (0); each is timed")
    ap.add_argument("--out", default="dcp_device_bound.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    torch.manual_seed(0)
    cfg = preset(args.preset, "transformer-llama", max_seq_len=args.prompt + args.steps + 64, vocab_size=512)
    dense = Decoder(cfg).to(dev, dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), device=dev)
    policy = POLICIES["dcp"](every=args.every)
    shares = {b: held_share(dcp_model(dense, b), ids[:2], policy) for b in args.betas}
    beta = min(shares, key=lambda b: abs(shares[b] - 0.5))
    model = dcp_model(dense, beta)
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "preset": args.preset, "batch": args.batch, "prompt": args.prompt, "steps": args.steps,
           "every": args.every, "beta": beta, "held_after_prefill_by_beta": shares}

    def save(key, value):
        out[key] = value
        out["elapsed_s"] = round(time.perf_counter() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(key, json.dumps(value), f"({out['elapsed_s']} s)", flush=True)

    bench = DecodeBenchConfig(steps=args.steps, warmup=4, device=str(dev), every=args.every,
                              compile_backend="inductor" if cuda else "aot_eager")
    save("dense_store_ms", time_lapse(dense, ids, bench, compile=True))
    for graph in args.graph:
        if cuda:
            save(f"pass_profile_graph{graph}", pass_profile(model, ids, policy, bool(graph)))
    detail: dict = {}
    ms, share, vs_softmax, evict_ms = time_paged(model, ids, replace(bench, every=args.every), "dcp", detail)
    save("dcp", {"ms": ms, "kv_share_same_pools": share, "kv_vs_softmax": vs_softmax, "evict_ms": evict_ms,
                 "detail": detail})
    save("dcp_vs_dense_tokens_per_s", out["dense_store_ms"] / ms)


def pass_profile(model, ids, policy, graph: bool) -> dict:
    """Host time of a pass (``evict``) and of the ``reserve`` after it, the second and third
    passes of a store (the first captures or compiles), with the host's top functions by
    own time (cProfile) for the third."""
    store = paged_store_for(model, ids.shape[0], ids.shape[1], 3 * policy.every + 8, policy)
    step = compiled_decode_one_token()
    bounds = logit_bounds(model)
    result: dict = {}
    with torch.no_grad(), model.fused_projections(keep=True):
        tok = prefill(model, ids, store).argmax(-1, keepdim=True)
        for n in range(3):
            torch.cuda.synchronize()
            profile = cProfile.Profile() if n == 2 else None
            t0 = time.perf_counter()
            if profile:
                profile.enable()
            evict(model, store, policy, bounds, compile=True, graph=graph)
            t1 = time.perf_counter()
            store.reserve(policy.every)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if profile:
                profile.disable()
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
                result["top"] = text.getvalue()[-4000:]
            ms = {"evict_ms": (t1 - t0) * 1e3, "reserve_ms": (t2 - t1) * 1e3}
            result[f"pass{n}"] = {key: round(value, 3) for key, value in ms.items()}
            for _ in range(policy.every):
                tok = step(model, tok, store).argmax(-1, keepdim=True)
    result["held"] = store.bytes_held() / store.bytes_if_dense()
    return result

if __name__ == "__main__":
    main()
