"""The FoX kernels of this tree against those of another commit, in one process (issue 16).

A kernel change is judged by timing both versions on the same GPU in the same process:
``--prepare REV`` (on a machine with the repository's git history) writes REV's
``triton_fwd.py`` and ``triton_bwd.py`` to ``ab_old/`` (git-ignored: carry it to the GPU)
with absolute imports, and the run times the forward and the
backward of both on the issue-2 workload (B x T = 32k; 24 heads of 64 or 12 of 128),
dense and with ACP, beside SDPA's default backend. Each output is checked against the
other version's (relative difference) after both wrote into NaN-poisoned buffers.

    python scripts/ab_fox_kernels.py --prepare 3deaf5d            # here
    bash scripts/gpu.sh python3 scripts/ab_fox_kernels.py --out ab.json   # on the GPU, carry ab_old

ACP's efficiency is ``t_dense * (1 - pruned) / t_acp`` with each version's own dense time.
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from tune_fox_fwd import _dump, _ms, _prepared  # the same workload, timer, output (scripts/ on the path)

from lapse.ops.forgetting import set_value_checks, triton_bwd, triton_fwd
from lapse.ops.forgetting.common import pruned_fraction
from lapse.ops.forgetting.pruning import block_end_from_start

OLD = "ab_old"
SRC = "src/lapse/ops/forgetting"
IMPORTS = {  # relative imports of the two files, made absolute (the old backward uses the old forward)
    "from ..backend import": "from lapse.ops.backend import",
    "from .gate_scan import": "from lapse.ops.forgetting.gate_scan import",
    "from .triton_fwd import": "from ab_old_fwd import",
    "from . import gluon_fwd": "from lapse.ops.forgetting import gluon_fwd",
}


def prepare(rev: str) -> None:
    """Write ``rev``'s forward and backward kernels to ``ab_old/``."""
    os.makedirs(OLD, exist_ok=True)
    for name in ("triton_fwd", "triton_bwd"):
        text = subprocess.run(["git", "show", f"{rev}:{SRC}/{name}.py"], check=True, capture_output=True,
                              text=True).stdout
        for a, b in IMPORTS.items():
            text = text.replace(a, b)
        with open(os.path.join(OLD, f"ab_old_{name[7:]}.py"), "w") as f:
            f.write(f"# {rev}:{SRC}/{name}.py, imports made absolute (scripts/ab_fox_kernels.py)\n" + text)
    print(f"wrote {OLD}/ab_old_fwd.py and ab_old_bwd.py from {rev}")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(OLD, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prepare", metavar="REV", help="write REV's kernels to ab_old/ and stop")
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "8192x64", "16384x64", "4096x128",
                                                    "8192x128", "16384x128"])
    ap.add_argument("--out", default="ab_fox_kernels.json")
    args = ap.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    sys.path.insert(0, OLD)
    old = {"fwd": _load("ab_old_fwd"), "bwd": _load("ab_old_bwd")}
    new = {"fwd": triton_fwd, "bwd": triton_bwd}
    set_value_checks(False)
    rows = []
    for shape in args.shapes:
        t, d, h, b, q, k, v, p, c_hi, c_lo, bs_acp = _prepared(shape)
        do = torch.randn_like(q)
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        sdpa_f = _ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
        ot = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        dot = do.transpose(1, 2)
        sdpa_b = _ms(lambda: torch.autograd.grad(ot, (qt, kt, vt), dot, retain_graph=True))
        for acp in (False, True):
            bs = bs_acp if acp else None
            be = block_end_from_start(bs, p) if acp else None
            pruned = float(pruned_fraction(bs, p).mean()) if acp else 0.0
            res = {}
            for tag, mod in (("old", old), ("new", new), ("old2", old), ("new2", new)):
                o, lse2 = torch.full_like(q, float("nan")), torch.full_like(c_hi, float("nan"))
                grads = [torch.full_like(x, float("nan")) for x in (q, k, v)] + \
                    [torch.full_like(lse2, float("nan")) for _ in range(2)]
                fwd = _ms(lambda: mod["fwd"].launch_fwd(q, k, v, c_hi, c_lo, bs, None, p, o, lse2))
                bwd = _ms(lambda: mod["bwd"].launch_bwd(q, k, v, o, do, lse2, None, c_hi, c_lo, bs, be, None,
                                                        p, *grads))
                res[tag] = dict(fwd=fwd, bwd=bwd, out=[o.float(), lse2.clone(), *(g.float() for g in grads)])
            diffs = [float((a - c).norm() / c.norm())
                     for a, c in zip(res["new"]["out"], res["old"]["out"], strict=True)]
            nan = any(bool(x.isnan().any()) for x in res["new"]["out"] + res["old"]["out"])
            row = dict(T=t, D=d, H=h, B=b, acp=acp, pruned=pruned, sdpa_fwd_ms=sdpa_f,
                       sdpa_fwd_bwd_ms=sdpa_f + sdpa_b, nan=nan, rel_diff_new_old=max(diffs),
                       # dcc, dcr: dS's column and row sums (the row sums are rounding noise
                       # about 0 without an lse gradient, so their relative difference is large)
                       rel_diff_by_output=dict(zip(("o", "lse", "dq", "dk", "dv", "dcc", "dcr"), diffs,
                                                   strict=True)))
            for tag in ("old", "new"):
                fwd = min(res[tag]["fwd"], res[tag + "2"]["fwd"])
                bwd = min(res[tag]["bwd"], res[tag + "2"]["bwd"])
                row[f"{tag}_fwd_ms"], row[f"{tag}_fwd_bwd_ms"] = fwd, fwd + bwd
            rows.append(row)
            print(f"T {t} D {d} acp {int(acp)} (pruned {pruned:.2f}): fwd old {row['old_fwd_ms']:.3f} new "
                  f"{row['new_fwd_ms']:.3f} sdpa {sdpa_f:.3f} | fwd+bwd old {row['old_fwd_bwd_ms']:.3f} new "
                  f"{row['new_fwd_bwd_ms']:.3f} sdpa {row['sdpa_fwd_bwd_ms']:.3f} | diff {max(diffs):.1e}"
                  f"{' NaN' if nan else ''}", flush=True)
    print("\nT D acp | fwd x SDPA old -> new | fwd+bwd x SDPA old -> new | ACP efficiency fwd+bwd old -> new")
    for r in rows:
        eff = ""
        if r["acp"]:
            dense = next(x for x in rows if x["T"] == r["T"] and x["D"] == r["D"] and not x["acp"])
            e = {tag: dense[f"{tag}_fwd_bwd_ms"] * (1 - r["pruned"]) / r[f"{tag}_fwd_bwd_ms"]
                 for tag in ("old", "new")}
            r.update(eff_old=e["old"], eff_new=e["new"])
            eff = f"{e['old']:.2f} -> {e['new']:.2f}"
        x = {key: r[f"{key}_ms"] / r[f"sdpa_{key[4:]}_ms"] for key in ("old_fwd", "new_fwd", "old_fwd_bwd",
                                                                      "new_fwd_bwd")}
        print(f"{r['T']} {r['D']} {int(r['acp'])} | {x['old_fwd']:.2f} -> {x['new_fwd']:.2f} | "
              f"{x['old_fwd_bwd']:.2f} -> {x['new_fwd_bwd']:.2f} | {eff}")
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
