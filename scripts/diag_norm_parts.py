"""How close ACP's norm pass comes to the GPU's memory bandwidth (issue 16).

``acp="auto"`` reads all of q and k once for their largest row norms (``pruning._norm_parts``,
one launch). The pass is bound by memory, so its time is judged against ``torch``'s copy of
the same bytes. Times it on the issue-2 workload (B x T = 32k; 24 heads of 64 or 128) for
tiles of several sizes and warps, and prints the achieved read bandwidth.

    bash scripts/gpu.sh python3 scripts/diag_norm_parts.py --out norm.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from tune_fox_fwd import _dump, _ms  # the timer and output (scripts/ on the path)

from lapse.ops.forgetting import pruning
from lapse.ops.forgetting.common import validate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "4096x128"], help="T x D, 24 heads")
    ap.add_argument("--tiles", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--out", default="norm_parts.json")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        t, d = (int(x) for x in shape.split("x"))
        b, h = 32768 // t, 24
        q = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16)
        lg = F.logsigmoid(torch.randn(b, t, h, device="cuda"))
        p = validate(q, k, k, lg, None, None, "triton")
        gib = 2 * q.numel() * q.element_size() / 2**30
        copy = _ms(lambda: (q.clone(), k.clone()))  # reads and writes: twice the bytes
        print(f"{shape}: q and k {gib:.3f} GiB; torch clone of both {copy:.4f} ms "
              f"({2 * gib / copy * 1e3:.0f} GiB/s read + write)", flush=True)
        for tile, warps in itertools.product(args.tiles, args.warps):
            pruning.NORM_TILE, pruning.NORM_WARPS = tile, warps
            ms = _ms(lambda: pruning._norm_parts(q, k, p))
            rows.append(dict(T=t, D=d, H=h, B=b, tile=tile, warps=warps, ms=ms, read_gib_s=gib / ms * 1e3,
                             clone_ms=copy))
            print(f"  tile {tile} warps {warps}: {ms:.4f} ms, {gib / ms * 1e3:.0f} GiB/s", flush=True)
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
