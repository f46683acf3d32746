"""A/B of the FoX kernels' variants on the GPU (issue 16): which of them pays?

- ``FAST_BIAS`` (the default for 16-bit inputs): the forward drops the query's own ``c_i``
  from its logits (the softmax does not see a per-row constant; the lse gets it back), the
  backward folds ``c_i - lse_i`` per row: one operation less per (query, key) pair.
- ``LOOP_STAGES``: ``tl.range(..., num_stages=n)`` pipelines every load of the key/query
  loops (the kernels' own ``num_stages`` only those that feed a ``tl.dot``; the gate's
  ``c``, ``lse`` and ``delta`` are not). Measured before (1075a8e): no gain.

Forward and both backward kernels on the issue-2 workload (B x T = 32k, 24 heads of 64;
12 heads of 128), dense and with ACP, beside SDPA's default backend on the same tensors;
each variant's outputs against the base variant's (FAST_BIAS off, LOOP_STAGES 0).

    python scripts/tune_fox_variants.py --out fox_variants.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton
import triton.testing

from lapse.ops.forgetting import set_value_checks, triton_bwd, triton_fwd
from lapse.ops.forgetting.common import acp_delta, validate
from lapse.ops.forgetting.pruning import block_end_from_start, triton_block_start
from lapse.ops.forgetting.triton_ops import triton_gate_cumsum


def _workload(b, t, h, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = F.rms_norm(torch.randn(b, t, h, d, device="cuda", generator=g), (d,)).bfloat16()
    k = F.rms_norm(torch.randn(b, t, h, d, device="cuda", generator=g), (d,)).bfloat16()
    v = torch.randn(b, t, h, d, device="cuda", generator=g).bfloat16()
    # 70% local heads (gates 0.05-0.7 per token), the rest near 1: the study's mix
    gl = torch.Generator().manual_seed(seed + 1)
    n_local = round(0.7 * h)
    rate = torch.exp(torch.empty(h).uniform_(math.log(0.05), math.log(0.7), generator=gl))
    base = torch.full((h,), 9.0)
    base[:n_local] = -torch.log(torch.expm1(rate[:n_local]))
    logits = base.cuda() + 0.5 * torch.randn(b, t, h, device="cuda", generator=g)
    return q, k, v, F.logsigmoid(logits).float()


def _ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "16384x64", "4096x128", "16384x128"],
                    help="T x D; heads 24 at D 64, 12 at D 128, B = 32768 / T")
    ap.add_argument("--out", default="fox_variants.json")
    args = ap.parse_args()
    set_value_checks(False)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for shape in args.shapes:
        t, d = (int(x) for x in shape.split("x"))
        h = 24 if d <= 64 else 12
        b = 32768 // t
        q, k, v, lg = _workload(b, t, h, d)
        do = torch.randn_like(q)
        p = validate(q, k, v, lg, None, None, "triton")
        c_hi, c_lo = triton_gate_cumsum(lg, p)
        delta = acp_delta("auto", math.exp(-10), q, k, p)
        bs = triton_block_start(c_hi, c_lo, delta, p)
        be = block_end_from_start(bs, p)
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2)

        def sdpa(bwd):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            if bwd:
                o.backward(dot)
        sdpa_fwd, sdpa_all = _ms(lambda: sdpa(False)), _ms(lambda: sdpa(True))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = _ms(lambda: sdpa(True))
        row = dict(T=t, D=d, H=h, B=b, sdpa_default_fwd=sdpa_fwd, sdpa_default_fwdbwd=sdpa_all,
                   sdpa_cudnn_fwdbwd=cudnn, variants=[])
        for acp in (False, True):
            bsx, bex = (bs, be) if acp else (None, None)
            fcfg = triton_fwd.fwd_config(d, 2)
            kcfg, qcfg = triton_bwd.bwd_config(d, 1, acp)
            ref = None
            for fast, loop in ((False, False), (True, False), (True, True)):
                ls_f, ls_k, ls_q = (c["num_stages"] if loop else 0 for c in (fcfg, kcfg, qcfg))
                fc = dict(fcfg, LOOP_STAGES=ls_f, FAST_BIAS=fast)
                bc = (dict(kcfg, LOOP_STAGES=ls_k, FAST_BIAS=fast),
                      dict(qcfg, LOOP_STAGES=ls_q, FAST_BIAS=fast))
                o = torch.full_like(q, float("nan"))
                lse2 = torch.full_like(c_hi, float("nan"))
                dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
                dcc, dcr = torch.full_like(lse2, float("nan")), torch.full_like(lse2, float("nan"))
                dl = torch.empty_like(lse2)
                v_row = dict(acp=acp, fast_bias=fast, loop_stages=[ls_f, ls_k, ls_q])
                try:
                    triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bsx, None, p, o, lse2, fc)
                    triton_bwd.launch_delta(o, do, p, dl)
                    triton_bwd.launch_bwd(q, k, v, do, lse2, dl, c_hi, c_lo, bsx, bex, None, p,
                                          dq, dk, dv, dcc, dcr, bc)
                    outs = (o, dq, dk, dv)
                    v_row["nan"] = any(bool(x.isnan().any()) for x in outs)
                    if ref is None:
                        ref = [x.clone() for x in outs]
                    v_row["max_diff_vs_base"] = max(_diff(x, r) for x, r in zip(outs, ref, strict=True))
                    v_row["rel_diff_vs_base"] = max(
                        ((x.float() - r.float()).norm() / r.float().norm()).item()
                        for x, r in zip(outs, ref, strict=True))
                    v_row["fwd_ms"] = _ms(lambda: triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bsx, None,
                                                                        p, o, lse2, fc))
                    v_row["bwd_ms"] = _ms(lambda: triton_bwd.launch_bwd(
                        q, k, v, do, lse2, dl, c_hi, c_lo, bsx, bex, None, p, dq, dk, dv, dcc, dcr, bc))
                except Exception as e:  # noqa: BLE001 - out of resources: report and go on
                    v_row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                row["variants"].append(v_row)
                print(json.dumps(dict(T=t, D=d, **v_row)), flush=True)
        rows.append(row)
        print(f"T {t} D {d}: SDPA default {sdpa_fwd:.3f} / {sdpa_all:.3f} ms (cuDNN fwd+bwd {cudnn:.3f})",
              flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, rows=rows), f, indent=1)
    # the ratios count the three main kernels only (not the gate's cumsum, delta, gate grad)
    print("\nT D acp | fast bias | loop stages (fwd, dkdv, dq) | fwd ms | bwd ms | "
          "vs SDPA default fwd, fwd+bwd")
    for r in rows:
        for v_ in r["variants"]:
            if "fwd_ms" in v_:
                print(f"{r['T']} {r['D']} {int(v_['acp'])} | {int(v_['fast_bias'])} | {v_['loop_stages']} | "
                      f"{v_['fwd_ms']:.3f} | "
                      f"{v_['bwd_ms']:.3f} | {v_['fwd_ms'] / r['sdpa_default_fwd']:.2f}x "
                      f"{(v_['fwd_ms'] + v_['bwd_ms']) / r['sdpa_default_fwdbwd']:.2f}x "
                      f"rel diff {v_['rel_diff_vs_base']:.1e}")
            else:
                print(f"{r['T']} {r['D']} {int(v_['acp'])} | {int(v_['fast_bias'])} | {v_['loop_stages']} | "
                      f"{v_['error']}")


if __name__ == "__main__":
    main()
