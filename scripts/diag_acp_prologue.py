"""Where ACP's prologue time goes on the bench's workload, kernel by kernel (issue 16).

``lapse bench attention`` reports the bound (``acp_delta`` with ``acp="auto"``: the query and
key norms, then delta) at 0.16-0.23 ms replayed from a CUDA graph, where the twentieth
session's ``diag_norm_parts.py`` timed the norms' pass alone at 0.056 ms (D 64). This prints,
under ``torch.profiler``, each kernel's device time for the bound, for the op's ACP forward
and for its dense forward, on ``lapse.bench.workloads.make_workload`` (24 heads, B x T = 32k).

    bash scripts/gpu.sh python3 scripts/diag_acp_prologue.py --out prologue.json
"""

# ruff: noqa: B023 (each closure over loop variables runs inside its own iteration)
from __future__ import annotations

import argparse

import torch
from profile_fox_op import _kernels  # scripts/ on the path
from tune_fox_fwd import _dump, _ms

from lapse.bench.workloads import WorkloadSpec, make_workload
from lapse.ops.forgetting import common, forgetting_attention
from lapse.ops.forgetting.pruning import _norm_parts, triton_acp_bound, triton_acp_delta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "4096x128"], help="T x D, 24 heads")
    ap.add_argument("--out", default="prologue.json")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        t, d = (int(x) for x in shape.split("x"))
        wl = make_workload(WorkloadSpec(seq_len=t, head_dim=d))
        q, k, v, g = wl.q, wl.k, wl.v, wl.log_fgate
        p = common.validate(q, k, v, g, None, None, "triton")
        print(f"T {t} D {d}: q {tuple(q.shape)} strides {q.stride()}, k strides {k.stride()}", flush=True)
        calls = {
            "norm_parts": lambda: _norm_parts(q, k, p),
            "bound": lambda: common.acp_delta("auto", 1e-6, q, k, p, triton_acp_bound, triton_acp_delta),
            "acp_fwd": lambda: forgetting_attention(q, k, v, g, acp="auto", backend="triton"),
            "dense_fwd": lambda: forgetting_attention(q, k, v, g, backend="triton"),
        }
        with torch.no_grad():
            for name, fn in calls.items():
                kernels = _kernels(fn)
                ms = _ms(fn)
                rows.append(dict(T=t, D=d, call=name, do_bench_ms=ms, kernels=kernels))
                print(f"  {name}: do_bench {ms:.4f} ms; kernels " + ", ".join(
                    f"{n[:48]} {v:.4f}" for n, v in kernels.items()), flush=True)
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
