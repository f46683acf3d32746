"""ACP's work around the attention kernels, this tree against another commit's, in one process
(issue 16).

With ``acp="auto"`` the op finds its boundaries before the forward kernel (the query and key
norms, the bound ``delta``, the search) and the backward turns them into each key block's
last kept query block. ``--prepare REV`` (where the git history is) writes REV's
``pruning.py`` to ``ab_old/ab_old_pruning.py`` with absolute imports; the run then times
``forgetting_attention`` forward and forward+backward with ACP on the issue-2 workload (B x T
= 32k; 24 heads of 64 or 12 of 128), once through REV's boundary functions and once through
this tree's, alternating, in the same process, beside the dense op and SDPA's default backend.
Both sides' outputs and gradients must be equal bit for bit (the boundaries are).

    python scripts/ab_acp_prologue.py --prepare 0889413                    # here
    bash scripts/gpu.sh python3 scripts/ab_acp_prologue.py --out ab.json  # on the GPU, carry ab_old
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess

import torch
from tune_fox_fwd import _dump, _ms, _op_calls  # the same workload, timer, output (scripts/ on the path)

from lapse.ops.forgetting import forgetting_attention, pruning, set_value_checks, triton_ops
from lapse.ops.forgetting.common import acp_delta

OLD = "ab_old"
SRC = "src/lapse/ops/forgetting/pruning.py"


def prepare(rev: str) -> None:
    """Write ``rev``'s ``pruning.py`` to ``ab_old/ab_old_pruning.py``."""
    os.makedirs(OLD, exist_ok=True)
    text = subprocess.run(["git", "show", f"{rev}:{SRC}"], check=True, capture_output=True, text=True).stdout
    text = text.replace("from .common import", "from lapse.ops.forgetting.common import")
    with open(os.path.join(OLD, "ab_old_pruning.py"), "w") as f:
        f.write(f"# {rev}:{SRC}, imports made absolute (scripts/ab_acp_prologue.py)\n" + text)
    print(f"wrote {OLD}/ab_old_pruning.py from {rev}")


def _old_functions():
    """REV's boundaries as this tree's op calls them: ``(block starts, block ends)``."""
    spec = importlib.util.spec_from_file_location("ab_old_pruning", os.path.join(OLD, "ab_old_pruning.py"))
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)

    def block_start(acp, acp_eps, q, k, c_hi, c_lo, p):
        delta = acp_delta(acp, acp_eps, q, k, p, delta_from_data=old.triton_acp_delta)
        return old.triton_block_start(c_hi, c_lo, delta, p)

    return block_start, old.block_end_from_start


def _use(functions) -> None:
    """Make the op take these boundary functions (it looks them up at each call)."""
    pruning.triton_acp_block_start, triton_ops.block_end_from_start = functions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prepare", metavar="REV", help="write REV's pruning.py to ab_old/ and stop")
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "8192x64", "16384x64", "4096x128",
                                                    "8192x128", "16384x128"])
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two versions")
    ap.add_argument("--out", default="ab_acp_prologue.json")
    args = ap.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    new = (pruning.triton_acp_block_start, triton_ops.block_end_from_start)
    versions = {"old": _old_functions(), "new": new}
    set_value_checks(False)
    rows = []
    for shape in args.shapes:
        fwd, fwd_bwd, sdpa, (t, d, h, b, (q, k, v, lg)) = _op_calls(shape)

        outs = {}
        for name, fns in versions.items():
            _use(fns)
            outs[name] = (fwd(), *fwd_bwd())
        same = all(torch.equal(a, c) for a, c in zip(outs["old"], outs["new"], strict=True))
        _, stats = forgetting_attention(q, k, v, lg, acp="auto", return_stats=True)
        pruned = float(stats.pruned_fraction.double().mean())
        times = {f"{name}_{mode}": [] for name in versions for mode in ("fwd", "fwd_bwd")}
        for _ in range(args.rounds):
            for name, fns in versions.items():
                _use(fns)
                times[f"{name}_fwd"].append(_ms(fwd))
                times[f"{name}_fwd_bwd"].append(_ms(fwd_bwd))
        _use(versions["new"])
        dense = {"fwd": _ms(lambda: fwd(None)), "fwd_bwd": _ms(lambda: fwd_bwd(None))}
        row = dict(T=t, D=d, H=h, B=b, pruned=pruned, bit_equal=same, sdpa_fwd_bwd=_ms(sdpa),
                   dense_fwd=dense["fwd"], dense_fwd_bwd=dense["fwd_bwd"], **times)
        for key in ("old_fwd_bwd", "new_fwd_bwd"):
            best = min(times[key])
            row[f"{key}_efficiency"] = dense["fwd_bwd"] * (1 - pruned) / best
            row[f"{key}_x_sdpa"] = best / row["sdpa_fwd_bwd"]
        rows.append(row)
        print(f"{shape}: pruned {pruned:.3f}, bit-equal {same}; ACP fwd old {min(times['old_fwd']):.3f} "
              f"new {min(times['new_fwd']):.3f} ms; fwd+bwd old {min(times['old_fwd_bwd']):.3f} "
              f"new {min(times['new_fwd_bwd']):.3f} ms (x SDPA {row['old_fwd_bwd_x_sdpa']:.3f} -> "
              f"{row['new_fwd_bwd_x_sdpa']:.3f}; efficiency {row['old_fwd_bwd_efficiency']:.3f} -> "
              f"{row['new_fwd_bwd_efficiency']:.3f}); dense {dense['fwd_bwd']:.3f}, SDPA "
              f"{row['sdpa_fwd_bwd']:.3f}", flush=True)
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
