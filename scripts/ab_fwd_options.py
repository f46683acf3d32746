"""The forward's table against the table with options added, through the op, in one process
(issue 16).

Times ``forgetting_attention`` forward and forward+backward with ``acp="auto"`` on the issue-2
workload (``T x D x heads``; ``BENCH_WORKLOAD=1``: ``lapse bench attention``'s own tensors),
through the table as it is and through the table with each ``--variants`` dict over its ACP
options (``triton_fwd.fwd_config`` with ``acp=True``), alternating for ``--rounds``, beside the
dense op and SDPA's default backend; eager (``do_bench``) and replayed from a CUDA graph. Each
variant's outputs and gradients are compared with the table's first.

    BENCH_WORKLOAD=1 bash scripts/gpu.sh python3 scripts/ab_fwd_options.py \\
        --shapes 4096x64x24 --variants '{"FLAT": 4}' --out ab_flat.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import json

from ab_gluon_acp import alternate, baselines  # the same timing (scripts/ on the path)
from tune_fox_fwd import _dump, _op_calls  # the same workload, output

from lapse.ops.forgetting import forgetting_attention, set_value_checks, triton_fwd

TABLE = triton_fwd.fwd_config


def _with(options: dict):
    def table(d, dtype_bytes, acp=False, tk=0):
        cfg = TABLE(d, dtype_bytes, acp, tk)
        return {**cfg, **options} if acp else cfg

    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64x24", "8192x64x24", "16384x64x24"])
    ap.add_argument("--variants", nargs="+", type=json.loads, required=True,
                    help="JSON dicts over the table's ACP options, e.g. '{\"FLAT\": 4}'")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the versions")
    ap.add_argument("--out", default="ab_fwd_options.json")
    args = ap.parse_args()
    versions = {"table": TABLE, **{json.dumps(v, sort_keys=True): _with(v) for v in args.variants}}
    set_value_checks(False)
    rows = []
    for shape in args.shapes:
        fwd, fwd_bwd, sdpa, (t, d, h, b, (q, k, v, lg)) = _op_calls(shape)
        outs = {}
        for name, table in versions.items():
            triton_fwd.fwd_config = table
            outs[name] = (fwd(), *fwd_bwd())
        rel = {name: [float((a.float() - c.float()).norm() / c.float().norm().clamp_min(1e-30))
                      for a, c in zip(outs[name], outs["table"], strict=True)] for name in versions}
        triton_fwd.fwd_config = TABLE
        _, stats = forgetting_attention(q, k, v, lg, acp="auto", return_stats=True)
        pruned = float(stats.pruned_fraction.double().mean())
        times = {"|".join(key): x for key, x in alternate(versions, fwd, fwd_bwd, args.rounds).items()}
        dense, sdpa_ms = baselines(fwd, fwd_bwd, sdpa)
        row = dict(T=t, D=d, H=h, B=b, pruned=pruned, rel_vs_table=rel, sdpa_fwd_bwd=sdpa_ms, dense=dense,
                   best={key: min(x) for key, x in times.items()}, all_times=times)
        rows.append(row)
        print(f"{shape}: pruned {pruned:.3f}; dense fwd / fwd+bwd graph {dense['graph'][0]:.3f} / "
              f"{dense['graph'][1]:.3f}, SDPA fwd+bwd graph {sdpa_ms['graph']:.3f}", flush=True)
        for name in versions:
            line = [f"  {name}: rel (o, dq, dk, dv, dg) " + " ".join(f"{x:.1e}" for x in rel[name])]
            for how in ("eager", "graph"):
                df, dfb = dense[how]
                f_, fb = row["best"][f"{name}|fwd|{how}"], row["best"][f"{name}|fwd_bwd|{how}"]
                line.append(f"{how} fwd {f_:.3f} (eff {df * (1 - pruned) / f_:.2f}) fwd+bwd {fb:.3f} "
                            f"(eff {dfb * (1 - pruned) / fb:.2f})")
            print(" | ".join(line), flush=True)
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
