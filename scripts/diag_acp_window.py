"""How ACP's kernel time follows its kept window (issue 16: efficiency at short T).

Every head gets the same constant forget gate, chosen so that ACP keeps a band of about
``W`` 64-key blocks left of the diagonal, for several W. For each, the FoX kernels alone
(forward; backward with its rows) are timed with ACP and compared with the dense kernels
times the kept fraction: ``efficiency = t_dense * (1 - pruned) / t_acp``. Fitting
``t_acp = a + b * kept`` over the windows gives each program's fixed cost (``a``: loading
its tiles, the pipeline's start, writing its outputs) against the cost of the kept work.

    python scripts/diag_acp_window.py --shapes 4096x64 --out acp_window.json

``--fwd-variants`` / ``--bwd-variants`` (JSON objects merged into the tables' configs; the
backward's as ``{"kv": {...}, "q": {...}}``) time other launch options the same way, e.g.
``'{"TMA": false}'`` or ``'{"maxnreg": 168}'`` (three programs a multiprocessor).
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--fwd-variants", nargs="*", default=[], help="JSON: options over the forward's table")
    ap.add_argument("--bwd-variants", nargs="*", default=[],
                    help='JSON {"kv": {...}, "q": {...}}: options over the backward\'s tables')
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
            fwd0 = triton_fwd.fwd_config(d, 2, bool(w))
            kv0, q0 = triton_bwd.bwd_config(d, 1, bool(w))
            variants = [("default", fwd0, (kv0, q0))]
            variants += [(f"fwd {x}", {**fwd0, **json.loads(x)}, None) for x in args.fwd_variants]
            for x in args.bwd_variants:
                kv, qc = json.loads(x).get("kv", {}), json.loads(x).get("q", {})
                variants += [(f"bwd {x}", None, ({**kv0, **kv}, {**q0, **qc}))]
            for name, fcfg, bcfg in variants:  # a variant of one direction times that one only
                fwd = bwd = float("nan")
                try:  # an option out of resources: NaN, and on
                    if fcfg is not None:
                        fwd = _ms(lambda: triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, None, p, o, lse2,
                                                                fcfg))
                    if bcfg is not None:
                        triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, None, p, o, lse2)
                        bwd = _ms(lambda: triton_bwd.launch_bwd(q, k, v, o, do, lse2, None, c_hi, c_lo, bs,
                                                                be, None, p, *grads, bcfg))
                except Exception as e:  # noqa: BLE001
                    print(f"{name}: {type(e).__name__}: {str(e)[:160]}")
                rows.append(dict(T=t, D=d, H=h, B=b, window_blocks=w, pruned=pruned, variant=name,
                                 fwd_ms=fwd, bwd_ms=bwd))
                print(f"T {t} D {d} window {w:2d} {name}: pruned {pruned:.3f}, fwd {fwd:.3f} ms, "
                      f"bwd {bwd:.3f} ms", flush=True)
        for name in dict.fromkeys(r["variant"] for r in rows if r["T"] == t and r["D"] == d):
            mine = [r for r in rows if r["T"] == t and r["D"] == d and r["variant"] == name]
            dense, acp = mine[0], mine[1:]
            print(f"  {name}:")
            for r in acp:
                keep = 1 - r["pruned"]
                r["fwd_eff"] = dense["fwd_ms"] * keep / r["fwd_ms"]
                r["bwd_eff"] = dense["bwd_ms"] * keep / r["bwd_ms"]
                print(f"    window {r['window_blocks']:2d}: efficiency fwd {r['fwd_eff']:.2f}, "
                      f"bwd {r['bwd_eff']:.2f}")
            # t_acp = a + b * keep: a is the cost no pruning removes
            xs = torch.tensor([1 - r["pruned"] for r in acp], dtype=torch.float64)
            for key in ("fwd_ms", "bwd_ms"):
                ys = torch.tensor([r[key] for r in acp], dtype=torch.float64)
                slope = ((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum()
                icpt = ys.mean() - slope * xs.mean()
                print(f"    {key}: t = {icpt:.3f} + {slope:.3f} x kept (dense {dense[key]:.3f})")
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
