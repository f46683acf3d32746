"""Development check of the Triton forgetting-attention kernels on a GPU: correctness
against the float64 oracle, then timing against SDPA flash on the issue-2 workload.

    PYTHONPATH=src python scripts/gpu_fox_dev.py [--quick] [--out DIR]

Kept in the repo so each tuning step is reproducible (METHOD.md: one script per call).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
import triton

from lapse.ops.forgetting import forgetting_attention, set_value_checks, triton_bwd, triton_fwd
from lapse.ops.forgetting.common import acp_delta, validate
from lapse.ops.forgetting.pruning import block_end_from_start, triton_block_start
from lapse.ops.forgetting.triton_ops import triton_gate_cumsum


def workload(b, t, hq, h, d, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, t, hq, d, device=device, generator=g)
    k = torch.randn(b, t, h, d, device=device, generator=g)
    v = torch.randn(b, t, h, d, device=device, generator=g, dtype=torch.bfloat16)
    q = F.rms_norm(q, (d,)).bfloat16()
    k = F.rms_norm(k, (d,)).bfloat16()
    gl = torch.Generator().manual_seed(seed + 1)
    n_local = round(0.7 * hq)
    rate = torch.exp(torch.empty(hq).uniform_(math.log(0.05), math.log(0.7), generator=gl))
    base = torch.full((hq,), 9.0)
    base[:n_local] = -torch.log(torch.expm1(rate[:n_local]))
    logits = base.to(device) + 0.5 * torch.randn(b, t, hq, device=device, generator=g)
    return q, k, v, F.logsigmoid(logits).float()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(b, t, hq, h, d, acp, seed):
    q, k, v, lg = workload(b, t, hq, h, d, seed)
    do = torch.randn_like(q)
    out = {}
    for name, dt, be in (("ref", torch.float64, "naive"), ("base", torch.bfloat16, "naive"),
                         ("triton", torch.bfloat16, "triton")):
        x = [t_.detach().to(dt).requires_grad_() for t_ in (q, k, v)]
        g = lg.detach().clone().requires_grad_()
        o, st = forgetting_attention(*x, g, acp=acp, return_stats=True, backend=be)
        o.backward(do.to(dt))
        out[name] = [o, x[0].grad, x[1].grad, x[2].grad, g.grad, st.pruned_fraction.mean().item()]
    row = {}
    for i, n in enumerate(["o", "dq", "dk", "dv", "dg"]):
        e_t, e_b = rel(out["triton"][i], out["ref"][i]), rel(out["base"][i], out["ref"][i])
        nan = bool(torch.isnan(out["triton"][i]).any())
        row[n] = (e_t, e_b, nan)
    return row, out["triton"][5]


def bench(fn, warmup=25, rep=100):
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def time_case(t, hq, h, d, tokens=32768, seed=0):
    b = tokens // t
    q, k, v, lg = workload(b, t, hq, h, d, seed)
    do = torch.randn_like(q)
    res = {}
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    g = lg.detach().clone().requires_grad_()

    def lapse(acp, bwd):
        def f():
            o = forgetting_attention(*xs, g, acp=acp, backend="triton")
            if bwd:
                o.backward(do)
        return f
    for acp in (None, "auto"):
        key = "acp" if acp else "dense"
        res[key + "_fwd"] = bench(lapse(acp, False))
        res[key + "_fwdbwd"] = bench(lapse(acp, True))
    _, st = forgetting_attention(q, k, v, lg, acp="auto", backend="triton", return_stats=True)
    res["pruned"] = st.pruned_fraction.mean().item()
    # boundary search alone (from c and delta, as the forward does)
    p = validate(q, k, v, lg, None, None, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    delta = acp_delta("auto", math.exp(-10), q, k, p)
    res["search_ms"] = bench(lambda: triton_block_start(c_hi, c_lo, delta, p))
    res["prep_ms"] = bench(lambda: (triton_gate_cumsum(lg, p), acp_delta("auto", math.exp(-10), q, k, p)))
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(bwd):
        def f():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=hq != h)
            if bwd:
                o.backward(dot)
        return f
    res["sdpa_fwd"] = bench(sdpa(False))
    res["sdpa_fwdbwd"] = bench(sdpa(True))
    return res


def tune(t=16384, hq=24, h=24, d=64, tokens=32768):
    """Kernel-only times of tile configs, dense and ACP (prints a table)."""
    b = tokens // t
    q, k, v, lg = workload(b, t, hq, h, d, 0)
    do = torch.randn_like(q)
    p = validate(q, k, v, lg, None, None, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    delta = acp_delta("auto", math.exp(-10), q, k, p)
    bs = triton_block_start(c_hi, c_lo, delta, p)
    be = block_end_from_start(bs, p)
    o = torch.empty_like(q)
    lse2 = torch.empty_like(c_hi)
    triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, None, None, p, o, lse2)
    out = []
    fwd_cfgs = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 4),
                (128, 64, 8, 4), (128, 64, 4, 2), (64, 32, 4, 4)]
    if d > 64:
        fwd_cfgs = [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)]
    for bm, bn, w, st in fwd_cfgs:
        cfg = dict(BM=bm, BN=bn, num_warps=w, num_stages=st)
        for acp in (False, True):
            try:
                ms = bench(lambda cfg=cfg, acp=acp: triton_fwd.launch_fwd(
                    q, k, v, c_hi, c_lo, bs if acp else None, None, p, o, lse2, cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                ms = float("nan")
                print("fail", cfg, repr(e)[:200])
            out.append(("fwd", cfg, acp, ms))
            print(f"fwd {cfg} acp={acp}: {ms:.3f} ms", flush=True)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dcc, dcr = torch.empty_like(lse2), torch.empty_like(lse2)
    kv_cfgs = [(32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 8, 3),
               (64, 128, 4, 3), (32, 128, 4, 4), (16, 128, 4, 3)]
    q_cfgs = [(128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3),
              (128, 64, 4, 3), (128, 32, 4, 4)]
    if d > 64:
        kv_cfgs = [(32, 64, 4, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2)]
        q_cfgs = [(64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3)]
    base_q = dict(zip(("BM", "BN", "num_warps", "num_stages"), q_cfgs[0], strict=False))
    base_kv = dict(zip(("BM", "BN", "num_warps", "num_stages"), kv_cfgs[0], strict=False))
    for name, cfgs in (("dkdv", kv_cfgs), ("dq", q_cfgs)):
        for bm, bn, w, st in cfgs:
            cfg = dict(BM=bm, BN=bn, num_warps=w, num_stages=st)
            for acp in (False, True):
                pair = (cfg, base_q) if name == "dkdv" else (base_kv, cfg)
                try:
                    ms = bench(lambda acp=acp, pair=pair: triton_bwd.launch_bwd(
                        q, k, v, o, do, lse2, None, c_hi, c_lo, bs if acp else None, be if acp else None,
                        None, p, dq, dk, dv, dcc, dcr, pair))
                except Exception as e:  # noqa: BLE001
                    ms = float("nan")
                    print("fail", cfg, repr(e)[:200])
                out.append((name, cfg, acp, ms))
                print(f"bwd({name} varied) {cfg} acp={acp}: {ms:.3f} ms", flush=True)
    return out


def tune_gqa_dkdv(t=16384, hq=24, h=6, d=64, tokens=32768):
    """dK/dV tile configs for grouped-query attention (the kernel loops over the group)."""
    b = tokens // t
    q, k, v, lg = workload(b, t, hq, h, d, 0)
    do = torch.randn_like(q)
    p = validate(q, k, v, lg, None, None, "triton")
    c_hi, c_lo = triton_gate_cumsum(lg, p)
    o, lse2 = torch.empty_like(q), torch.empty_like(c_hi)
    triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, None, None, p, o, lse2)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dcc, dcr = torch.empty_like(lse2), torch.empty_like(lse2)
    _, cfg_q = triton_bwd.bwd_config(d)
    out = []
    for bm, bn, w, st in [(32, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3),
                          (64, 64, 4, 3), (16, 128, 4, 3)]:
        cfg = dict(BM=bm, BN=bn, num_warps=w, num_stages=st)
        ms = bench(lambda cfg=cfg: triton_bwd.launch_bwd(q, k, v, o, do, lse2, None, c_hi, c_lo,
                                                 None, None, None, p, dq, dk, dv, dcc, dcr, (cfg, cfg_q)))
        out.append((cfg, ms))
        print(f"gqa bwd dkdv {cfg}: {ms:.3f} ms", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-gqa", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    set_value_checks(False)  # no host sync per call while timing (see common.py)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "checks": [], "timing": []}
    if not args.skip_check:
        cases = [(1, 2048, 4, 4, 64, None), (1, 2048, 4, 4, 64, "auto"), (2, 1000, 6, 2, 96, None),
                 (1, 3000, 4, 2, 128, "auto"), (1, 777, 2, 1, 256, None), (1, 1500, 4, 4, 48, "auto")]
        for i, (b, t, hq, h, d, acp) in enumerate(cases):
            t0 = time.time()
            row, pf = check(b, t, hq, h, d, acp, seed=i)
            print(f"check B{b}-T{t}-HQ{hq}-H{h}-D{d}-acp{acp}: pruned {pf:.3f} " + " ".join(
                f"{n}={e:.2e}/{eb:.2e}{'NAN' if nan else ''}" for n, (e, eb, nan) in row.items())
                + f" ({time.time()-t0:.1f}s)", flush=True)
            results["checks"].append({"case": [b, t, hq, h, d, acp], "pruned": pf, "err": row})
    if args.tune_gqa:
        results["tune_gqa"] = tune_gqa_dkdv()
        cfgs_only = True
    else:
        cfgs_only = False
    if args.tune:
        results["tune"] = [(n, c, a, ms) for n, c, a, ms in tune()]
        results["tune128"] = [(n, c, a, ms) for n, c, a, ms in tune(hq=12, h=12, d=128)]
    cfgs = [(4096, 24, 24, 64), (8192, 24, 24, 64), (16384, 24, 24, 64)]
    if not args.quick:
        cfgs += [(16384, 12, 12, 128), (16384, 24, 6, 64)]
    for t, hq, h, d in [] if cfgs_only else cfgs:
        r = time_case(t, hq, h, d)
        r.update(T=t, HQ=hq, H=h, D=d)
        results["timing"].append(r)
        print(f"T{t} HQ{hq} H{h} D{d}: sdpa {r['sdpa_fwd']:.2f}/{r['sdpa_fwdbwd']:.2f}  "
              f"dense {r['dense_fwd']:.2f}/{r['dense_fwdbwd']:.2f} "
              f"({r['dense_fwd']/r['sdpa_fwd']:.2f}x/{r['dense_fwdbwd']/r['sdpa_fwdbwd']:.2f}x)  "
              f"acp {r['acp_fwd']:.2f}/{r['acp_fwdbwd']:.2f} "
              f"({r['acp_fwd']/r['sdpa_fwd']:.2f}x/{r['acp_fwdbwd']/r['sdpa_fwdbwd']:.2f}x) "
              f"pruned {r['pruned']:.3f} search {r['search_ms']*1000:.0f}us prep {r['prep_ms']*1000:.0f}us",
              flush=True)
    with open(os.path.join(args.out, "gpu_fox_dev.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
