"""The FoX forward kernel's launch options on a GPU (issue 16), beside SDPA's default backend.

Tiles (``BM`` x ``BN``; ``BN = 128`` dense only: with ACP a key tile must divide the
64-key ACP block), warps, pipeline stages and ``TMA`` (keys and values through tensor
descriptors) on the issue-2 workload (B x T = 32k; 24 heads of 64, 12 of 128), dense and
with ACP. Every option's output is checked against the default options' (relative
difference; the same function, so rounding only) and poisoned before it runs.

    python scripts/tune_fox_fwd.py --out fox_fwd.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import itertools
import json
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.testing

from lapse.ops.forgetting import set_value_checks, triton_fwd
from lapse.ops.forgetting.common import acp_delta, validate
from lapse.ops.forgetting.pruning import triton_block_start
from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

# gluon_fwd.py's options (BM, BN, warps, buffers, two compute partitions, registers per thread
# at launch): one 8-warp partition, two 4-warp ones, or one 4-warp partition with 128
# registers at launch so that two programs share a multiprocessor (this session's
# BM 128 with 4 warps and one partition spilled: 2.9-19.8 ms, dropped)
GLUON_OPTIONS = [(128, 64, 8, 2, False, None), (128, 64, 4, 2, True, None), (64, 64, 4, 2, False, 128),
                 (64, 64, 4, 3, False, 128)]


def _workload(b, t, h, d, seed=0):
    if os.environ.get("BENCH_WORKLOAD"):  # lapse bench attention's own tensors (its random local heads)
        from lapse.bench.workloads import WorkloadSpec, make_workload

        wl = make_workload(WorkloadSpec(seq_len=t, tokens=b * t, heads=h, head_dim=d), seed=seed)
        return wl.q, wl.k, wl.v, wl.log_fgate
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = F.rms_norm(torch.randn(b, t, h, d, device="cuda", generator=g), (d,)).bfloat16()
    k = F.rms_norm(torch.randn(b, t, h, d, device="cuda", generator=g), (d,)).bfloat16()
    v = torch.randn(b, t, h, d, device="cuda", generator=g).bfloat16()
    gl = torch.Generator().manual_seed(seed + 1)  # 70% local heads, the rest near 1
    n_local = round(0.7 * h)
    rate = torch.exp(torch.empty(h).uniform_(math.log(0.05), math.log(0.7), generator=gl))
    base = torch.full((h,), 9.0)
    base[:n_local] = -torch.log(torch.expm1(rate[:n_local]))
    logits = base.cuda() + 0.5 * torch.randn(b, t, h, device="cuda", generator=g)
    return q, k, v, F.logsigmoid(logits).float()


def _issue2(shape: str):
    """``T x D`` (or ``T x D x heads``) of the issue-2 workload: ``(T, D, heads, B, (q, k, v,
    log gates))``, by default 24 heads of 64 or 12 of 128 (``lapse bench attention`` takes 24 at
    every D), B = 32768 / T."""
    t, d, *heads = (int(x) for x in shape.split("x"))
    h = heads[0] if heads else 24 if d <= 64 else 12
    return t, d, h, 32768 // t, _workload(32768 // t, t, h, d)


def _op_calls(shape: str):
    """The op on the issue-2 workload of ``shape`` as three calls to time: ``fwd(acp)`` (no
    grad), ``fwd_bwd(acp)`` (every input's gradient under a fixed random ``dO``) and SDPA's
    default backend forward+backward on the same tensors; with ``(T, D, heads, B, inputs)``."""
    from lapse.ops.forgetting import forgetting_attention

    t, d, h, b, (q, k, v, lg) = _issue2(shape)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    lg = lg.detach().requires_grad_()
    do = torch.randn_like(q)
    qs, ks, vs = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dos = do.transpose(1, 2)

    def fwd(acp="auto"):
        with torch.no_grad():
            return forgetting_attention(q, k, v, lg, acp=acp)

    def fwd_bwd(acp="auto"):
        o = forgetting_attention(q, k, v, lg, acp=acp)
        return torch.autograd.grad(o, (q, k, v, lg), do)

    def sdpa():
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        return torch.autograd.grad(o, (qs, ks, vs), dos)

    return fwd, fwd_bwd, sdpa, (t, d, h, b, (q, k, v, lg))


def _prepared(shape: str, group: int = 1):
    """The issue-2 workload of ``shape`` ready for the kernels: ``(T, D, heads, B, q, k, v,
    problem, c_hi, c_lo, ACP block starts)``; with ``group`` > 1 the keys and values keep
    every group-th head (grouped-query attention, ``heads / group`` key heads)."""
    t, d, h, b, (q, k, v, lg) = _issue2(shape)
    if h % group:
        raise SystemExit(f"--group {group} does not divide the {h} heads of {shape}")
    k, v = k[:, :, ::group].contiguous(), v[:, :, ::group].contiguous()
    p = validate(q, k, v, lg, None, None, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    bs = triton_block_start(c_hi, c_lo, acp_delta("auto", math.exp(-10), q, k, p), p)
    return t, d, h, b, q, k, v, p, c_hi, c_lo, bs


def _dump(path: str, rows: list[dict]) -> None:
    """The rows as JSON, with the device and versions."""
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, rows=rows), f, indent=1)


def _ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "16384x64", "4096x128", "16384x128"],
                    help="T x D; heads 24 at D 64, 12 at D 128, B = 32768 / T")
    ap.add_argument("--block-m", nargs="+", type=int, default=[128])
    ap.add_argument("--block-n", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--tma", nargs="+", type=int, default=[0, 1],
                    help="0 pointer loads, 1 descriptors made by each program, 2 made on the host")
    ap.add_argument("--modes", nargs="+", choices=["dense", "acp"], default=["dense", "acp"])
    ap.add_argument("--keep-switches", action="store_true",
                    help="each option keeps the default config's other switches (PAIRS, LOOPS)")
    ap.add_argument("--gluon", action="store_true",
                    help="also gluon_fwd.py's Hopper kernel (dense), the options GLUON_OPTIONS")
    ap.add_argument("--only-gluon", action="store_true", help="the default and the Gluon options only")
    ap.add_argument("--bias-off", action="store_true",
                    help="also the default and the Gluon options without the FoX bias: plain causal "
                         "softmax attention in the same kernels (timing only; their outputs differ)")
    ap.add_argument("--pairs-off", action="store_true",
                    help="also the default options reading the keys' c_hi and c_lo as two loads "
                         "(PAIRS=False)")
    ap.add_argument("--variants", nargs="+", type=json.loads, default=[],
                    help="JSON dicts over the default options, timed instead of the tile grid, "
                         "e.g. '{\"ROW_BIAS\": true}'")
    ap.add_argument("--group", type=int, default=1,
                    help="query heads a key head (grouped-query: the keys keep every group-th head)")
    ap.add_argument("--out", default="fox_fwd.json")
    args = ap.parse_args()
    set_value_checks(False)
    rows = []
    for shape in args.shapes:
        t, d, h, b, q, k, v, p, c_hi, c_lo, bs = _prepared(shape, args.group)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        gqa = args.group > 1
        sdpa = _ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa))
        for acp in [m == "acp" for m in args.modes]:
            bsx = bs if acp else None
            o = torch.empty_like(q)
            lse = torch.empty_like(c_hi)
            triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bsx, None, p, o, lse)
            o_ref = o.float().clone()
            default = triton_fwd.fwd_config(d, 2, acp, t)
            grid = [None]
            grid += [("variant", {**default, **x}) for x in args.variants]
            if not (args.only_gluon or args.variants):
                grid += itertools.product(args.block_m, args.block_n, args.warps, args.stages, args.tma)
            if (args.gluon or args.only_gluon) and not acp:
                grid += [("gluon", dict(BM=bm, BN=bn, num_warps=w, STAGES=st, SPLIT=sp, maxnreg=r))
                         for bm, bn, w, st, sp, r in GLUON_OPTIONS]
            if args.pairs_off:  # the keys' c_hi and c_lo as two loads
                grid += [("variant", dict(default, PAIRS=False))]
            if args.bias_off and not acp:  # the same kernels without the FoX bias (timing only)
                grid += [("nobias", None)]
                grid += [("nobias", dict(GLUON=True, BM=bm, BN=bn, num_warps=w, STAGES=st, SPLIT=sp,
                                         maxnreg=r)) for bm, bn, w, st, sp, r in GLUON_OPTIONS]
            for opt in grid:
                if opt is None:
                    cfg = dict(default)
                elif opt[0] == "variant":
                    cfg = dict(opt[1])
                elif opt[0] == "nobias":
                    cfg = dict(opt[1] or default, BIAS=False)
                elif opt[0] == "gluon":
                    cfg = dict(GLUON=True, **opt[1])
                else:
                    bm, bn, w, st, tma = opt
                    if acp and 64 % bn:
                        continue
                    cfg = dict(BM=bm, BN=bn, num_warps=w, num_stages=st, TMA=(False, True, "host")[tma])
                    if args.keep_switches:
                        cfg = {**default, **cfg}
                row = dict(T=t, D=d, H=h, B=b, group=args.group, acp=acp, config=cfg if opt else "default",
                           sdpa_default_ms=sdpa)
                try:
                    o.fill_(float("nan"))
                    triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bsx, None, p, o, lse, cfg)
                    row["nan"] = bool(o.isnan().any())
                    row["rel_diff"] = ((o.float() - o_ref).norm() / o_ref.norm()).item()
                    row["ms"] = _ms(lambda: triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bsx, None, p,
                                                                  o, lse, cfg))
                    row["x_sdpa"] = row["ms"] / sdpa
                except Exception as e:  # noqa: BLE001 - out of resources: report and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
        print(f"T {t} D {d}: SDPA default {sdpa:.3f} ms", flush=True)
    _dump(args.out, rows)
    print("\nT D acp | default ms (x SDPA) | best ms (x SDPA) config | best without TMA")
    for (t, d, acp), group in itertools.groupby(rows, key=lambda r: (r["T"], r["D"], r["acp"])):
        ok = [r for r in group if "ms" in r and not r["nan"] and r["rel_diff"] < 1e-2]
        default = next(r for r in ok if r["config"] == "default")
        best = min(ok, key=lambda r: r["ms"])
        plain = min((r for r in ok if r["config"] == "default" or not r["config"].get("TMA")),
                    key=lambda r: r["ms"])
        print(f"{t} {d} {int(acp)} | {default['ms']:.3f} ({default['x_sdpa']:.2f}x) | {best['ms']:.3f} "
              f"({best['x_sdpa']:.2f}x) {best['config']} | {plain['ms']:.3f} {plain['config']}")


if __name__ == "__main__":
    main()
