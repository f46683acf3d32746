"""``lapse bench attention --sweep``: the FoX Triton kernels' tile options on the bench's workloads.

The forward kernel (``fwd``: ``triton_fwd.launch_fwd``) and the backward kernels (``bwd``: the
dK/dV kernel's options with the dQ kernel at its table's config, then the dQ kernel's with
dK/dV at its table's; ``triton_bwd.launch_bwd``) are launched directly, dense and with ACP, at
each option of :data:`FWD_OPTIONS`, :data:`DKDV_OPTIONS` and :data:`DQ_OPTIONS`. An option sets
the tile sizes ``BM`` x ``BN``, the warps and the pipeline stages over the table's config for
the workload (``fwd_config``, ``bwd_config``) and keeps the table's other switches. With ACP a
tile that runs along the keys (the forward's and dQ's ``BN``, dK/dV's ``BM`` along the
queries) must divide the 64-wide ACP block, so the 128-wide options run dense only.

Each option's outputs are filled with NaN, computed, and compared with the table config's
(the output, or the gradients of q, k, v and the log gates; relative Frobenius difference: the
same function, so rounding only); an option that leaves a
NaN or differs by more than :data:`TOLERANCE` is reported wrong and not timed, one that does not
compile (shared memory, registers) with its error. Times are the bench's (``do_bench``, median,
the host's launches included). The backward runs on Triton here even where FlashAttention-4
would serve the op's backward.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import Tensor

from .workloads import Workload

FWD_OPTIONS = list(itertools.product((64, 128), (64, 128), (4, 8), (2, 3)))
"""``(BM, BN, warps, stages)`` of the forward kernel."""
DKDV_OPTIONS = list(itertools.product((32, 64), (64, 128), (4, 8), (2, 3)))
"""``(BM, BN, warps, stages)`` of the dK/dV kernel (BM queries a step over BN keys)."""
DQ_OPTIONS = list(itertools.product((64, 128), (32, 64), (4, 8), (2, 3)))
"""``(BM, BN, warps, stages)`` of the dQ kernel (BM queries over BN keys a step)."""
TOLERANCE = 2e-2
"""Largest relative difference from the table config's outputs an option may show."""


def _option(table: dict, bm: int, bn: int, warps: int, stages: int) -> dict:
    return dict(table, BM=bm, BN=bn, num_warps=warps, num_stages=stages)


def _label(cfg: dict) -> str:
    return f"{cfg['BM']} x {cfg['BN']}, {cfg['num_warps']} warps, {cfg['num_stages']} stages"


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b).norm() / b.norm().clamp_min(1e-30))


def _time_options(kernel: str, acp: bool, table, options, launch, outputs, timer,
                  compared=None) -> list[dict]:
    """One row per option: ``launch(config)`` checked against ``launch(table)``, then timed; the
    table's own row first. ``outputs`` are the tensors it writes (NaN-filled before an option
    runs, so none may be left unwritten); ``compared()`` the results compared (default the
    outputs themselves)."""
    compared = compared or (lambda: outputs)
    launch(table)
    ref = [x.float().clone() for x in compared()]
    table_ms = timer(lambda: launch(table))
    rows = [{"kernel": kernel, "acp": acp, "option": "table", "config": table, "ms": table_ms,
             "x_table": 1.0}]
    for label, cfg in options:
        row: dict = {"kernel": kernel, "acp": acp, "option": label, "config": cfg}
        try:
            for x in outputs:
                x.fill_(float("nan"))
            launch(cfg, poison=True)
            row["rel_diff"] = max(_rel(x, r) for x, r in zip(compared(), ref, strict=True))
            if any(bool(x.isnan().any()) for x in outputs) or not row["rel_diff"] <= TOLERANCE:
                row["error"] = f"wrong: relative difference {row['rel_diff']:.2e} from the table's outputs"
            else:
                row["ms"] = timer(lambda cfg=cfg: launch(cfg))
                row["x_table"] = row["ms"] / table_ms
        except Exception as e:  # out of shared memory or registers: report it and go on
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            row["error"] = f"{type(e).__name__}: {first}"
        rows.append(row)
    return rows


def sweep(wl: Workload, d_out: Tensor, kernels, acps, acp_eps: float,
          timer: Callable[[Callable[[], object]], float]) -> list[dict]:
    """The option rows of ``kernels`` (``"fwd"``, ``"bwd"``) on ``wl``, once per entry of
    ``acps`` (``None``: dense; else the ``acp`` argument whose boundaries the kernels use);
    ``d_out`` is the backward's output gradient, ``timer(fn)`` the bench's timing of ``fn``."""
    from lapse.ops.forgetting import common
    from lapse.ops.forgetting.pruning import block_end_from_start, triton_acp_block_start
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    q, k = wl.q, wl.k
    p = common.validate(q, k, wl.v, wl.log_fgate, None, wl.cu_seqlens, "triton")
    c_hi, c_lo = triton_gate_cumsum(wl.log_fgate, p)
    rows = []
    with torch.no_grad():
        for acp in acps:
            bs = None if acp is None else triton_acp_block_start(acp, acp_eps, q, k, c_hi, c_lo, p)
            be = None if bs is None else block_end_from_start(bs, p)
            rows += _sweep_kernels(wl, d_out, kernels, p, c_hi, c_lo, bs, be, timer)
    return rows


def _sweep_kernels(wl: Workload, d_out, kernels, p, c_hi, c_lo, bs, be, timer) -> list[dict]:
    """:func:`sweep`'s rows for one set of ACP boundaries ``bs``, ``be`` (``None``: dense)."""
    from lapse.ops.forgetting import ACP_BLOCK, LOG_GATE_FLOOR, triton_bwd, triton_fwd
    from lapse.ops.forgetting.gate_scan import gate_grad

    q, k, v, cu = wl.q, wl.k, wl.v, wl.cu_seqlens
    pruned = bs is not None
    o, lse2 = torch.empty_like(q), torch.empty_like(c_hi)
    rows = []

    def fwd(cfg, poison=False):  # no scratch to poison: o is, by the caller
        triton_fwd.launch_fwd(q, k, v, c_hi, c_lo, bs, cu, p, o, lse2, cfg)

    table = triton_fwd.fwd_config(p.d, q.element_size(), pruned, p.tk)
    if "fwd" in kernels:
        options = [(_label(c), c) for c in (_option(table, *opt) for opt in FWD_OPTIONS)
                   if not (pruned and ACP_BLOCK % c["BN"])]
        rows += _time_options("fwd", pruned, table, options, fwd, [o], timer)
    if "bwd" not in kernels:
        return rows
    fwd(table)  # o and lse2 for the backward
    grads = [torch.empty_like(x) for x in (q, k, v, lse2, lse2)]  # dq, dk, dv, dS's column and row sums

    def bwd(cfgs, poison=False):
        triton_bwd.launch_bwd(q, k, v, o, d_out, lse2, None, c_hi, c_lo, bs, be, cu, p, *grads,
                              configs=cfgs, poison=poison)

    def gradients():  # the gate's, not the sums of dS it comes from: without a gradient of the
        # lse the row sums are zero but for rounding
        return [*grads[:3], gate_grad(grads[3], grads[4], wl.log_fgate, p, LOG_GATE_FLOOR)]

    kv0, q0 = triton_bwd.bwd_config(p.d, p.hq // p.h, pruned, p.tk)
    options = [(f"dK/dV {_label(c)}", (c, q0)) for c in (_option(kv0, *opt) for opt in DKDV_OPTIONS)
               if not (pruned and ACP_BLOCK % c["BM"])]
    options += [(f"dQ {_label(c)}", (kv0, c)) for c in (_option(q0, *opt) for opt in DQ_OPTIONS)
                if not (pruned and ACP_BLOCK % c["BN"])]
    return rows + _time_options("bwd", pruned, (kv0, q0), options, bwd, grads, timer, gradients)


def sweep_markdown(rows: list[dict]) -> str:
    """A table per kernel and ACP setting, the table's config first, then the options fastest
    first (those that failed last, with why)."""
    out = []
    for (kernel, acp), group in itertools.groupby(rows, key=lambda r: (r["kernel"], r["acp"])):
        group = list(group)
        table, options = group[0], group[1:]
        timed = sorted((r for r in options if "ms" in r), key=lambda r: r["ms"])
        failed = [r for r in options if "ms" not in r]
        cfgs = table["config"] if kernel == "fwd" else table["config"][0]
        what = "forward" if kernel == "fwd" else "backward (dK/dV, then dQ)"
        out += [f"### {what}, {'ACP' if acp else 'dense'}", "",
                f"The table: `{table['config']}`." if kernel == "fwd" else
                f"The tables: dK/dV `{cfgs}`, dQ `{table['config'][1]}`.", "",
                "| option | ms | x table | relative difference |", "| --- | --- | --- | --- |",
                f"| table | {table['ms']:.3f} | 1.00 | |"]
        for r in timed:
            out.append(f"| {r['option']} | {r['ms']:.3f} | {r['x_table']:.2f} | {r['rel_diff']:.1e} |")
        for r in failed:
            out.append(f"| {r['option']} | n/a: {r['error']} | | |")
        out.append("")
    return "\n".join(out)
