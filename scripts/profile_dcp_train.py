"""Where a DCP fine-tuning step spends its time (issue 14's step-time target): the softmax
Transformer of a preset's shapes against the same weights with DCP attention, both with
their blocks compiled as ``lapse bench train``'s ``-compile`` variants take them, one
optimizer step of ``--batch`` rows at ``--seq-len`` under bf16 autocast; median step
times, then the profiler's top CUDA kernels of one step of each.

    python scripts/profile_dcp_train.py --preset 125m --seq-len 1024 --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from lapse.bench.training import dcp_penalty, optimizer_step
from lapse.models import Decoder, optimizer_groups, prepare_blocks, preset
from lapse.ops.forgetting import set_value_checks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--rows", type=int, default=22)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    set_value_checks(False)
    cfg = replace(preset(args.preset, "transformer-llama"), max_seq_len=args.seq_len)
    variants = {}
    for name in ("transformer", "dcp"):
        torch.manual_seed(0)
        model = Decoder(cfg if name == "transformer" else replace(cfg, attention="dcp")).to(dev)
        reg = dcp_penalty(model, 4.0, 0.1) if name == "dcp" else None
        prepare_blocks(model, compile=not args.no_compile)
        opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-4, fused=dev.type == "cuda")
        variants[name] = (model, opt, reg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
    x, y = x[:, :-1], x[:, 1:]

    def step(name):
        model, opt, reg = variants[name]
        return optimizer_step(model, opt, x, y, args.batch, reg).item()

    times = {}
    for name in variants:
        for _ in range(3):
            step(name)
        ts = []
        for _ in range(args.steps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(name)
            ts.append(time.perf_counter() - t0)
        times[name] = statistics.median(ts)
        print(f"{name}: {times[name] * 1e3:.2f} ms per step")
    print(f"dcp / transformer: {times['dcp'] / times['transformer']:.3f}x")
    if dev.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    for name in variants:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(name)
            torch.cuda.synchronize()
        print(f"--- {name}: top CUDA kernels of one step")
        averages = prof.key_averages()
        table = averages.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=90)
        print(table)


if __name__ == "__main__":
    main()
