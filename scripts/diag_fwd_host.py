"""Where the forward launch's host time goes, routed (``ROUTE``) or not (issue 16).

``launch_fwd`` on the issue-2 workload (24 heads, B x T = 32k) with ACP, called 200 times
while the GPU is kept busy, under cProfile: the mean host time a call and the functions
that take it.

    python scripts/diag_fwd_host.py --shape 4096x128
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import time

import torch

from lapse.bench.workloads import WorkloadSpec, make_workload
from lapse.ops.forgetting import set_value_checks, triton_fwd
from lapse.ops.forgetting.common import acp_delta, validate
from lapse.ops.forgetting.pruning import triton_block_start
from lapse.ops.forgetting.triton_ops import triton_gate_cumsum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4096x128")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    set_value_checks(False)
    t, d = (int(x) for x in args.shape.split("x"))
    wl = make_workload(WorkloadSpec(seq_len=t, heads=24, head_dim=d), device="cuda")
    q, k, v, lg = wl.q, wl.k, wl.v, wl.log_fgate
    p = validate(q, k, v, lg, None, None, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    bs = triton_block_start(c_hi, c_lo, acp_delta("auto", math.exp(-10), q, k, p), p)
    o, lse2 = torch.empty_like(q), torch.empty_like(c_hi)
    table = triton_fwd.fwd_config(d, 2, True, t)
    for route in (0, 1):
        cfg = dict(table, ROUTE=route)
        for _ in range(3):
            triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, None, p, o, lse2, cfg)
        torch.cuda.synchronize()
        a = torch.randn(8192, 8192, device="cuda")
        for _ in range(args.calls // 20 + 2):
            a @ a  # queued work, so that no call waits for the GPU
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(args.calls):
            triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, None, p, o, lse2, cfg)
        prof.disable()
        dt = (time.perf_counter() - t0) / args.calls * 1e3
        torch.cuda.synchronize()
        print(f"\n{args.shape} ROUTE {route}: {dt:.3f} ms a call on the host (under cProfile)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
