"""Measures the fused CASTLE decode kernel's launch options on the GPU (issue 13).

One layer's step at the 125M CASTLE shapes (7 heads of 64, bf16 caches, float32 ``u``),
B x held slots in ``--shapes``, CASTLE and CASTLE-SWL: ``launch_castle_decode`` timed
under CUDA-graph replay (``triton.testing.do_bench_cudagraph``) for a grid of tiles
(``BN``), warps and the slot loop's pipeline stages (``loop_stages``; 1: none), each
checked against the default options' output on fresh copies of the caches, with the
bytes it must move (``u`` read and written where it changes, ``q^U``, ``k^C``, ``v^C``
read) per microsecond.

    python scripts/tune_castle_decode.py --out tune_castle_decode.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton.testing

from lapse.ops.castle.decode_triton import launch_castle_decode

H, D = 7, 64


def _inputs(b: int, n: int, capacity: int):
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g, device="cuda") * 0.3).to(dtype)

    caches = dict(u=randn(b, capacity, H, D, dtype=torch.float32), qu=randn(b, capacity, H, D),
                  kc=randn(b, capacity, H, D), vc=randn(b, capacity, H, D))
    new = dict(q_c=randn(b, H, D), k_u=randn(b, H, D), v_u=randn(b, H, D))
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    return new, caches, lens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["8x4096", "1x4096", "4x16384"])
    p.add_argument("--windows", nargs="+", default=["none", "512"])
    p.add_argument("--block-n", nargs="+", type=int, default=[16, 32, 64, 128])
    p.add_argument("--warps", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--stages", nargs="+", type=int, default=[3],
                   help="the kernel's num_stages (only tl.dot loads: none here)")
    p.add_argument("--loop-stages", nargs="+", type=int, default=[1, 2, 3, 4])
    p.add_argument("--out", default="tune_castle_decode.json")
    args = p.parse_args()
    rows = []
    for shape, win in itertools.product(args.shapes, args.windows):
        b, n = (int(x) for x in shape.split("x"))
        window = None if win == "none" else int(win)
        new, caches, lens = _inputs(b, n, n + 64)
        o = torch.empty(b, H, D, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(b, H, device="cuda", dtype=torch.float32)

        def call(u, cfg, o=o, lse=lse):
            launch_castle_decode(new["q_c"], new["k_u"], new["v_u"], u, caches["qu"], caches["kc"],
                                 caches["vc"], lens, D**-0.5, window, o, lse, config=cfg)

        u_ref = caches["u"].clone()
        call(u_ref, None)
        o_ref = o.clone()
        changed = n if window is None else min(n, window)
        # k^C, v^C and u read at every slot; u written and q^U read where u changes
        moved = b * H * D * (n * (2 + 2 + 4) + changed * (4 + 2))
        grid = [(None, None, None, None),
                *itertools.product(args.block_n, args.warps, args.stages, args.loop_stages)]
        for bn, warps, stages, loop in grid:
            cfg = None if bn is None else dict(BN=bn, num_warps=warps, num_stages=stages, loop_stages=loop)
            row = dict(batch=b, slots=n, window=window, config=cfg or "default")
            try:
                u = caches["u"].clone()
                call(u, cfg)
                row["o_err"] = (o.float() - o_ref.float()).abs().max().item()
                row["u_err"] = (u - u_ref).abs().max().item()
                bench = triton.testing.do_bench_cudagraph
                us = 1e3 * bench(lambda: call(u, cfg), rep=30, return_mode="median")
                row.update(us=round(us, 2), tb_s=round(moved / us / 1e6, 3))
            except Exception as e:  # out of resources: report and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    for shape, win in itertools.product(args.shapes, args.windows):
        b, n = (int(x) for x in shape.split("x"))
        window = None if win == "none" else int(win)
        mine = [r for r in rows if (r["batch"], r["slots"], r["window"]) == (b, n, window) and "us" in r]
        best = min(mine, key=lambda r: r["us"])
        default = next(r for r in mine if r["config"] == "default")
        old = [r for r in mine if r["config"] != "default" and r["config"]["loop_stages"] == 1]
        old_best = min(old, key=lambda r: r["us"]) if old else None
        print(f"{shape} window {win}: default {default['us']} us ({default['tb_s']} TB/s); "
              f"best {best['us']} us {best['config']}; best without a loop pipeline "
              f"{old_best['us'] if old_best else '-'} us {old_best['config'] if old_best else ''}")
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
