"""Times the decode step's weight products on the GPU: cuBLAS (``F.linear``) against a
skinny Triton kernel (below: each program streams ``BN`` weight rows once against all
``M <= 64`` rows of ``x``) over a grid of launch options, under
CUDA-graph replay (what a compiled step pays), with each result checked against cuBLAS
and the achieved share of HBM bandwidth (the weight's bytes, read once). Also counts the
kernels cuBLAS launches per product (profiler). An experiment (issue 12): on an H100 the
kernel matched cuBLAS within about 5% either way (docs/bench/decode/h100-skinny-linear.json),
so the library keeps cuBLAS; both sit at a ~3.3 us floor per product under CUDA graphs.

    python scripts/bench_skinny_linear.py --out skinny.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing
from torch import Tensor

HBM = 3.35e12  # H100 SXM bytes/s
# (K, N) of a 125M model's decode products: FoX (Pro) q,k,v,o_gate; LLaMA q,k,v; o_proj;
# gate,up; down
SHAPES = [(768, 3072), (768, 2304), (768, 768), (768, 4096), (2048, 768)]


@triton.jit
def _skinny_linear_kernel(
    x,
    w,
    y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    o_m = tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m = o_m < M
    m_n = o_n < N
    p_x = x + o_m[:, None] * stride_xm + o_k[None, :]  # [BM, BK]
    p_w = w + o_n[:, None] * stride_wn + o_k[None, :]  # [BN, BK]
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        m_k = (k0 + o_k) < K
        b_x = tl.load(p_x + k0, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w + k0, mask=m_n[:, None] & m_k[None, :], other=0.0)
        if USE_DOT:
            b_acc += tl.dot(b_x, tl.trans(b_w))
        else:
            prod = b_x.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :]  # [BM, BN, BK]
            b_acc += tl.sum(prod, axis=2)
    p_y = y + o_m[:, None] * stride_ym + o_n[None, :]
    tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def launch_skinny_linear(x: Tensor, w: Tensor, y: Tensor, config: dict | None = None) -> None:
    """Writes ``x [M, K] @ w[N, K].T`` into ``y [M, N]`` (all contiguous in their last dim).

    ``config``: ``BN``, ``BK``, ``USE_DOT``, ``num_warps``, ``num_stages`` (defaults below).
    """
    m, k = x.shape
    n = w.shape[0]
    config = dict(BN=32, BK=128, USE_DOT=True, num_warps=4, num_stages=3) | (config or {})
    use_dot = config.pop("USE_DOT")
    block_m = max(16 if use_dot else 1, triton.next_power_of_2(m))
    bn = config.pop("BN")
    _skinny_linear_kernel[(triton.cdiv(n, bn),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BM=block_m, BN=bn, USE_DOT=use_dot, **config,
    )


def _bench(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def _kernels_per_call(fn) -> float:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA") / 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[8, 1, 32])
    ap.add_argument("--block-n", nargs="+", type=int, default=[16, 32, 64])
    ap.add_argument("--block-k", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--warps", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--dot", nargs="+", type=int, default=[1, 0])
    ap.add_argument("--out", default="skinny.json")
    args = ap.parse_args()
    rows = []
    for m, (k, n) in itertools.product(args.rows, SHAPES):
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ref = F.linear(x, w)
        nbytes = n * k * 2
        us = _bench(lambda: F.linear(x, w))
        base = dict(rows=m, k=k, n=n, provider="cublas", us=round(us, 2),
                    hbm_share=round(nbytes / us / 1e6 / (HBM / 1e12), 3),
                    kernels=_kernels_per_call(lambda: F.linear(x, w)))
        rows.append(base)
        print(json.dumps(base), flush=True)
        y = torch.empty_like(ref)
        best = None
        for bn, bk, warps, stages, dot in itertools.product(args.block_n, args.block_k, args.warps,
                                                            args.stages, args.dot):
            if not dot and bn * bk * max(m, 1) > 32768:  # the [M, BN, BK] product spills
                continue
            cfg = dict(BN=bn, BK=bk, USE_DOT=bool(dot), num_warps=warps, num_stages=stages)
            try:
                launch_skinny_linear(x, w, y, dict(cfg))
                err = (y.float() - ref.float()).abs().max().item()
                us = _bench(lambda: launch_skinny_linear(x, w, y, dict(cfg)))
            except Exception as e:  # noqa: BLE001 (out of resources)
                print(f"# {m} {k}x{n} {cfg}: {type(e).__name__}", flush=True)
                continue
            row = dict(rows=m, k=k, n=n, provider="skinny", config=cfg, us=round(us, 2),
                       hbm_share=round(nbytes / us / 1e6 / (HBM / 1e12), 3), max_err=err)
            rows.append(row)
            if best is None or us < best["us"]:
                best = row
        print("best", json.dumps(best), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
