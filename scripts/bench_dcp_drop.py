"""Times DCP's decode-step drop kernel (``lapse.ops.dcp.paged_drop``) on the GPU at DCP
decode shapes: B sequences, K kv heads, a table of T slots per head holding ``held * T``
(pages scattered), interaction dim r; checks its flags against the torch reference, then
reports us per call (CUDA-graph replay) per slot block, and the share of HBM bandwidth
(the held slots' interaction keys read once).

    python scripts/bench_dcp_drop.py --shapes 64x1920 8x1920 --out drop.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from lapse.ops.dcp.paged_drop import _drop_torch, launch_drop

HBM = 3.35e12  # H100 SXM bytes/s


def case(b: int, t: int, kh: int, r: int, held: float, blocks: tuple[int, ...], ps: int = 16) -> dict:
    dev = "cuda"
    torch.manual_seed(0)
    part = -(-r // kh)
    wp = t // ps
    n_pages = b * kh * wp
    table = torch.randperm(n_pages, device=dev).view(b, kh, wp).to(torch.int32)
    kint = torch.randn(n_pages + 1, ps, part, device=dev, dtype=torch.bfloat16)
    drop0 = torch.zeros(n_pages + 1, ps, 1, device=dev, dtype=torch.float32)
    q = torch.randn(b, r, device=dev, dtype=torch.bfloat16)
    n = max(2, round(held * t))
    lengths = torch.full((b, kh), n, device=dev, dtype=torch.int32)
    beta = torch.tensor(0.5, device=dev)
    ref = drop0.clone()
    _drop_torch(q, kint, ref, table, lengths, beta)
    row = dict(batch=b, table=t, heads=kh, r=r, held=n)
    nbytes = b * n * r * 2
    for block in blocks:
        drop = drop0.clone()
        launch_drop(q, kint, drop, table, lengths, beta, block=block)
        differ = int((drop != ref).sum())
        fn = lambda: launch_drop(q, kint, drop, table, lengths, beta, block=block)
        us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        row[f"block{block}"] = dict(us=round(us, 2), hbm=round(nbytes / us / 1e6 / (HBM / 1e12), 3),
                                    flags_differ=differ)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["64x1920", "8x1920"])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--r", type=int, default=64)
    ap.add_argument("--held", type=float, default=0.5)
    ap.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--out", default="dcp_drop.json")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        b, t = (int(x) for x in shape.split("x"))
        rows.append(case(b, t, args.heads, args.r, args.held, tuple(args.blocks)))
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
