"""Is the FoX op's forward bound by the host? Its time three ways (issue 16).

On the issue-2 workload (24 heads, B x T = 32k) the forward of ``forgetting_attention``, dense
and with ``acp="auto"``, is timed: by ``do_bench`` (as ``lapse bench attention`` does), by
replaying it captured in a CUDA graph (no host work), and on the host alone (the mean wall
time of 50 calls issued without waiting, the queue kept ahead by a long kernel first). When
the first is near the host time and above the graph's, the bench measures Python. The
forward+backward (``torch.autograd.grad``) is timed by ``do_bench`` too.
Run it under two trees (``PYTHONPATH``) to compare them.

    python scripts/diag_op_host.py --shapes 4096x64 4096x128
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import json
import time

import torch
import triton.testing

import lapse
from lapse.bench.workloads import WorkloadSpec, make_workload
from lapse.ops.forgetting import forgetting_attention, set_value_checks


def _host_ms(fn, n: int = 50) -> float:
    """Wall time a call on the host, the GPU kept busy so no call waits for it."""
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(3):
        a @ a  # ~ several ms of queued work
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return dt


def _graph_ms(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "4096x128"])
    ap.add_argument("--label", default=lapse.__file__)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    set_value_checks(False)
    rows = []
    for shape in args.shapes:
        t, d = (int(x) for x in shape.split("x"))
        wl = make_workload(WorkloadSpec(seq_len=t, heads=24, head_dim=d), device="cuda")
        for acp in (None, "auto"):
            fn = lambda: forgetting_attention(wl.q, wl.k, wl.v, wl.log_fgate, acp=acp, backend="triton")
            row = dict(label=args.label, T=t, D=d, acp=acp,
                       do_bench_ms=triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"),
                       host_ms=_host_ms(fn))
            xs = [x.detach().requires_grad_() for x in (wl.q, wl.k, wl.v, wl.log_fgate)]
            do = torch.randn_like(wl.q)

            def fwd_bwd():
                o = forgetting_attention(*xs, acp=acp, backend="triton")
                return torch.autograd.grad(o, xs, do)

            row["fwd_bwd_ms"] = triton.testing.do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median")
            try:
                row["graph_ms"] = _graph_ms(fn)
            except Exception as e:  # noqa: BLE001 - not capturable: say so
                row["graph_ms"] = float("nan")
                print(f"graph: {type(e).__name__}: {str(e)[:120]}")
            rows.append(row)
            print(f"{args.label} T {t} D {d} acp {acp}: do_bench {row['do_bench_ms']:.3f} ms, host "
                  f"{row['host_ms']:.3f} ms, graph {row['graph_ms']:.3f} ms, "
                  f"fwd+bwd {row['fwd_bwd_ms']:.3f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
