"""Where ACP's efficiency goes on the issue-2 workload: its global heads against its local ones.

The bench's workload (:mod:`lapse.bench.workloads`) has 30% global heads, which ACP prunes
nowhere, and 70% local ones, which keep a band of a few key blocks. The kernels alone are
timed on three head sets (all, global, local; each a contiguous copy of those heads): dense
and with ACP, forward and backward, with the tables' configs and with ``--fwd-variants`` /
``--bwd-variants`` (JSON objects merged into the ACP configs, the backward's as
``{"kv": {...}, "q": {...}}``). Read:

- the global heads with ACP against the same heads dense: the same work (nothing pruned),
  so any gap is what the ACP configs cost a full row;
- all heads with ACP against global dense + local ACP: what routing the unpruned heads to
  the dense kernels could give (each subset is its own launch, so its waves differ).

    python scripts/diag_acp_heads.py --shapes 4096x128 16384x128 --out acp_heads.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import json
import math

import torch
from tune_fox_fwd import _dump, _ms  # the same timer and output (scripts/ on the path)

from lapse.bench.workloads import WorkloadSpec, make_workload
from lapse.ops.forgetting import set_value_checks, triton_bwd, triton_fwd
from lapse.ops.forgetting.common import acp_delta, pruned_fraction, validate
from lapse.ops.forgetting.pruning import block_end_from_start, triton_block_start
from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

EPS = math.exp(-10)


def _time_set(q, k, v, lg, do, fwd_variants, bwd_variants) -> list[dict]:
    """Kernel times of one head set: dense, and ACP with the tables and each variant."""
    p = validate(q, k, v, lg, None, None, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    bs = triton_block_start(c_hi, c_lo, acp_delta("auto", EPS, q, k, p), p)
    be = block_end_from_start(bs, p)
    pruned = float(pruned_fraction(bs, p).mean())
    o, lse2 = torch.empty_like(q), torch.empty_like(c_hi)
    grads = [torch.empty_like(x) for x in (q, k, v)] + [torch.empty_like(lse2) for _ in range(2)]
    t, d = p.tq, p.d
    out = []
    runs = [("dense", None, triton_fwd.fwd_config(d, 2, False, t), triton_bwd.bwd_config(d, 1, False, t)),
            ("acp", bs, triton_fwd.fwd_config(d, 2, True, t), triton_bwd.bwd_config(d, 1, True, t))]
    kv0, q0 = runs[1][3]
    runs += [(f"acp fwd {x}", bs, {**runs[1][2], **json.loads(x)}, None) for x in fwd_variants]
    for x in bwd_variants:
        kv, qc = json.loads(x).get("kv", {}), json.loads(x).get("q", {})
        runs += [(f"acp bwd {x}", bs, None, ({**kv0, **kv}, {**q0, **qc}))]
    for name, bsx, fcfg, bcfg in runs:
        bex = be if bsx is not None else None
        fwd = bwd = float("nan")
        try:  # an option out of resources: NaN, and on
            if fcfg is not None:
                fwd = _ms(lambda: triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bsx, None, p, o, lse2, fcfg))
            if bcfg is not None:
                triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bsx, None, p, o, lse2)
                bwd = _ms(lambda: triton_bwd.launch_bwd(q, k, v, o, do, lse2, None, c_hi, c_lo, bsx, bex,
                                                        None, p, *grads, bcfg))
        except Exception as e:  # noqa: BLE001
            print(f"{name}: {type(e).__name__}: {str(e)[:160]}")
        out.append(dict(variant=name, pruned=pruned if bsx is not None else 0.0, fwd_ms=fwd, bwd_ms=bwd,
                        heads=p.hq, fwd_cfg=fcfg, bwd_cfg=bcfg))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "16384x64", "4096x128", "16384x128"])
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--fwd-variants", nargs="*", default=[],
                    help="JSON: options over the ACP forward's table")
    ap.add_argument("--bwd-variants", nargs="*", default=[],
                    help='JSON {"kv": {...}, "q": {...}}: options over the ACP backward\'s tables')
    ap.add_argument("--out", default="acp_heads.json")
    args = ap.parse_args()
    set_value_checks(False)
    rows = []
    for shape in args.shapes:
        t, d = (int(x) for x in shape.split("x"))
        wl = make_workload(WorkloadSpec(seq_len=t, heads=args.heads, head_dim=d), device="cuda")
        sets = {"all": torch.arange(args.heads, device="cuda"),
                "global": (~wl.is_local).nonzero()[:, 0], "local": wl.is_local.nonzero()[:, 0]}
        for name, idx in sets.items():
            q, k, v = (x[:, :, idx].contiguous() for x in (wl.q, wl.k, wl.v))
            lg = wl.log_fgate[:, :, idx].contiguous()
            do = torch.randn_like(q)
            for r in _time_set(q, k, v, lg, do, args.fwd_variants, args.bwd_variants):
                rows.append(dict(T=t, D=d, B=wl.spec.batch, set=name, **r))
                print(f"T {t} D {d} {name:6s} ({r['heads']:2d} heads) {r['variant']}: "
                      f"pruned {r['pruned']:.3f}, fwd {r['fwd_ms']:.3f} ms, bwd {r['bwd_ms']:.3f} ms",
                      flush=True)
            del q, k, v, lg, do
        _summary([r for r in rows if r["T"] == t and r["D"] == d])
    _dump(args.out, rows)


def _summary(rows: list[dict]) -> None:
    """All heads with ACP against global dense + local ACP, and the efficiencies."""
    get = {(r["set"], r["variant"]): r for r in rows}
    for key in ("fwd_ms", "bwd_ms"):
        a_acp, a_dense = get[("all", "acp")][key], get[("all", "dense")][key]
        g_acp, g_dense = get[("global", "acp")][key], get[("global", "dense")][key]
        l_acp, l_dense = get[("local", "acp")][key], get[("local", "dense")][key]
        kept_all, kept_l = 1 - get[("all", "acp")]["pruned"], 1 - get[("local", "acp")]["pruned"]
        split = g_dense + l_acp
        print(f"  {key[:3]}: all acp {a_acp:.3f} (eff {a_dense * kept_all / a_acp:.2f}) | global acp "
              f"{g_acp:.3f} dense {g_dense:.3f} | local acp {l_acp:.3f} "
              f"(eff {l_dense * kept_l / l_acp:.2f}) | "
              f"global dense + local acp {split:.3f} (eff {a_dense * kept_all / split:.2f})")


if __name__ == "__main__":
    main()
