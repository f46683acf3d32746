"""Times CASTLE's decode step per layer with the immediate and the deferred ("folded")
lookahead update on the GPU (issue 13; ``src/lapse/ops/castle/README.md``, "The
deferred update").

One layer at the 125M CASTLE shapes (7 heads of 64, bf16 caches, float32 ``u``), B x
held slots in ``--shapes``, CASTLE and CASTLE-SWL. Each measurement is a CUDA graph of
``M`` consecutive steps (slots ``n .. n + M - 1``, so the deferred update folds once in
it, as it does every ``M`` steps) replayed by ``triton.testing.do_bench_cudagraph``;
reported per step. Before timing, the deferred steps' outputs are checked against the
immediate ones on copies of the caches, and the bytes a step must move are given:
immediate ``u`` read and written, ``q^U, k^C, v^C`` read; deferred ``u, q^U, k^C, v^C``
read and ``u`` written once per ``M`` steps (SWL: ``u`` written and ``q^U`` read only in
the window's rows).

    python scripts/bench_castle_fold.py --out bench_castle_fold.json
"""

# ruff: noqa: B023 (each closure over loop variables is timed inside its own iteration)
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton.testing

# the same 125M-shape caches as the tile tuning (this folder is on sys.path when a script in
# it runs); H, D: 7 heads of 64
from tune_castle_decode import D, H, _inputs

from lapse.ops.castle import castle_decode_fold, castle_decode_step


def _steps(new, caches, lens, u, window, ring):
    """``len(lens)`` consecutive steps of one layer; their outputs."""
    return [castle_decode_step(new["q_c"], new["k_u"], new["v_u"], u, caches["qu"], caches["kc"],
                               caches["vc"], n, window=window, check_values=False, backend="triton",
                               pending=ring) for n in lens]


def _ring(b: int, m: int):
    return (torch.zeros(b, m, H, D, device="cuda", dtype=torch.bfloat16),
            torch.zeros(b, m, H, D, device="cuda", dtype=torch.bfloat16),
            torch.full((b, m), -1, device="cuda", dtype=torch.int32))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["8x4096", "1x4096"])
    p.add_argument("--windows", nargs="+", default=["none", "512"])
    p.add_argument("--fold-every", nargs="+", type=int, default=[4, 8, 16])
    p.add_argument("--out", default="bench_castle_fold.json")
    args = p.parse_args()
    rows = []
    for shape, win, m in itertools.product(args.shapes, args.windows, args.fold_every):
        b, n = (int(x) for x in shape.split("x"))
        window = None if win == "none" else int(win)
        new, caches, _ = _inputs(b, n, n + m + 64)
        # slots n-1 .. n+m-2 are the new tokens (the first at a fold boundary when m | n)
        lens = [torch.full((b,), n + i, dtype=torch.int32, device="cuda") for i in range(m)]
        u_i, u_d = caches["u"].clone(), caches["u"].clone()
        o_i = _steps(new, caches, lens, u_i, window, None)
        ring = _ring(b, m)
        o_d = _steps(new, caches, lens, u_d, window, ring)
        castle_decode_fold(u_d, caches["qu"], ring, lens[-1], window=window)  # U^t, as u_i
        o_err = max((x.float() - y.float()).abs().max().item() for x, y in zip(o_i, o_d, strict=True))
        u_err = (u_i[:, :n + m - 1] - u_d[:, :n + m - 1]).abs().max().item()
        row = dict(batch=b, slots=n, window=window, fold_every=m, o_err=o_err, u_err=u_err)
        changed = n if window is None else min(n, window + m)
        per = b * H * D
        row["bytes_immediate"] = per * (n * (4 + 2 + 2) + changed * (4 + 2))
        row["bytes_deferred"] = per * (n * (4 + 2 + 2) + changed * 2 + changed * 4 / m)
        bench = triton.testing.do_bench_cudagraph
        for name, ring in (("immediate", None), ("deferred", _ring(b, m))):
            u = caches["u"].clone()
            us = 1e3 * bench(lambda: _steps(new, caches, lens, u, window, ring), rep=50,
                             return_mode="median") / m
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_tb_s"] = round(row[f"bytes_{name}"] / us / 1e6, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
