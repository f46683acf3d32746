"""Does FlashAttention-4 (``flash_attn.cute``) run on this GPU, and compute causal softmax
attention? Before ``lapse bench attention`` takes it as a baseline (issue 16).

For each case (T x D x query heads x key heads, or packed sequences) it runs the bench's
own runner (``lapse.bench.attention.build_runner("flash-attn-4", ...)``, bf16) forward and
backward, and compares output and gradients with causal attention computed in float32 by
SDPA's math backend from the same bf16 inputs; SDPA's default backend on the bf16 inputs
is compared the same way, so its error is the yardstick. An error is the largest
difference over the reference's largest magnitude. Prints a JSON line per case, with the
runner's set-up time (FlashAttention-4's compile).

    python scripts/check_fa4.py --cases 1024x64x8x8 1024x128x8x8 1024x64x8x2 varlen
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lapse.bench import attention as bench
from lapse.bench.workloads import WorkloadSpec, make_workload


def _reference(q, k, v, scale, cu, d_out):
    """Causal attention of bf16 ``[B, T, H, D]`` inputs in float32 (math backend), per
    packed sequence when ``cu`` is given; output and the gradients of q, k, v."""
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    spans = [(0, q.shape[1])] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    group = q.shape[2] // k.shape[2]
    outs = []
    with sdpa_kernel(SDPBackend.MATH):
        for a, b in spans:
            qs, ks, vs = (x[:, a:b].transpose(1, 2) for x in (q, k, v))
            ks, vs = (x.repeat_interleave(group, dim=1) for x in (ks, vs))
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            outs.append(o.transpose(1, 2))
    o = torch.cat(outs, dim=1)
    return [o, *torch.autograd.grad(o, (q, k, v), d_out.float())]


def _errors(got, want):
    """Relative error of each: the largest difference over the reference's largest magnitude."""
    return [float((g.float() - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True)]


def check(case: str) -> dict:
    if case == "varlen":
        spec = WorkloadSpec(varlen=True, tokens=4096, heads=8, head_dim=64)
    else:
        t, d, hq, h = (int(x) for x in case.split("x"))
        spec = WorkloadSpec(seq_len=t, tokens=2 * t, heads=hq, kv_heads=h, head_dim=d)
    wl = make_workload(spec, device="cuda")
    cfg = bench.AttentionBenchConfig(varlen=spec.varlen, seq_lens=(spec.seq_len,), tokens=spec.tokens,
                                     heads=spec.heads, kv_heads=spec.kv_heads, head_dim=spec.head_dim)
    row = {"case": case, "spec": spec.label}
    d_out = torch.randn_like(wl.q)
    want = _reference(wl.q, wl.k, wl.v, spec.scale, wl.cu_seqlens, d_out)
    for name in ("flash-attn-4", "sdpa-default"):
        start = time.perf_counter()
        try:
            r = bench.build_runner(name, wl, cfg)
        except bench.NotAvailable as e:
            row[name] = f"n/a: {e}"
            continue
        setup = time.perf_counter() - start
        with r.context():
            out = r.forward()
            grads = torch.autograd.grad(out, r.grad_inputs, r.from_bthd(d_out))
        got = [r.to_bthd(out), *(g.reshape(w.shape) for g, w in zip(r.grad_to_bthd(list(grads)), want[1:],
                                                                        strict=True))]
        torch.cuda.synchronize()
        errs = _errors(got, want)
        row[name] = dict(setup_s=round(setup, 1), nan=any(bool(x.isnan().any()) for x in got), notes=r.notes,
                         **{f"err_{n}": e for n, e in zip(("o", "dq", "dk", "dv"), errs, strict=True)})
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=["1024x64x8x8", "1024x128x8x8", "1024x64x8x2", "varlen"])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = [check(c) for c in args.cases]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
