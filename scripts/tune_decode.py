"""Measures the dense split-K decode kernel's launch options on the GPU (issue 12/16).

For each decode shape (125M heads: 12 of 64, bf16) and with the FoX bias (``c`` in
float64, as the store keeps it) and without (the Transformer's step), times
``launch_decode`` under CUDA-graph replay (``triton.testing.do_bench_cudagraph``: what a
compiled step pays) for a grid of tiles (``BN``), warps, pipeline stages and split
counts, checks each against the default configuration's output, and reports the
achieved HBM bandwidth (K, V and ``c`` up to each row's length, read once). Beside it:
cuDNN SDPA (PyTorch's default backend) over the same keys as the dense Transformer layer
calls it (the whole buffer with a mask), and the small GEMMs of a decode step, separate
against fused (the projections a layer reads from the same input).

    python scripts/tune_decode.py --out tune.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton.testing

from lapse.ops.forgetting.decode_triton import _split_launch, launch_decode

HBM = 3.35e12  # H100 SXM bytes/s


def _bench(fn) -> float:
    """Microseconds per call under CUDA-graph replay (median)."""
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def _case(b: int, t: int, h: int, d: int, bias: bool, layout: str, c_layout: str = "bsh"):
    torch.manual_seed(0)
    s = t + 64  # the store's capacity: the prompt plus room for steps
    if layout == "bshd":  # the DenseStore's layout
        k = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    else:  # heads outermost: each head's keys contiguous
        k = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    c = (-0.01 * torch.rand(b, s, h, device="cuda", dtype=torch.float64)).cumsum(1) if bias else None
    if c is not None and c_layout == "bhs":  # slots innermost (the DenseStore keeps bsh)
        c = c.transpose(1, 2).contiguous().transpose(1, 2)
    q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((b,), t, device="cuda", dtype=torch.int32)
    return q, k, v, c, seqlens


def _kernel_bytes(b, t, h, d, bias) -> int:
    return b * t * h * (2 * d * 2 + (8 if bias else 0))


def tune_kernel(shapes, args) -> list[dict]:
    rows = []
    grid = list(itertools.product(args.block_n, args.warps, args.stages))
    cases = [(True, cl) for cl in args.c_layouts] + [(False, "-")]
    for (b, t), (bias, c_layout) in itertools.product(shapes, cases):
        h, d = 12, 64
        q, k, v, c, seqlens = _case(b, t, h, d, bias, "bshd", c_layout)
        o = torch.empty_like(q)
        lse = torch.empty(b, h, device="cuda", dtype=torch.float32)
        launch_decode(q, k, v, c, seqlens, None, d**-0.5, o, lse)
        ref = o.clone()
        nbytes = _kernel_bytes(b, t, h, d, bias)
        default_splits, _ = _split_launch(q, 1, k.shape[1], b * h, None)

        def record(name, cfg, splits, layout, us, err):
            row = dict(batch=b, prompt=t, bias=bias, c_layout=c_layout, variant=name, config=cfg,
                       num_splits=splits,
                       layout=layout, us=round(us, 2), tb_s=round(nbytes / us / 1e6, 3),
                       hbm_share=round(nbytes / us / 1e6 / (HBM / 1e12), 3), max_err=err)
            rows.append(row)
            print(json.dumps(row), flush=True)

        for bn, warps, stages in grid:
            cfg = dict(BN=bn, num_warps=warps, num_stages=stages)
            for mult in args.split_mults:
                splits, _ = _split_launch(q, 1, k.shape[1], b * h, None, cfg)
                splits = max(1, min(128, round(splits * mult)))
                try:
                    fn = lambda: launch_decode(q, k, v, c, seqlens, None, d**-0.5, o, lse, splits,
                                               config=cfg)
                    fn()
                    err = (o.float() - ref.float()).abs().max().item()
                    us = _bench(fn)
                except Exception as e:  # noqa: BLE001 (an out-of-resources config)
                    print(f"# {b}x{t} bias={bias} {cfg} x{mult}: {type(e).__name__}", flush=True)
                    continue
                record("lapse", cfg, splits, "bshd", us, err)
        # the default configuration in the heads-outermost layout
        q2, k2, v2, c2, _ = _case(b, t, h, d, bias, "bhsd", c_layout)
        fn = lambda: launch_decode(q2, k2, v2, c2, seqlens, None, d**-0.5, o, lse)
        fn()
        record("lapse-default", {}, default_splits, "bhsd", _bench(fn), None)
        if not bias:
            # the dense Transformer layer's call: cuDNN SDPA over the whole buffer with a mask
            qs = q[:, :, None]  # [B, H, 1, D]
            ks, vs = k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D] views
            mask = (torch.arange(k.shape[1], device="cuda") < t)[None, None, None]
            fn = lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
            record("sdpa-default-masked", {}, None, "bshd", _bench(fn), None)
    return rows


def bench_gemms(args) -> list[dict]:
    rows = []
    c, hidden = 768, 2048
    for m in args.gemm_rows:
        x = torch.randn(m, c, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(c, c, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        wf = torch.cat(ws)
        mlp = [torch.randn(hidden, c, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        mf = torch.cat(mlp)
        cases = {
            "q,k,v,o_gate separate (4 x 768->768)": lambda: [F.linear(x, w) for w in ws],
            "q,k,v,o_gate fused (768->3072)": lambda: F.linear(x, wf),
            "q,k,v separate (3 x 768->768)": lambda: [F.linear(x, w) for w in ws[:3]],
            "q,k,v fused (768->2304)": lambda: F.linear(x, wf[: 3 * c]),
            "gate,up separate (2 x 768->2048)": lambda: [F.linear(x, w) for w in mlp],
            "gate,up fused (768->4096)": lambda: F.linear(x, mf),
        }
        for name, fn in cases.items():
            us = _bench(fn)
            row = dict(rows=m, gemm=name, us=round(us, 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["8x4096", "4x16384", "2x32768", "1x4096", "32x4096"])
    ap.add_argument("--block-n", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--warps", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--split-mults", nargs="+", type=float, default=[1.0])
    ap.add_argument("--gemm-rows", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--c-layouts", nargs="+", default=["bsh"], choices=["bhs", "bsh"],
                    help="c's memory: bsh (heads innermost, the DenseStore's), bhs (slots innermost)")
    ap.add_argument("--out", default="tune_decode.json")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, kernel=tune_kernel(shapes, args), gemms=bench_gemms(args))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
