"""Where an eviction pass spends its time (issue 12): one FoX (Pro) model of a preset's
shapes, random init, a prompt prefilled into a paged store under a policy, then passes of
``lapse.generation.evict`` timed whole (between synchronisations) and by phase, and one
under the PyTorch profiler (top CPU and CUDA operators).

    python scripts/profile_evict.py --preset 125m --batch 4 --prompt 32768 --policy acp
    python scripts/profile_evict.py --preset gpu-20m --arch transformer-llama --attention dcp \
        --policy dcp --batch 64 --prompt 1920 --compile
"""

from __future__ import annotations

import argparse
import time

import torch

from lapse.generation import POLICIES, evict, logit_bounds, paged_store_for, prefill
from lapse.models import Decoder, preset


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--arch", default="fox-pro")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--policy", default="acp")
    ap.add_argument("--attention", default=None, help="override the attention kind (e.g. dcp)")
    ap.add_argument("--dcp-beta-init", type=float, default=-0.5,
                    help="with --attention dcp: beta at init (below 0: a random model drops)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument(
        "--compile", action="store_true", help="each layer's pass compiled (PagedStore.apply_policy)"
    )
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    overrides = {} if args.attention is None else {"attention": args.attention}
    if args.attention == "dcp":
        overrides["dcp_beta_init"] = args.dcp_beta_init
    cfg = preset(args.preset, args.arch, max_seq_len=args.prompt, **overrides)
    model = Decoder(cfg).to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    policy = POLICIES[args.policy]()
    store = paged_store_for(model, args.batch, args.prompt, 256, policy)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), device=dev)
    with torch.no_grad():
        prefill(model, ids, store)
    sync()
    bounds = logit_bounds(model)
    for i in range(args.passes):
        t0 = time.perf_counter()
        evict(model, store, policy, bounds, compile=args.compile)
        sync()
        share = 100 * store.bytes_held() / store.bytes_if_dense()
        print(f"pass {i}: {1e3 * (time.perf_counter() - t0):.2f} ms; held {share:.2f}%")
    if args.compile:
        return  # the phases below are the eager pass's
    # phases of one more pass, layer by layer
    phases = {"snapshot": 0.0, "keep": 0.0, "evict": 0.0}
    for layer in range(cfg.n_layers):
        t0 = time.perf_counter()
        snap = store.snapshot(layer)
        snap.bound = bounds[layer]
        sync()
        t1 = time.perf_counter()
        keep = policy.keep(snap)
        sync()
        t2 = time.perf_counter()
        store.evict(layer, keep)
        sync()
        t3 = time.perf_counter()
        phases["snapshot"] += t1 - t0
        phases["keep"] += t2 - t1
        phases["evict"] += t3 - t2
    print("phases (ms, all layers):", {k: round(1e3 * v, 2) for k, v in phases.items()})
    widths = [store._meta(i)[0] for i in range(cfg.n_layers)]
    print("snapshot widths per layer:", widths)
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else []
    )
    with torch.profiler.profile(activities=acts) as prof:
        evict(model, store, policy, bounds, compile=args.compile)
        sync()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=15))
    if dev.type == "cuda":
        print(ka.table(sort_by="self_device_time_total", row_limit=15))


if __name__ == "__main__":
    main()
