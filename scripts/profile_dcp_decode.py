"""Where DCP decoding spends its time (issue 14): a softmax Transformer of a preset's
shapes over the dense store against the same weights with DCP attention over the paged
store under ``DCPDrop``, random weights whose interaction mask drops about half the
context (interaction weights drawn so that ``z ~ N(beta, 1)``, ``beta`` picked from
``--betas`` by the share a prefill drops). Per batch: the dense step, the paged DCP step
alone, the eviction pass by phase (each layer's compiled pass, the host's page lists:
``settle`` and ``reserve``), the whole timed loop at several ``every``, and the profiler's
top operators of one pass.

    python scripts/profile_dcp_decode.py --batches 8 64 --prompt 1920 --every 16 64
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

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


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def dcp_model(dense: Decoder, beta: float) -> Decoder:
    model = Decoder(replace(dense.config, attention="dcp")).to(next(dense.parameters()).device)
    model.load_state_dict(dense.state_dict(), strict=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:
            a = block.attn
            c = a.qint_proj.weight.shape[1]
            for proj in (a.qint_proj, a.kint_proj):
                proj.weight.copy_(torch.randn(proj.weight.shape, generator=g) / c**0.5)
            a.beta.fill_(beta)
    return model.to(next(dense.parameters()).dtype).eval()


def held_share(model, ids, policy) -> float:
    store = paged_store_for(model, ids.shape[0], ids.shape[1], 8, policy)
    with torch.no_grad():
        prefill(model, ids, store)
        evict(model, store, policy, compile=False)
    return store.bytes_held() / store.bytes_if_dense()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpu-20m")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prompt", type=int, default=1920)
    ap.add_argument("--betas", type=float, nargs="+", default=[2.5, 3.0, 3.5, 4.0])
    ap.add_argument("--every", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = preset(args.preset, "transformer-llama", max_seq_len=args.prompt + 512, vocab_size=args.vocab)
    dense = Decoder(cfg).to(dev, dtype).eval()
    policy = POLICIES["dcp"](every=16)
    ids8 = torch.randint(0, cfg.vocab_size, (4, args.prompt), device=dev)
    shares = {b: held_share(dcp_model(dense, b), ids8, policy) for b in args.betas}
    beta = min(shares, key=lambda b: abs(shares[b] - 0.5))
    rounded = {b: round(s, 3) for b, s in shares.items()}
    print("held share after the prefill by beta:", rounded, "-> beta", beta)
    model = dcp_model(dense, beta)
    out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "beta": beta,
           "shares": shares, "rows": []}
    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    for batch in args.batches:
        ids = torch.randint(0, cfg.vocab_size, (batch, args.prompt), device=dev)
        row = {"batch": batch, "prompt": args.prompt}
        bench = DecodeBenchConfig(steps=args.steps, warmup=4, device=str(dev), compile_backend=backend)
        row["dense_ms"] = time_lapse(dense, ids, bench, compile=True)
        row["paged_dense_ms"] = time_paged(dense, ids, bench, "dense")[0]
        for every in args.every:
            ms, share, vs_softmax, evict_ms = time_paged(model, ids, replace(bench, every=every), "dcp")
            row[f"every{every}"] = {"ms": ms, "share": share, "vs_softmax": vs_softmax, "evict_ms": evict_ms}
        # the phases: a fresh store, prefill, one pass, then (16 steps, pass) x 4
        store = paged_store_for(model, batch, args.prompt, 7 * 16 + 8, policy)  # 6 x 16 steps, reserves
        step = compiled_decode_one_token() if dev.type == "cuda" else compiled_decode_one_token(
            mode=None, backend="aot_eager")
        bounds = logit_bounds(model)
        phases = []
        with torch.no_grad(), model.fused_projections(keep=True):
            tok = prefill(model, ids, store).argmax(-1, keepdim=True)
            evict(model, store, policy, bounds, compile=dev.type == "cuda")
            store.reserve(16)
            for p in range(5):
                sync()
                t0 = time.perf_counter()
                for _ in range(16):
                    tok = step(model, tok, store).argmax(-1, keepdim=True)
                sync()
                t1 = time.perf_counter()
                for i in range(len(model.blocks)):
                    store.apply_policy(i, policy.keep, bounds[i], compile=dev.type == "cuda",
                                       extras=policy.snapshot_extras)
                sync()
                t2 = time.perf_counter()
                store.settle()
                t3 = time.perf_counter()
                store.reserve(16)
                sync()
                t4 = time.perf_counter()
                phases.append({"step_ms": (t1 - t0) / 16 * 1e3, "passes_ms": (t2 - t1) * 1e3,
                               "settle_ms": (t3 - t2) * 1e3, "reserve_ms": (t4 - t3) * 1e3,
                               "held": store.bytes_held() / store.bytes_if_dense()})
                print(f"B {batch} round {p}: " + ", ".join(f"{k} {v:.3f}" for k, v in phases[-1].items()))
            row["phases"] = phases
            if dev.type == "cuda":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(16):
                        tok = step(model, tok, store).argmax(-1, keepdim=True)
                    evict(model, store, policy, bounds)
                    store.reserve(16)
                    sync()
                table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=18)
                print(table)
                row["profile_cpu"] = table
                row["profile_cuda"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
                print(row["profile_cuda"])
        print(json.dumps({k: v for k, v in row.items() if not k.startswith(("profile", "phases"))}, indent=1))
        out["rows"].append(row)
        if args.out:  # after every batch: a later failure keeps what was measured
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
