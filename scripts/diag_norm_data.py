"""Why ACP's norm pass runs at 0.15-0.23 ms on the bench's workload where ``diag_norm_parts.py``
timed 0.057-0.10 ms (issue 16): ``pruning._norm_parts`` on the workload's own q and k, on fresh
``torch.randn`` tensors of the same shape, and on clones of the workload's, with the tile
options, and a layout that reads several heads of a row in one block (``_norm_rows_kernel``).

    bash scripts/gpu.sh python3 scripts/diag_norm_data.py --out norm-data.json
"""

# ruff: noqa: B023 (each closure over loop variables runs inside its own iteration)
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from tune_fox_fwd import _dump, _ms  # scripts/ on the path

from lapse.bench.workloads import WorkloadSpec, make_workload
from lapse.ops.forgetting import common, pruning


@triton.jit
def _norm_rows_kernel(X, OUT, stride_b, stride_t, stride_h, T, H, NT,
                      D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, HB: tl.constexpr):
    # per (time tile, sequence x head block): the largest row norm of each head, [B*H, NT]
    i_t = tl.program_id(0).to(tl.int64)
    i_x = tl.program_id(1).to(tl.int64)
    nhb = tl.cdiv(H, HB)
    i_b = i_x // nhb
    o_h = (i_x % nhb) * HB + tl.arange(0, HB)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m = (o_t < T)[:, None, None] & (o_h < H)[None, :, None] & (o_d < D)[None, None, :]
    x = tl.load(X + i_b * stride_b + o_t[:, None, None] * stride_t + o_h[None, :, None] * stride_h
                + o_d[None, None, :], mask=m, other=0.0).to(tl.float32)
    n = tl.max(tl.sqrt(tl.sum(x * x, 2)), 0)  # [HB]
    tl.store(OUT + (i_b * H + o_h) * NT + i_t, n, mask=o_h < H)


def norm_rows(x, bt, hb, warps):
    b, t, h, d = x.shape
    nt = triton.cdiv(t, bt)
    out = torch.empty(b * h, nt, device=x.device, dtype=torch.float32)
    _norm_rows_kernel[(nt, b * triton.cdiv(h, hb))](
        x, out, x.stride(0), x.stride(1), x.stride(2), t, h, nt, D=d, BD=triton.next_power_of_2(d), BT=bt,
        HB=hb, num_warps=warps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "4096x128"], help="T x D, 24 heads")
    ap.add_argument("--out", default="norm-data.json")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        t, d = (int(x) for x in shape.split("x"))
        wl = make_workload(WorkloadSpec(seq_len=t, head_dim=d))
        sets = {"workload": (wl.q, wl.k), "randn": (torch.randn_like(wl.q), torch.randn_like(wl.k)),
                "clone": (wl.q.clone(), wl.k.clone())}
        gib = 2 * wl.q.numel() * wl.q.element_size() / 2**30
        for name, (q, k) in sets.items():
            p = common.validate(q, k, k, wl.log_fgate, None, None, "triton")
            ms = _ms(lambda: pruning._norm_parts(q, k, p))
            copy = _ms(lambda: (q.clone(), k.clone()))
            rows.append(dict(T=t, D=d, data=name, kernel="norm_parts", ms=ms, clone_ms=copy))
            print(f"T {t} D {d} {name}: norm_parts {ms:.4f} ms ({gib / ms * 1e3:.0f} GiB/s); "
                  f"clone {copy:.4f}", flush=True)
        q, k = wl.q, wl.k
        want = pruning._norm_parts(q, k, common.validate(q, k, k, wl.log_fgate, None, None, "triton"))
        options = [(8, 8, 4), (16, 8, 4), (16, 8, 8), (32, 8, 8), (8, 16, 4), (32, 4, 4), (64, 1, 4)]
        for bt, hb, warps in options:
            ms = _ms(lambda: (norm_rows(q, bt, hb, warps), norm_rows(k, bt, hb, warps)))
            got = norm_rows(q, bt, hb, warps).view(q.shape[0], q.shape[2], -1).amax(-1)
            ok = bool(torch.equal(got, want[0].amax(-1)))
            rows.append(dict(T=t, D=d, data="workload", kernel=f"rows bt{bt} hb{hb} w{warps}", ms=ms,
                             equal=ok))
            print(f"  rows BT {bt} HB {hb} warps {warps}: {ms:.4f} ms ({gib / ms * 1e3:.0f} GiB/s), "
                  f"q maxima equal: {ok}", flush=True)
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
