"""How ACP's kernel time follows its kept window (issue 16: efficiency at short T).

Every head gets the same constant forget gate, chosen so that ACP keeps a band of about
``W`` 64-key blocks left of the diagonal, for several W. For each, the FoX kernels alone
(forward; backward with its rows) are timed with ACP and compared with the dense kernels
times the kept fraction: ``efficiency = t_dense * (1 - pruned) / t_acp``. Fitting
``t_acp = a + b * kept`` over the windows gives each program's fixed cost (``a``: loading
its tiles, the pipeline's start, writing its outputs) against the cost of the kept work.

    python scripts/diag_acp_window.py --shape 4096x64 --out acp_window.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import math

import torch
from tune_fox_fwd import _dump, _issue2, _ms  # the same workload, timer, output (scripts/ on the path)

from lapse.ops.forgetting import set_value_checks, triton_bwd, triton_fwd
from lapse.ops.forgetting.common import acp_delta, pruned_fraction, validate
from lapse.ops.forgetting.pruning import block_end_from_start, triton_block_start
from lapse.ops.forgetting.triton_ops import triton_gate_cumsum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "16384x64"])
    ap.add_argument("--windows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--out", default="acp_window.json")
    args = ap.parse_args()
    set_value_checks(False)
    rows = []
    for shape in args.shapes:
        t, d, h, b, (q, k, v, _) = _issue2(shape)
        do = torch.randn_like(q)
        for w in [0, *args.windows]:  # 0: dense
            lg = torch.zeros(b, t, h, device=q.device)
            p = validate(q, k, v, lg, None, None, "triton")
            delta = acp_delta("auto", math.exp(-10), q, k, p)
            if w:  # c_i - c_j = -r (i - j): blocks further than -delta / r keys apart are pruned
                lg.fill_(float(delta.min()) / (w * 64))
            c_hi, c_lo = triton_gate_cumsum(lg, p)
            bs = triton_block_start(c_hi, c_lo, delta, p) if w else None
            be = block_end_from_start(bs, p) if w else None
            pruned = float(pruned_fraction(bs, p).mean()) if w else 0.0
            o, lse2 = torch.empty_like(q), torch.empty_like(c_hi)
            grads = [torch.empty_like(x) for x in (q, k, v)] + [torch.empty_like(lse2) for _ in range(2)]
            fwd = _ms(lambda: triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, None, p, o, lse2))
            bwd = _ms(lambda: triton_bwd.launch_bwd(q, k, v, o, do, lse2, None, c_hi, c_lo, bs, be, None, p,
                                                    *grads))
            rows.append(dict(T=t, D=d, H=h, B=b, window_blocks=w, pruned=pruned, fwd_ms=fwd, bwd_ms=bwd))
            print(f"T {t} D {d} window {w:2d}: pruned {pruned:.3f}, fwd {fwd:.3f} ms, bwd {bwd:.3f} ms",
                  flush=True)
        dense = rows[-len(args.windows) - 1]
        for r in rows[-len(args.windows):]:
            keep = 1 - r["pruned"]
            r["fwd_eff"] = dense["fwd_ms"] * keep / r["fwd_ms"]
            r["bwd_eff"] = dense["bwd_ms"] * keep / r["bwd_ms"]
            print(f"  window {r['window_blocks']:2d}: efficiency fwd {r['fwd_eff']:.2f}, "
                  f"bwd {r['bwd_eff']:.2f}")
        # t_acp = a + b * keep: a is the cost no pruning removes
        for key in ("fwd_ms", "bwd_ms"):
            xs = torch.tensor([1 - r["pruned"] for r in rows[-len(args.windows):]], dtype=torch.float64)
            ys = torch.tensor([r[key] for r in rows[-len(args.windows):]], dtype=torch.float64)
            slope = ((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum()
            icpt = ys.mean() - slope * xs.mean()
            print(f"  {key}: t = {icpt:.3f} + {slope:.3f} x kept (dense {dense[key]:.3f})")
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
