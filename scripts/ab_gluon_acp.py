"""The D 128 ACP table with and without its persistent Gluon launch (``GLUON_ACP="routed"``),
in one process (issue 16).

Times ``forgetting_attention`` forward and forward+backward with ``acp="auto"`` on the issue-2
workload (B x T = 32k, 12 heads of 128), through the table as it is and through the table with
``GLUON_ACP`` taken out (the Triton kernel on both routed launches), alternating, beside the dense
op and SDPA's default backend; eager (``do_bench``) and replayed from a CUDA graph
(``do_bench_cudagraph``). The two sides' outputs and gradients are compared first.

    bash scripts/gpu.sh python3 scripts/ab_gluon_acp.py --out ab_gluon_acp.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse

import triton
from tune_fox_fwd import _dump, _ms, _op_calls  # the same workload, timer, output (scripts/ on the path)

from lapse.ops.forgetting import forgetting_attention, gluon_fwd, set_value_checks, triton_fwd

TABLE = triton_fwd.fwd_config
GLUON_CALLS = []  # one entry a Gluon ACP launch (a wrapper below counts them)
_launch_acp = gluon_fwd.launch_acp


def _counted_launch_acp(*a, **kw):
    GLUON_CALLS.append(1)
    return _launch_acp(*a, **kw)


gluon_fwd.launch_acp = _counted_launch_acp


def _without_gluon(*a, **kw) -> dict:
    cfg = TABLE(*a, **kw)
    cfg.pop("GLUON_ACP", None)
    return cfg


def _graph_ms(fn) -> float:
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a call that does not capture: say so, time on
        print(f"  graph: {type(e).__name__}: {str(e)[:100]}")
        return float("nan")


def alternate(versions: dict, fwd, fwd_bwd, rounds: int) -> dict[tuple[str, str, str], list[float]]:
    """Each version's forward and forward+backward times, eager and from a CUDA graph, the
    versions (forward tables) taking turns for ``rounds``: ``{(version, mode, how): [ms, ...]}``.
    The table is the module's own again afterwards."""
    times = {(name, mode, how): [] for name in versions for mode in ("fwd", "fwd_bwd")
             for how in ("eager", "graph")}
    for _ in range(rounds):
        for name, table in versions.items():
            triton_fwd.fwd_config = table
            for how, timer in (("eager", _ms), ("graph", _graph_ms)):
                times[(name, "fwd", how)].append(timer(fwd))
                times[(name, "fwd_bwd", how)].append(timer(fwd_bwd))
    triton_fwd.fwd_config = TABLE
    return times


def baselines(fwd, fwd_bwd, sdpa) -> tuple[dict, dict]:
    """The dense op's forward and forward+backward times and SDPA's default backend's
    forward+backward, each eager and from a CUDA graph."""
    dense = {how: (timer(lambda: fwd(None)), timer(lambda: fwd_bwd(None)))
             for how, timer in (("eager", _ms), ("graph", _graph_ms))}
    return dense, {"eager": _ms(sdpa), "graph": _graph_ms(sdpa)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x128", "8192x128", "16384x128"])
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two versions")
    ap.add_argument("--out", default="ab_gluon_acp.json")
    args = ap.parse_args()
    versions = {"triton": _without_gluon, "gluon": TABLE}
    set_value_checks(False)
    rows = []
    for shape in args.shapes:
        fwd, fwd_bwd, sdpa, (t, d, h, b, (q, k, v, lg)) = _op_calls(shape)

        outs = {}
        for name, table in versions.items():
            triton_fwd.fwd_config = table
            ran = len(GLUON_CALLS)
            outs[name] = (fwd(), *fwd_bwd())
            if name == "gluon" and len(GLUON_CALLS) == ran:
                print(f"{shape}: the table's Gluon launch did not run (a Triton other than 3.6, not Hopper, "
                      "or too few rows to route): both sides are the Triton kernel")
        rel = [float((a.float() - c.float()).norm() / c.float().norm().clamp_min(1e-30))
               for a, c in zip(outs["gluon"], outs["triton"], strict=True)]
        _, stats = forgetting_attention(q, k, v, lg, acp="auto", return_stats=True)
        pruned = float(stats.pruned_fraction.double().mean())
        times = {"_".join(key): x for key, x in alternate(versions, fwd, fwd_bwd, args.rounds).items()}
        dense, sdpa_ms = baselines(fwd, fwd_bwd, sdpa)
        row = dict(T=t, D=d, H=h, B=b, pruned=pruned, rel_gluon_vs_triton=rel, sdpa_fwd_bwd=sdpa_ms,
                   dense=dense, **{key: min(x) for key, x in times.items()}, all_times=times)
        rows.append(row)
        print(f"{shape}: pruned {pruned:.3f}; gluon vs triton rel (o, dq, dk, dv, dg) "
              + " ".join(f"{x:.1e}" for x in rel), flush=True)
        for how in ("eager", "graph"):
            df, dfb = dense[how]
            line = []
            for name in versions:
                f_, fb = row[f"{name}_fwd_{how}"], row[f"{name}_fwd_bwd_{how}"]
                line.append(f"{name} fwd {f_:.3f} (eff {df * (1 - pruned) / f_:.2f}) fwd+bwd {fb:.3f} "
                            f"(eff {dfb * (1 - pruned) / fb:.2f}, x cuDNN {fb / sdpa_ms[how]:.3f})")
            print(f"  {how}: " + " | ".join(line) + f" | dense {df:.3f} / {dfb:.3f}, SDPA {sdpa_ms[how]:.3f}",
                  flush=True)
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
