"""The persistent Gluon ACP forward (``gluon_fwd.launch_acp``) against the Triton kernel on
the issue-2 workload: correctness first (outputs and lse against the Triton ACP forward's,
the Gluon outputs poisoned with NaN first), then the kernels alone, ms.

Timed: the ACP table with its Gluon launch taken out (the Triton kernel), and as it is
(``table acp``: at D 128 its routed launch is this kernel); the Triton table's two routed
launches alone (the heads ACP prunes nowhere on the dense tiles, ``ROUTE=1``; the others on the
ACP tiles, ``ROUTE=2``); the Gluon kernel on the pruned heads alone (``skip_full``) at each
``--variants`` option; the Gluon kernel on every head; and the routed pair with the Gluon kernel
as its second launch. The efficiency of a local-heads launch is against the dense forward's time
scaled by the local heads' share and kept fraction.

    python scripts/diag_gluon_acp.py --shapes 4096x64 16384x128 --out gluon_acp.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import json

import torch
from tune_fox_fwd import _dump, _ms  # the same timer and output (scripts/ on the path)

from lapse.bench.workloads import WorkloadSpec, make_workload
from lapse.ops.forgetting import gluon_fwd, set_value_checks, triton_fwd
from lapse.ops.forgetting.common import acp_delta, pruned_fraction, validate
from lapse.ops.forgetting.pruning import triton_block_start
from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

EPS = 2.718281828459045 ** -10


def _triton_launch(q, k, v, c_hi, c_lo, bs, p, o, lse2, route: int) -> None:
    """One of the Triton forward's routed launches alone: 1 the heads ACP prunes nowhere on
    the dense tiles, 2 the others on the ACP tiles."""
    acp = route == 2
    cfg = triton_fwd.fwd_config(p.d, q.element_size(), acp, p.tk)
    cfg.pop("ROUTE", None)
    cfg.pop("GLUON_ACP", None)  # the Triton kernel on either launch
    use_tma = triton_fwd.tma_mode(cfg.pop("TMA", False), q, k, v, p)
    pairs = torch.stack((c_hi, c_lo), -1)
    with triton_fwd.device_descriptors(use_tma == 1):
        triton_fwd._launch_fwd(q, k, v, c_hi, c_lo, bs, None, p, o, lse2, dict(cfg, ROUTE=route), use_tma,
                               not acp, pairs)


def _triton_table(p, q) -> dict:
    """The ACP forward's table without its Gluon launch (``GLUON_ACP``): the Triton kernel."""
    cfg = triton_fwd.fwd_config(p.d, q.element_size(), True, p.tk)
    cfg.pop("GLUON_ACP", None)
    return cfg


def _errors(o, lse2, o_ref, lse_ref, t) -> dict:
    rel = float((o.float() - o_ref.float()).norm() / o_ref.float().norm())
    return dict(o_rel=rel, o_max=float((o.float() - o_ref.float()).abs().max()),
                lse_max=float((lse2[..., :t] - lse_ref[..., :t]).abs().max()),
                nan=bool(torch.isnan(o).any() or torch.isnan(lse2[..., :t]).any()))


def _case(t: int, d: int, kv_heads: int | None, timed: bool, variants: list[str]) -> dict:
    """One workload: the checks, and with ``timed`` the kernels' times."""
    spec = WorkloadSpec(seq_len=t, tokens=t * max(1, 32768 // t), heads=24 if d == 64 else 12,
                        kv_heads=kv_heads, head_dim=d)
    wl = make_workload(spec, device="cuda")
    q, k, v, lg = wl.q, wl.k, wl.v, wl.log_fgate
    p = validate(q, k, v, lg, None, None, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    bs = triton_block_start(c_hi, c_lo, acp_delta("auto", EPS, q, k, p), p)
    pruned = float(pruned_fraction(bs, p).mean())
    o_ref, lse_ref = torch.empty_like(q), torch.empty_like(c_hi)
    triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, None, p, o_ref, lse_ref, _triton_table(p, q))
    row = dict(T=t, D=d, B=wl.spec.batch, HQ=p.hq, H=p.h, pruned=pruned)
    o, lse2 = torch.empty_like(q), torch.empty_like(c_hi)

    def gluon(cfg=None, skip_full=False):
        gluon_fwd.launch_acp(q, k, v, c_hi, c_lo, bs, p, o, lse2, cfg, skip_full)

    def route(n):
        _triton_launch(q, k, v, c_hi, c_lo, bs, p, o, lse2, n)

    for name, routed in (("all", False), ("routed", True)):
        o.fill_(float("nan"))
        lse2.fill_(float("nan"))
        if routed:
            route(1)
        gluon(None, routed)
        torch.cuda.synchronize()
        row[f"check_{name}"] = c = _errors(o, lse2, o_ref, lse_ref, t)
        print(f"T {t} D {d} HQ {p.hq} H {p.h} pruned {pruned:.3f} {name}: rel {c['o_rel']:.1e} "
              f"max {c['o_max']:.1e} lse {c['lse_max']:.1e} nan {c['nan']}", flush=True)
    if not timed:
        return row
    ms = {"dense": _ms(lambda: triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, None, None, p, o, lse2)),
          "triton acp": _ms(lambda: triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, None, p, o, lse2,
                                                          _triton_table(p, q))),
          "table acp": _ms(lambda: triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, None, p, o, lse2)),
          "triton route 1": _ms(lambda: route(1)),
          "triton route 2": _ms(lambda: route(2)),
          "gluon local": _ms(lambda: gluon(None, True))}
    for x in variants:
        cfg = {**gluon_fwd.acp_config(d), **json.loads(x)}
        try:
            ms[f"gluon local {x}"] = _ms(lambda: gluon(cfg, True))
        except Exception as e:  # noqa: BLE001 - an option out of resources: say so
            print(f"  {x}: {type(e).__name__}: {str(e)[:120]}")
    ms["gluon all"] = _ms(lambda: gluon(None, False))
    ms["routed: triton dense + gluon local"] = _ms(lambda: (route(1), gluon(None, True)))
    # the local heads' ideal: the dense time of their share at their kept fraction
    full = (bs[..., (t - 1) // 64] == 0).float().mean().item()  # (sequence, head)s kept whole
    local_kept = ((1 - pruned) - full) / max(1 - full, 1e-9)
    ideal_local = ms["dense"] * (1 - full) * local_kept
    row.update(ms=ms, full_share=full, ideal_local_ms=ideal_local,
               eff_all=ms["dense"] * (1 - pruned) / ms["triton acp"])
    print(f"  full share {full:.2f}, local kept {local_kept:.3f}, ideal local {ideal_local:.3f} ms")
    for n, m in ms.items():
        extra = f" (local eff {ideal_local / m:.2f})" if "local" in n or "route 2" in n else ""
        print(f"  {n}: {m:.3f} ms{extra}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "8192x64", "16384x64", "4096x128",
                                                    "8192x128", "16384x128"])
    ap.add_argument("--check-shapes", nargs="+", default=["1000x64", "1000x128", "4160x64"],
                    help="correctness only, also with 4 query heads a key head")
    ap.add_argument("--variants", nargs="*", default=['{"PROGRAMS": 2}', '{"PROGRAMS": 4}',
                                                      '{"STAGES": 2}', '{"STAGES": 4}'],
                    help="JSON over gluon_fwd.acp_config")
    ap.add_argument("--out", default="gluon_acp.json")
    args = ap.parse_args()
    set_value_checks(False)
    rows = []
    for shape in args.check_shapes + args.shapes:
        t, d = (int(x) for x in shape.split("x"))
        timed = shape in args.shapes
        for kv_heads in ([None] if timed else [None, (24 if d == 64 else 12) // 4]):
            rows.append(_case(t, d, kv_heads, timed, args.variants))
            torch.cuda.empty_cache()
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
