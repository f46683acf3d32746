"""Where the op's host time goes (issue 16): ``forgetting_attention`` (Triton backend, value
checks off) called many times at a shape whose GPU work is short, so each call's wall time is
its host time; cProfile splits it by function. Dense and ACP (``acp="auto"``), forward alone and
forward+backward.

    bash scripts/gpu.sh python3 scripts/diag_op_cprofile.py --shape 1x512x24x64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F

from lapse.ops.forgetting import forgetting_attention, set_value_checks, triton_fwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1x512x24x64", help="B x T x H x D")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--sort", default="tottime", help="pstats order: tottime, cumulative")
    ap.add_argument("--only", default="", help="only the calls whose name contains this")
    args = ap.parse_args()
    set_value_checks(False)
    b, t, h, d = (int(x) for x in args.shape.split("x"))
    q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    lg = F.logsigmoid(torch.randn(b, t, h, device="cuda") + 3).requires_grad_()
    do = torch.randn_like(q)
    calls = {
        "dense fwd": lambda: forgetting_attention(q, k, v, lg, backend="triton"),
        "acp fwd": lambda: forgetting_attention(q, k, v, lg, acp="auto", backend="triton"),
        "acp fwd+bwd": lambda: torch.autograd.grad(
            forgetting_attention(q, k, v, lg, acp="auto", backend="triton"), (q, k, v, lg), do),
        "acp fwd, ROUTE at any size": lambda: forgetting_attention(q, k, v, lg, acp="auto", backend="triton"),
    }
    for name, fn in calls.items():
        if args.only not in name:
            continue
        if "ROUTE" in name:
            triton_fwd.ROUTE_MIN_ROWS = 0  # the routed launches (at D 128; D 64 from 16k keys)
        grad = "bwd" in name
        with torch.set_grad_enabled(grad):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.calls * 1e3
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(args.sort).print_stats(args.top)
        print(f"=== {name}: {wall:.3f} ms a call (wall, no profiler)")
        print("\n".join(s.getvalue().splitlines()[6:6 + args.top + 3]))


if __name__ == "__main__":
    main()
