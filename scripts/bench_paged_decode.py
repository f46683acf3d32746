"""Times one layer of the paged decode op against the dense one on the GPU (issue 12): the
same keys (125M heads: 12 of 64, bf16, no GQA), FoX bias and plain softmax, the paged
store's pages scattered at random, under CUDA-graph replay; reports us per call and the
share of HBM bandwidth (K, V and ``c`` of the held slots, read once).

    python scripts/bench_paged_decode.py --shapes 8x4096 4x16384 --out paged.json

DCP's decode (issue 14): 8 heads, half of each head's table held, the drop flags as a
float32 ``c`` of one channel, the split count swept (dense and paged):

    python scripts/bench_paged_decode.py --shapes 64x1920 8x1920 --heads 8 --held 0.5 \
        --c-dtype float32 --splits 1 2 3 4 --no-softmax --out dcp.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from lapse.ops.forgetting import forgetting_attention_decode
from lapse.ops.forgetting.paged import forgetting_attention_paged_decode
from lapse.ops.forgetting.paged_triton import launch_paged_decode

HBM = 3.35e12  # H100 SXM bytes/s


def _bench(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def case(b: int, t: int, h: int = 12, d: int = 64, ps: int = 16, fox: bool = True, dev: str = "cuda",
         timed: bool = True, configs: tuple[dict, ...] = (), held: float = 1.0,
         c_dtype: torch.dtype = torch.float64, splits: tuple[int, ...] = ()) -> dict:
    """One shape: the dense op over the first ``held * t`` keys of each sequence against
    the paged op over a table of ``t`` slots per head holding as many (the rest of each
    head's pages unused, as after evictions); ``splits``: also each at that split count."""
    torch.manual_seed(0)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    k = torch.randn(b, t, h, d, device=dev, dtype=dt)
    v = torch.randn(b, t, h, d, device=dev, dtype=dt)
    c = (-0.01 * torch.rand(b, t, h, device=dev, dtype=torch.float64)).cumsum(1).to(c_dtype) if fox else None
    q = torch.randn(b, h, d, device=dev, dtype=dt)
    seqlens = torch.full((b,), t, device=dev, dtype=torch.int32)
    mp = t // ps
    n_pages = b * h * mp
    perm = torch.randperm(n_pages, device=dev)
    page_table = perm.view(b, h, mp).to(torch.int32)
    # pool[page_table[b, h, i]] = the i-th page of (b, h)
    k_pages = torch.empty(n_pages, ps, d, device=dev, dtype=dt)
    v_pages = torch.empty_like(k_pages)
    k_pages[page_table.long().flatten()] = k.view(b, mp, ps, h, d).permute(0, 3, 1, 2, 4).reshape(-1, ps, d)
    v_pages[page_table.long().flatten()] = v.view(b, mp, ps, h, d).permute(0, 3, 1, 2, 4).reshape(-1, ps, d)
    c_pages = c_query = None
    if fox:
        c_pages = torch.empty(n_pages, ps, 1, device=dev, dtype=c_dtype)
        c_pages[page_table.long().flatten()] = c.view(b, mp, ps, h).permute(0, 3, 1, 2).reshape(-1, ps, 1)
        c_query = c[:, -1]  # [B, H]
    n = max(1, round(held * t))
    lengths = torch.full((b, h), n, device=dev, dtype=torch.int32)
    seqlens.fill_(n)
    if fox:
        c_query = c[:, n - 1]

    def dense(splits=None):
        return forgetting_attention_decode(q, k, v, c, seqlens, check_values=False, num_splits=splits)

    def paged(splits=None):
        return forgetting_attention_paged_decode(q, k_pages, v_pages, page_table, lengths, c_pages=c_pages,
                                                 c_query=c_query, check_values=False, num_splits=splits)

    err = (dense().float() - paged().float()).abs().max().item()
    nbytes = b * n * h * (2 * d * 2 + (c.element_size() if fox else 0))
    row = dict(batch=b, prompt=t, heads=h, held=n, fox=fox, c_dtype=str(c_dtype), max_err=err)
    for name, fn in (("dense", dense), ("paged", paged)) if timed else ():
        for split in (None, *splits):
            us = _bench(lambda: fn(split))
            key = name if split is None else f"{name}_s{split}"
            row[f"{key}_us"] = round(us, 2)
            row[f"{key}_hbm"] = round(nbytes / us / 1e6 / (HBM / 1e12), 3)
    o = torch.empty_like(q)
    lse = torch.empty(b, h, device=dev, dtype=torch.float32)
    for cfg in configs if timed else ():  # the paged split kernel's launch options
        launch = lambda: launch_paged_decode(q, k_pages, v_pages, page_table, lengths, c_pages,
                                             c_query, d**-0.5, o, lse, config=cfg)
        launch()
        err = (o.float() - dense().float()).abs().max().item()
        row.setdefault("configs", []).append(dict(cfg, us=round(_bench(launch), 2), max_err=err))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["8x4096", "4x16384", "1x4096"])
    ap.add_argument("--out", default="paged_decode.json")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--held", type=float, default=1.0, help="share of each head's slots held")
    ap.add_argument("--c-dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--splits", type=int, nargs="*", default=[], help="also time at these split counts")
    ap.add_argument("--no-softmax", action="store_true", help="the FoX-bias rows only")
    ap.add_argument("--configs", action="store_true",
                    help="also time the paged kernel over BN x warps x stages")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        b, t = (int(x) for x in shape.split("x"))
        for fox in (True,) if args.no_softmax else (True, False):
            grid = [dict(BN=bn, num_warps=w, num_stages=st) for bn in (32, 64, 128) for w in (2, 4, 8)
                    for st in (2, 3, 4)] if args.configs else []
            rows.append(case(b, t, h=args.heads, fox=fox, configs=tuple(grid), held=args.held,
                             c_dtype=getattr(torch, args.c_dtype), splits=tuple(args.splits)))
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
