"""The FoX backward kernels' launch options on a GPU (issue 16), beside SDPA's default backend.

Compiled for sm_90 on the CPU (``scripts/kernel_resources.py --bwd-sweep``), the dK/dV
kernel at its default options (BM 32, BN 64, 4 warps, 3 stages) spilled 604 bytes per
thread at D 64 and 1.6 KB at D 128 while its group size was a run-time number (before
96b5d97; now 0 and 196 B); several options spilled nothing (8 warps, 2 stages). The
earlier tuning (``gpu_fox_dev.py --tune``) never tried 2 stages with 8 warps. This
times the dK/dV options with the dQ kernel at its default, then the dQ options with dK/dV at
its default, on the issue-2 workload (B x T = 32k; 24 heads of 64, 12 of 128), dense and
with ACP (dK/dV's BM and dQ's BN must divide the 64-key ACP block). Every option's
gradients are checked against the default options' (relative difference) and poisoned
first. Registers and spills of each option: ``scripts/kernel_resources.py --bwd-sweep``
(the same compiler, no GPU needed).

Measured in the eleventh session (docs/bench/session11/h100-issue16-bwd-fox-bwd.json): no
option beat the defaults. Now by default it times the fused backward (``FUSE_DQ``: one
kernel, dQ through atomics; ``--fuse-modes``: a thread an element, or a tile at a time by
the tensor-memory engine) against the two-kernel default; ``--sweep`` adds the separate
kernels' options again.

    python scripts/tune_fox_bwd.py --out fox_bwd.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from tune_fox_fwd import _dump, _ms, _prepared  # the same workload, timer, output (scripts/ on the path)

from lapse.ops.forgetting import set_value_checks, triton_bwd, triton_fwd
from lapse.ops.forgetting.pruning import block_end_from_start

# (BM, BN, warps, stages) by head dim: dK/dV options that spill nothing compiled for sm_90
# since 96b5d97 (docs/bench/sm90-fox-kernel-resources-96b5d97.txt; the default spills
# nothing at D 64 and 196 B per thread at D 128)
DKDV = {
    64: [(32, 64, 8, 2), (32, 128, 8, 2), (64, 32, 4, 3), (64, 32, 8, 2), (32, 32, 4, 3), (16, 64, 4, 2),
         (16, 128, 8, 2)],
    128: [(32, 32, 4, 3), (32, 64, 8, 2), (64, 32, 4, 3), (64, 32, 8, 2), (16, 64, 8, 2), (16, 128, 8, 2)],
}
# (BM, BN, warps, stages) of the fused kernel. With dQ added a thread an element
# (FUSE_DQ=True) spills of 24-192 B per thread at sm_90; with bulk adds (FUSE_DQ="tma")
# none at D 64 for 32 x 64 / 4 warps and BM 16-32 x 128 / 8 warps (scripts/kernel_resources.py
# --fused). With ACP a key tile divides the 64-key block, so BN 128 is dense only; 128-key
# tiles halve the float32 dQ traffic of the adds.
FUSED = {
    64: [(32, 64, 4, 3), (32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 2), (16, 64, 4, 3), (64, 128, 8, 2)],
    128: [(32, 128, 8, 2), (16, 128, 8, 2), (16, 64, 4, 3), (32, 64, 8, 2), (32, 64, 4, 3)],
}
DQ = {
    64: [(64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
    128: [(64, 32, 8, 2), (128, 32, 8, 2), (32, 64, 8, 2), (128, 64, 8, 3)],  # 0, 0, 0, 20
}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "16384x64", "4096x128", "16384x128"],
                    help="T x D; heads 24 at D 64, 12 at D 128, B = 32768 / T")
    ap.add_argument("--out", default="fox_bwd.json")
    ap.add_argument("--group", type=int, default=1,
                    help="query heads a key head (grouped-query: the keys keep every group-th head)")
    ap.add_argument("--variants", nargs="+", type=json.loads, default=[],
                    help='JSON dicts {"kv": {...}, "q": {...}} over the two kernels\' default options, '
                         "timed beside the default (with --no-fused and no --sweep: only these)")
    ap.add_argument("--sweep", action="store_true", help="also the separate kernels' options")
    ap.add_argument("--no-fused", action="store_true", help="leave out the fused kernel's options")
    ap.add_argument("--fuse-modes", nargs="+", default=["tma"], choices=["atomics", "tma"],
                    help="the fused kernel's dQ adds: a thread an element (FUSE_DQ=True), or a tile "
                         "by the tensor-memory engine (FUSE_DQ='tma')")
    ap.add_argument("--rows4-off", action="store_true",
                    help="also the dK/dV kernel reading lse, delta and c_hi as three loads (ROWS4=False) "
                         "and the dQ kernel reading c_hi and c_lo as two (PAIRS=False)")
    ap.add_argument("--bias-off", action="store_true",
                    help="also the default kernels without the FoX bias and/or the gate's sums, in "
                         "one kernel or both (bias-0-0: plain causal softmax attention's backward in "
                         "the same kernels; timing only)")
    args = ap.parse_args()
    set_value_checks(False)
    rows = []
    for shape in args.shapes:
        t, d, h, b, q, k, v, p, c_hi, c_lo, bs = _prepared(shape, args.group)
        do = torch.randn_like(q)
        be = block_end_from_start(bs, p)
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))

        def sdpa_fwd():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=args.group > 1)
        sdpa_ms = _ms(lambda: sdpa_fwd().backward(do.transpose(1, 2)))
        sdpa_fwd_ms = _ms(sdpa_fwd)
        for acp in (False, True):
            bsx, bex = (bs, be) if acp else (None, None)
            o, lse2 = torch.empty_like(q), torch.empty_like(c_hi)
            triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bsx, None, p, o, lse2)
            kv0, q0 = triton_bwd.bwd_config(d, args.group, acp, p.tk)
            grads = [torch.empty_like(x) for x in (q, k, v)] + [torch.empty_like(lse2) for _ in range(2)]

            def run(cfgs):
                for x in grads:
                    x.fill_(float("nan"))
                triton_bwd.launch_bwd(q, k, v, o, do, lse2, None, c_hi, c_lo, bsx, bex, None, p, *grads, cfgs)
                return [x.clone() for x in grads[:3]]

            ref = run((kv0, q0))
            options = [("default", kv0, q0)]
            # the rows (delta, lse less c_lo) made by the dQ kernel run first, or by a launch of their own
            options += [(f"variant-{json.dumps(x, sort_keys=True)}", {**kv0, **x.get("kv", {})},
                         {**q0, **x.get("q", {})}) for x in args.variants]
            if not args.variants:
                options += [("make-rows", kv0, dict(q0, MAKE_ROWS=not q0.get("MAKE_ROWS", False)))]
            if not args.no_fused:
                options += [(f"fused-{mode}", dict(BM=bm, BN=bn, num_warps=w, num_stages=st,
                                                   FUSE_DQ="tma" if mode == "tma" else True), q0)
                            for mode in args.fuse_modes
                            for bm, bn, w, st in FUSED[d] if not (acp and (64 % bm or 64 % bn))]
            if args.rows4_off:
                options += [("rows4-off", dict(kv0, ROWS4=False), q0)]
                options += [("pairs-off", kv0, dict(q0, PAIRS=False))]
            if args.bias_off:  # BIAS: 1 all, 0 none, 2 the gate's sums only, 3 the bias only
                options += [(f"bias-{a}-{b}", dict(kv0, BIAS=a), dict(q0, BIAS=b))
                            for a, b in ((0, 0), (2, 2), (3, 3), (0, 1), (1, 0))]
            if args.sweep:
                options += [("dkdv", dict(BM=bm, BN=bn, num_warps=w, num_stages=st), q0)
                            for bm, bn, w, st in DKDV[d] if not (acp and 64 % bm)]
                options += [("dq", kv0, dict(BM=bm, BN=bn, num_warps=w, num_stages=st))
                            for bm, bn, w, st in DQ[d] if not (acp and 64 % bn)]
            for varied, kv, qc in options:
                row = dict(T=t, D=d, H=h, B=b, group=args.group, acp=acp, varied=varied, dkdv=kv, dq=qc,
                           sdpa_default_fwdbwd_ms=sdpa_ms, sdpa_default_fwd_ms=sdpa_fwd_ms)
                try:
                    got = run((kv, qc))
                    row["nan"] = any(bool(x.isnan().any()) for x in got)
                    row["rel_diff"] = max(_rel(x, r) for x, r in zip(got, ref, strict=True))
                    row["bwd_ms"] = _ms(lambda: triton_bwd.launch_bwd(
                        q, k, v, o, do, lse2, None, c_hi, c_lo, bsx, bex, None, p, *grads, (kv, qc)))
                except Exception as e:  # noqa: BLE001 - out of resources: report and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
        print(f"T {t} D {d}: SDPA default fwd+bwd {sdpa_ms:.3f} ms", flush=True)
        _dump(args.out, rows)  # after every shape: a run cut short keeps what it measured
    _dump(args.out, rows)
    print("\nT D acp | default bwd ms | best fused option | best dK/dV option | best dQ option")
    for (t, d, acp), group in itertools.groupby(rows, key=lambda r: (r["T"], r["D"], r["acp"])):
        ok = [r for r in group if "bwd_ms" in r and not r["nan"] and r["rel_diff"] < 2e-2]
        default = next(r for r in ok if r["varied"] == "default")
        out = [f"{t} {d} {int(acp)} | {default['bwd_ms']:.3f}"]
        for varied in ("fused", "dkdv", "dq"):
            mine = [r for r in ok if r["varied"].startswith(varied)] or [default]
            best = min(mine, key=lambda r: r["bwd_ms"])
            out.append(f"{best['bwd_ms']:.3f} {best['dq' if varied == 'dq' else 'dkdv']}")
        print(" | ".join(out))


if __name__ == "__main__":
    main()
