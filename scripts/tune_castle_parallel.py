"""Measures the launch options of CASTLE's key-major Triton kernels on the GPU.

For each shape (B x T = 16k tokens, 8 heads, bf16, CASTLE and CASTLE-SWL 512) times the
forward launches (row bound + key-major pass, with the zeroing of their accumulators)
and the backward launch (with its zeroing) over a grid of tiles (``BT``), warps and
pipeline stages, checks each option's output against the default configuration's
(``parallel_config``), and prints SDPA's default backend fwd / fwd+bwd in the same run.
The useful work is counted as causal softmax attention's FLOPs (4 T^2 H D / 2 forward,
2.5x that backward), the formula of ``lapse bench attention``, so the TFLOP/s read as
"softmax-equivalent"; CASTLE does about 3.5x / 3.9x those.

    python scripts/tune_castle_parallel.py --out tune_castle.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton.testing

from lapse.ops.castle.triton_parallel import launch_parallel_bwd, launch_parallel_fwd, parallel_config


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, rep=100, return_mode="median")


def _inputs(t: int, h: int, d: int):
    torch.manual_seed(0)
    b = 16384 // t
    xs = [torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    for i in (0, 1, 3, 4):  # queries and keys RMS-normalised, as the bench draws them
        xs[i] = F.rms_norm(xs[i].float(), (d,)).bfloat16()
    return xs, torch.randn_like(xs[0])


def _runners(xs, do, window, fwd_cfg, bwd_cfg):
    """(forward, backward, outputs) closures over preallocated buffers."""
    b, t, h, d = xs[0].shape
    f32 = dict(dtype=torch.float32, device="cuda")
    scale = d**-0.5
    m2, den = torch.empty(b, h, t, **f32), torch.empty(b, h, t, **f32)
    acc, u = torch.empty(b, h, t, d, **f32), torch.empty(b, h, t, d, **f32)
    grads = [torch.empty(b, h, t, d, **f32) for _ in range(6)]

    def fwd():
        acc.zero_()
        den.zero_()
        launch_parallel_fwd(*xs, scale, window, m2, acc, den, u, fwd_cfg)

    fwd()
    lse2 = m2 + torch.log2(den)
    o = (acc / den[..., None]).transpose(1, 2).bfloat16().contiguous()
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()

    def bwd():
        for g in (grads[0], grads[4], grads[5]):
            g.zero_()
        launch_parallel_bwd(*xs, do, lse2, delta, u, grads, scale, window, bwd_cfg)

    return fwd, bwd, (o, grads)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tune(args) -> list[dict]:
    rows = []
    for t, d, window in itertools.product(args.seq_lens, args.head_dims, (None, args.window)):
        h = args.heads
        xs, do = _inputs(t, h, d)
        flops = 4 * t * t * h * d / 2 * (16384 // t)
        qkv = [x.transpose(1, 2) for x in xs[:3]]
        qkv_g = [x.detach().requires_grad_() for x in qkv]
        do_t = do.transpose(1, 2)
        sdpa_fwd = _ms(lambda: F.scaled_dot_product_attention(*qkv, is_causal=True))
        sdpa_all = _ms(lambda: F.scaled_dot_product_attention(*qkv_g, is_causal=True).backward(do_t))
        base_f, base_b = parallel_config(d, False), parallel_config(d, False, backward=True, window=window)
        _, bwd_ref, (o_ref, g_bufs) = _runners(xs, do, window, base_f, base_b)
        bwd_ref()
        g_ref = [g.clone() for g in g_bufs]
        for kind, grid in (("fwd", args.fwd_grid), ("bwd", args.bwd_grid)):
            for bt, warps, stages in grid:
                cfg = dict(BT=bt, num_warps=warps, num_stages=stages)
                row = {"t": t, "d": d, "h": h, "window": window, "pass": kind, **cfg}
                try:
                    fwd, bwd, (o, grads) = _runners(
                        xs, do, window, cfg if kind == "fwd" else base_f, cfg if kind == "bwd" else base_b
                    )
                    if kind == "fwd":
                        row["ms"] = _ms(fwd)
                        row["err"] = _rel(o, o_ref)
                    else:
                        row["ms"] = _ms(bwd)
                        bwd()
                        row["err"] = max(_rel(a, b) for a, b in zip(grads, g_ref, strict=True))
                except Exception as e:  # out of shared memory or registers: report and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                row.update(sdpa_fwd_ms=sdpa_fwd, sdpa_fwd_bwd_ms=sdpa_all)
                if "ms" in row:
                    work = flops if kind == "fwd" else 2.5 * flops
                    row["softmax_tflops"] = work / row["ms"] / 1e9
                rows.append(row)
                print(json.dumps(row))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", default=None)
    p.add_argument("--passes", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    p.add_argument("--fwd-bt", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--bwd-bt", type=int, nargs="+", default=[32, 64])
    p.add_argument("--bwd-warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--bwd-stages", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    args.fwd_grid = list(itertools.product(args.fwd_bt, (4, 8), (1, 2, 3))) if "fwd" in args.passes else []
    args.bwd_grid = (
        list(itertools.product(args.bwd_bt, args.bwd_warps, args.bwd_stages)) if "bwd" in args.passes else []
    )
    rows = tune(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
