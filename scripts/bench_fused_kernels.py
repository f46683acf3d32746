"""The fused decode kernels alone (issue 12): us per call under CUDA-graph replay at a
125M FoX (Pro) layer's shapes (12 heads of 64, C 768, bf16, ``c`` float64), of

- the split-K decode kernel without and with the output norm and gate in its epilogue
  (one split, the launcher's choice at 8 x 4k) or in the merge (two splits);
- ``forgetting_decode_input``'s kernel (gates, ``c_t``, KV-shift, QK-norm, cache writes).

    python scripts/bench_fused_kernels.py --shapes 8x4096 4x16384 --out kernels.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from lapse.ops.forgetting.decode_input_triton import launch_decode_input
from lapse.ops.forgetting.decode_triton import launch_decode


def _bench(fn) -> float:
    fn()
    torch.cuda.synchronize()  # a fault shows here, at the kernel that made it
    us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    torch.cuda.synchronize()
    return us


def attention(b: int, t: int, h: int, d: int, splits) -> dict:
    torch.manual_seed(0)
    s = t + 64
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, h, d, device=dev, dtype=dt)
    k = torch.randn(b, s, h, d, device=dev, dtype=dt)
    v = torch.randn(b, s, h, d, device=dev, dtype=dt)
    c = torch.cumsum(-torch.rand(b, s, h, device=dev, dtype=torch.float64), 1)
    lens = torch.full((b,), t, dtype=torch.int32, device=dev)
    w = torch.randn(h, d, device=dev, dtype=dt)
    g = torch.randn(b, 4 * h * d, device=dev, dtype=dt)[:, : h * d].view(b, h, d)
    o = torch.empty_like(q)
    lse = torch.empty(b, h, device=dev, dtype=torch.float32)
    out = {}
    for name, gate in (("plain", None), ("gated", (w, g, 1e-6))):
        fn = lambda: launch_decode(q, k, v, c, lens, None, d**-0.5, o, lse, num_splits=splits, out_gate=gate)
        out[name] = round(_bench(fn), 2)
    return out


def decode_input(b: int, h: int, d: int, c: int) -> float:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    proj = torch.randn(b, 4 * h * d, device=dev, dtype=dt)
    q, k, v = (proj[:, i * h * d : (i + 1) * h * d].view(b, h, d) for i in range(3))
    args = dict(
        x=torch.randn(b, c, device=dev, dtype=dt),
        q=q,
        k=k,
        v=v,
        fgate_weight=torch.randn(h, c, device=dev, dtype=dt),
        fgate_bias=torch.randn(h, device=dev, dtype=dt),
        k_shift_weight=torch.randn(h, c, device=dev, dtype=dt),
        v_shift_weight=torch.randn(h, c, device=dev, dtype=dt),
        q_norm_weight=torch.randn(h, d, device=dev, dtype=dt),
        k_norm_weight=torch.randn(h, d, device=dev, dtype=dt),
        eps=1e-5,
        c_last=torch.zeros(b, h, device=dev, dtype=torch.float64),
        k_prev=torch.zeros(b, 1, h, d, device=dev, dtype=dt),
        v_prev=torch.zeros(b, 1, h, d, device=dev, dtype=dt),
        k_cache=torch.zeros(b, 64, h, d, device=dev, dtype=dt),
        v_cache=torch.zeros(b, 64, h, d, device=dev, dtype=dt),
        c_cache=torch.zeros(b, 64, h, device=dev, dtype=torch.float64),
        slot=torch.full((b,), 3, device=dev, dtype=torch.long),
        q_out=torch.empty(b, h, d, device=dev, dtype=dt),
    )
    return round(_bench(lambda: launch_decode_input(**args)), 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["8x4096", "4x16384", "1x4096"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        b, t = (int(x) for x in shape.split("x"))
        for splits in (None, 1, 2):
            row = dict(shape=shape, splits=splits or "auto", **attention(b, t, 12, 64, splits))
            rows.append(row)
            print(row, flush=True)
        row = dict(shape=shape, decode_input_us=decode_input(b, 12, 64, 768))
        rows.append(row)
        print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
