"""Where the backward with dS kept spends its time, kernel by kernel (issue 16).

``FUSE_DQ="ds"`` (the dK/dV kernel stores dS and its key tiles' row sums; one product a tile
makes dQ) against the two-kernel default, on the issue-2 workload, dense: each kernel's
device time per call under ``torch.profiler``.

    bash scripts/gpu.sh python3 scripts/diag_bwd_ds.py --out bwd_ds_profile.json
"""

# ruff: noqa: B023 (each closure over loop variables is profiled inside its own iteration)
from __future__ import annotations

import argparse

import torch
from profile_fox_op import _kernels  # the per-kernel profile (scripts/ on the path)
from tune_fox_fwd import _dump, _prepared

from lapse.ops.forgetting import set_value_checks, triton_bwd, triton_fwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x128", "16384x128", "4096x64"])
    ap.add_argument("--out", default="bwd_ds_profile.json")
    args = ap.parse_args()
    set_value_checks(False)
    rows = []
    for shape in args.shapes:
        t, d, h, b, q, k, v, p, c_hi, c_lo, _ = _prepared(shape)
        do = torch.randn_like(q)
        o, lse2 = torch.empty_like(q), torch.empty_like(c_hi)
        triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, None, None, p, o, lse2)
        grads = [torch.empty_like(x) for x in (q, k, v)] + [torch.empty_like(lse2) for _ in range(2)]
        kv0, q0 = triton_bwd.bwd_config(d, 1, False)
        for name, kv in (("default", kv0), ("ds", dict(kv0, FUSE_DQ="ds"))):
            times = _kernels(lambda: triton_bwd.launch_bwd(q, k, v, o, do, lse2, None, c_hi, c_lo, None, None,
                                                           None, p, *grads, (kv, q0)))
            rows.append(dict(T=t, D=d, H=h, B=b, variant=name, kernels=times))
            print(f"T {t} D {d} {name}: " + ", ".join(f"{n[:24]} {ms:.3f}" for n, ms in times.items()
                                                     if ms > 0.005), flush=True)
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
