"""Where a DCP eviction pass's cost goes beyond the pass itself (issue 14): a random DCP
model dropping about half (scripts/profile_dcp_decode.py's), B x T, the compiled step
over the paged store with a pass every ``--every`` steps; CUDA events before every step
and pass give each step's device span, then the profiler's host and device tables over
one pass and the 3 steps after it. Variants: the pass compiled (default) or eager.

    python scripts/diag_dcp_pass_spill.py --batch 64 --prompt 1536 --every 64 --out spill.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from profile_dcp_decode import dcp_model, held_share

from lapse.generation import (
    POLICIES,
    compiled_decode_one_token,
    evict,
    logit_bounds,
    paged_store_for,
    prefill,
)
from lapse.models import Decoder, preset


def run(model, ids, every, steps, compile_pass, prof_out=None):
    policy = POLICIES["dcp"](every=every)
    store = paged_store_for(model, ids.shape[0], ids.shape[1], steps + 16, policy)
    step = compiled_decode_one_token()
    bounds = logit_bounds(model)
    spans, passes = [], []
    with torch.no_grad(), model.fused_projections(keep=True):
        tok = prefill(model, ids, store).argmax(-1, keepdim=True)
        evict(model, store, policy, bounds, compile=compile_pass)
        store.reserve(every)
        for _ in range(3):
            tok = step(model, tok, store).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        marks = []
        t_all = time.perf_counter()
        for i in range(3, steps):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            marks.append((i, e))
            if i % every == 0:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                evict(model, store, policy, bounds, compile=compile_pass)
                store.reserve(min(every, steps - i))
                torch.cuda.synchronize()
                passes.append((i, (time.perf_counter() - t0) * 1e3))
            tok = step(model, tok, store).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t_all) / (steps - 3) * 1e3
        for (i, a), (_, b) in zip(marks, marks[1:], strict=False):
            spans.append((i, a.elapsed_time(b)))
        if prof_out is not None:
            from torch.profiler import ProfilerActivity, profile

            store.reserve(4)  # the loop reserved up to its last step only
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    tok = step(model, tok, store).argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                evict(model, store, policy, bounds, compile=compile_pass)
                store.reserve(8)
                for _ in range(3):
                    tok = step(model, tok, store).argmax(-1, keepdim=True)
                torch.cuda.synchronize()
            prof_out["cpu"] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
            prof_out["cuda"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
            prof.export_chrome_trace(prof_out["trace"])
    spans_sorted = sorted(spans, key=lambda s: -s[1])
    plain = [s for i, s in spans if i % every not in (0, 1, 2)]
    return {
        "wall_ms_per_step": wall,
        "passes_ms": passes,
        "median_step": float(torch.tensor(plain).median()),
        "slowest": [(i, round(s, 3)) for i, s in spans_sorted[:12]],
        "after_pass": [(i, round(s, 3)) for i, s in spans if i % every in (0, 1, 2, 3)],
        "held": store.bytes_held() / store.bytes_if_dense(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1536)
    ap.add_argument("--every", type=int, default=64)
    ap.add_argument("--steps", type=int, default=260)
    ap.add_argument("--out", default="spill.json")
    ap.add_argument("--trace", default="spill_trace.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = preset("gpu-20m", "transformer-llama", max_seq_len=args.prompt + 512, vocab_size=512)
    dense = Decoder(cfg).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 512, (args.batch, args.prompt), device="cuda")
    policy = POLICIES["dcp"](every=16)
    shares = {b: held_share(dcp_model(dense, b), ids[:4], policy) for b in (2.5, 3.0, 3.5, 4.0)}
    beta = min(shares, key=lambda b: abs(shares[b] - 0.5))
    model = dcp_model(dense, beta)
    out = {"device": torch.cuda.get_device_name(), "beta": beta, "shares": shares}
    for name, compile_pass in (("compiled", True), ("compiled-again", True)):
        prof = {"trace": args.trace} if name == "compiled-again" else None
        out[name] = run(model, ids, args.every, args.steps, compile_pass, prof)
        if prof:
            out["profile_cpu"], out["profile_cuda"] = prof["cpu"], prof["cuda"]
        print(name, json.dumps({k: v for k, v in out[name].items() if k != "after_pass"}), flush=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(out["profile_cpu"])
    print(out["profile_cuda"])


if __name__ == "__main__":
    main()
