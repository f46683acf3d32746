"""FoX as plain causal softmax attention over a wider head: how precise, how fast? Issue 16,
twenty-ninth session (BENCHMARKS.md, "Twenty-ninth session"; tried and set aside).

The idea. The forget gate's bias ``D_ij = c_i - c_j`` is a row term plus a column term, so
it is a dot product: with ``x_j = -c_j / scale`` appended to each key and a 1 to each query,
``scale * q'.k' = scale * q.k - c_j``, and the row term only shifts a softmax row (it goes
back into the lse). Any causal kernel, SDPA's fastest included, then computes FoX:
- ``x_j`` grows with ``|c|``, so it travels as the sum of ``PARTS`` 16-bit numbers (float32
  precision); the kernel's products of 16-bit numbers are exact and its sums float32;
- the gradient: ``dk'`` at a key's appended coordinates is ``scale * colsum_j(dS)``, and one
  more query coordinate, 0 in value against a key coordinate of 1, gives
  ``scale * rowsum_i(dS)`` in ``dq'``: the gate's two sums, by autograd, then the reverse
  cumulative sum. ``rows=True`` carries ``c_i / scale`` in the queries instead, so scores
  stay small.
The widths round up to a multiple of 8 (``D + 8``); grouped keys are expanded to the query
heads (each query head has its own gates).

What it measured (H200, ``docs/bench/session29/h200-widened-heads.json``): SDPA's default
(cuDNN) at width D + 8 takes 1.23-1.26x its time at D forward and 1.35-1.46x forward+backward, and the
gate's gradient comes out 10x less precise than lapse's (the column sums are rounded to
bf16 in ``dk'``). So it is no route to issue 16's targets.

    python scripts/diag_widened.py --out $OUT/widened.json   # on the GPU

Precision: against the float64 materialised reference (naive backend) on a slice of the
issue-2 workload (``--prec`` cases ``TxHQ``: the heads with the largest ``|c|`` and one
global head), the relative errors (largest difference over the reference's largest
magnitude) of o, dq, dk, dv and d log f, for lapse's Triton kernels and the widened SDPA.
Timing: the issue-2 workload (32768 tokens, 24 heads), eager and CUDA-graph medians, fwd
and fwd+bwd, of SDPA's default backend at width D (the baseline), SDPA on inputs already
widened (the kernel alone), the whole widened op, and lapse's Triton kernels.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from lapse.bench import attention as bench
from lapse.bench.workloads import WorkloadSpec, make_workload
from lapse.ops.forgetting import forgetting_attention, naive_forgetting_attention, set_value_checks
from lapse.ops.forgetting.common import cumulative_log_gates

PARTS = 3


def split16(x: Tensor, dtype: torch.dtype, parts: int = PARTS) -> list[Tensor]:
    """``x`` (float64) as ``parts`` numbers of ``dtype`` whose sum is ``x`` to about
    ``2^(-8 parts)`` relative (bfloat16). The first part carries the gradient (the others
    are differences of ``x`` and its rounding, whose gradient is 0)."""
    out = []
    rest = x
    for _ in range(parts):
        h = rest.to(dtype)
        out.append(h)
        rest = rest - h.to(rest.dtype)
    return out


def _widen(x: Tensor, cols: list[Tensor], width: int) -> Tensor:
    """``x [B, T, H, D]`` with the columns ``cols`` (each ``[B, T, H]``) appended, and
    zeros up to ``width``."""
    b, t, h, d = x.shape
    pad = width - d - len(cols)
    extra = [c.to(x.dtype)[..., None] for c in cols]
    if pad:
        extra.append(x.new_zeros(b, t, h, pad))
    return torch.cat([x, *extra], dim=-1)


def augmented_forgetting_attention(
    q: Tensor, k: Tensor, v: Tensor, log_fgate: Tensor, scale: float, *, rows: bool = False,
    pad_values: bool = False, parts: int = PARTS,
) -> tuple[Tensor, Tensor]:
    """FoX through ``F.scaled_dot_product_attention`` on widened heads (below).

    ``q [B, T, HQ, D]``, ``k, v [B, T, H, D]``, ``log_fgate [B, T, HQ]`` (equal query and
    key lengths, no packing). ``rows``: also carry ``c_i / scale`` in the queries (against
    ones in the keys) so that scores stay small instead of growing with ``|c_j|``.
    ``pad_values``: widen the values too (for kernels that want equal widths).
    Returns ``o [B, T, HQ, D]`` and the natural-log lse ``[B, HQ, T]``, computed by the
    math of a second call only if asked for (``lse`` is not part of SDPA's API): here
    ``None``."""
    b, t, hq, d = q.shape
    h = k.shape[2]
    if h != hq:
        k = k.repeat_interleave(hq // h, dim=2)
        v = v.repeat_interleave(hq // h, dim=2)
    c = cumulative_log_gates(log_fgate)  # [B, T, HQ] float64, differentiable
    width = -(-(d + 2 * parts) // 8) * 8 if rows else -(-(d + parts + 1) // 8) * 8
    ones = torch.ones_like(c)
    q_cols = [ones] * parts
    k_cols = split16(-c / scale, q.dtype, parts)
    if rows:  # c_i / scale against ones: the first part's gradient is the row sums
        q_cols += split16(c / scale, q.dtype, parts)
    else:  # 0, but its gradient reaches c_i: the row sums
        q_cols.append((c - c.detach()) / scale)
    k_cols += [ones] * (len(q_cols) - parts)
    qw = _widen(q, q_cols, width)
    kw = _widen(k, k_cols, width)
    vw = _widen(v, [], width) if pad_values else v
    o = F.scaled_dot_product_attention(qw.transpose(1, 2), kw.transpose(1, 2), vw.transpose(1, 2),
                                       is_causal=True, scale=scale)
    return o.transpose(1, 2)[..., :d], None


def _err(a, b):
    return float((a.double() - b).abs().max() / b.abs().max())


def precision(t: int, hq: int, d: int) -> dict:
    spec = WorkloadSpec(seq_len=t, tokens=t, heads=24, kv_heads=24, head_dim=d)
    wl = make_workload(spec, device="cuda")
    c_end = wl.log_fgate.double().sum(1)[0]  # [HQ]
    # the fastest-forgetting heads, and one global
    heads = torch.argsort(c_end)[:hq - 1].tolist() + [int(torch.argmax(c_end))]
    q, k, v = (x[:, :, heads].contiguous() for x in (wl.q, wl.k, wl.v))
    g = wl.log_fgate[:, :, heads].contiguous()
    scale = 1 / math.sqrt(d)
    do = torch.randn_like(q)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v, g)]
    o, _ = naive_forgetting_attention(*ref, scale)
    grads = torch.autograd.grad(o, ref, do.double())
    want = [o.detach(), *grads]
    del o, grads, ref
    torch.cuda.empty_cache()
    row = {"T": t, "heads": heads, "c_end": [float(c_end[h]) for h in heads]}

    def run(name, fn):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
        out = fn(*ins)
        got = [out.detach(), *torch.autograd.grad(out, ins, do)]
        names = ("o", "dq", "dk", "dv", "dlogf")
        row[name] = {n: _err(a, b) for n, a, b in zip(names, got, want, strict=True)}

    run("lapse-triton", lambda q, k, v, g: forgetting_attention(q, k, v, g, backend="triton"))
    for rows in (False, True):
        run(f"widened{'-rows' if rows else ''}",
            lambda q, k, v, g, rows=rows: augmented_forgetting_attention(q, k, v, g, scale, rows=rows)[0])
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        try:
            run("widened-cudnn", lambda q, k, v, g: augmented_forgetting_attention(q, k, v, g, scale)[0])
        except RuntimeError as e:
            row["widened-cudnn"] = str(e)[:200]
    return row


def timing(t: int, d: int, cfg) -> dict:
    spec = WorkloadSpec(seq_len=t, tokens=32768, heads=24, kv_heads=24, head_dim=d)
    wl = make_workload(spec, device="cuda")
    scale = 1 / math.sqrt(d)
    out: dict = {"T": t, "D": d}
    leaves = [x.detach().clone().requires_grad_() for x in (wl.q, wl.k, wl.v, wl.log_fgate)]
    width = d + 8

    def widened_inputs(dv):
        qw = torch.randn(*wl.q.shape[:3], width, device="cuda", dtype=wl.q.dtype)
        kw = torch.randn_like(qw)
        vw = torch.randn(*wl.q.shape[:3], dv, device="cuda", dtype=wl.q.dtype)
        return [x.transpose(1, 2).requires_grad_() for x in (qw, kw, vw)]

    plain = [x.detach().transpose(1, 2).clone().requires_grad_() for x in (wl.q, wl.k, wl.v)]
    w64 = widened_inputs(d)
    w72 = widened_inputs(width)

    def sdpa(ins):
        return lambda: F.scaled_dot_product_attention(*ins, is_causal=True, scale=scale)

    cases = {
        "sdpa-default D": (sdpa(plain), plain),
        "sdpa-default widened qk (v D)": (sdpa(w64), w64),
        "sdpa-default widened qk and v": (sdpa(w72), w72),
        "widened op": (lambda: augmented_forgetting_attention(*leaves, scale)[0], leaves),
        "widened op, rows": (lambda: augmented_forgetting_attention(*leaves, scale, rows=True)[0], leaves),
        "widened op, v widened": (
            lambda: augmented_forgetting_attention(*leaves, scale, pad_values=True)[0], leaves),
        "lapse triton": (lambda: forgetting_attention(*leaves, backend="triton"), leaves),
    }
    for name, (fn, ins) in cases.items():
        r: dict = {}
        try:
            if "sdpa" in name:
                r["backend"] = bench._ran_kernels(fn)
            with torch.no_grad():
                r["fwd"] = bench._time(fn, cfg)
                r["fwd_graph"] = bench._time_graphed(fn, cfg)
            o = fn()
            dout = torch.randn_like(o)
            del o

            def both(fn=fn, ins=ins, dout=dout):
                return torch.autograd.grad(fn(), ins, dout)

            r["fwd+bwd"] = bench._time(both, cfg)
            r["fwd+bwd_graph"] = bench._time_graphed(both, cfg)
        except Exception as e:
            r["error"] = bench._short(e)
        out[name] = r
        print(t, d, name, r, flush=True)
        bench._free()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prec", nargs="*", default=["4096x8", "16384x2"])
    ap.add_argument("--seq-lens", nargs="*", type=int, default=[4096, 16384])
    ap.add_argument("--dims", nargs="*", type=int, default=[64, 128])
    a = ap.parse_args()
    cfg = bench.AttentionBenchConfig()
    set_value_checks(False)  # no host read of the gates: lapse's call can be captured in a graph
    res = {"env": bench.environment(), "precision": [], "timing": []}
    for case in a.prec:
        t, hq = (int(x) for x in case.split("x"))
        res["precision"].append(precision(t, hq, 64))
        print(json.dumps(res["precision"][-1]), flush=True)
        torch.cuda.empty_cache()
    for d in a.dims:
        for t in a.seq_lens:
            res["timing"].append(timing(t, d, cfg))
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
