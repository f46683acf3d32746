"""One launch of each FoX forward kernel (the Triton one, then the Gluon one) on the
issue-2 workload, for Nsight Compute to profile (issue 16):

    ncu --kernel-name regex:_fwd_kernel --section SpeedOfLight --section WarpStateStats \
        python3 scripts/profile_fox_fwd.py --shape 4096x64

Each kernel is compiled and run once before the profiled launch (``--warm``), so the
profiled launches are the 2nd and 4th ``_fwd_kernel`` launches (``--launch-skip 1
--launch-count 1`` and so on), or pass ``--warm 0`` and profile them all.

``--acp-windows W...`` profiles the Triton forward with ACP instead, once per W: every head
with the constant gate that keeps a band of about W 64-key blocks
(``diag_acp_window.py``), W 0 meaning dense: what a program that does little work waits on.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from tune_fox_fwd import _issue2  # noqa: E402

from lapse.ops.forgetting import gluon_fwd, set_value_checks, triton_fwd  # noqa: E402
from lapse.ops.forgetting.common import acp_delta, validate  # noqa: E402
from lapse.ops.forgetting.pruning import triton_block_start  # noqa: E402
from lapse.ops.forgetting.triton_ops import triton_gate_cumsum  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4096x64", help="T x D of the issue-2 workload")
    ap.add_argument("--warm", type=int, default=1, help="unprofiled launches of each kernel first")
    ap.add_argument("--acp-windows", nargs="*", type=int, default=None,
                    help="the Triton forward with ACP keeping about W blocks a row, per W (0: dense)")
    args = ap.parse_args()
    set_value_checks(False)
    t, d, h, b, (q, k, v, lg) = _issue2(args.shape)
    if args.acp_windows is not None:
        o = torch.empty_like(q)
        for w in args.acp_windows:
            lg = torch.zeros(b, t, h, device=q.device)
            p = validate(q, k, v, lg, None, None, "triton")
            delta = acp_delta("auto", math.exp(-10), q, k, p)
            if w:
                lg.fill_(float(delta.min()) / (w * 64))
            c_hi, c_lo = triton_gate_cumsum(lg, p)
            bs = triton_block_start(c_hi, c_lo, delta, p) if w else None
            lse = torch.empty_like(c_hi)
            for _ in range(args.warm + 1):
                triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, None, p, o, lse)
            torch.cuda.synchronize()
            print(f"window {w}: launched", flush=True)
        return
    p = validate(q, k, v, lg, None, None, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    o, lse = torch.empty_like(q), torch.empty_like(c_hi)
    for name, cfg in (("triton", None), ("gluon", dict(GLUON=True, **gluon_fwd.gluon_config(d)))):
        for _ in range(args.warm + 1):
            triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, None, None, p, o, lse, cfg)
        torch.cuda.synchronize()
        print(f"{name}: launched", flush=True)


if __name__ == "__main__":
    main()
