"""Where the time of one FoX forward+backward goes, kernel by kernel (issue 16).

Runs ``forgetting_attention`` (Triton backend) dense and with ACP (``acp="auto"``) on the
issue-2 workload (``tune_fox_fwd._issue2``: B x T = 32k, 24 heads of 64 or 12 of 128)
under ``torch.profiler`` and prints, per shape and mode, each kernel's device time per
call, the sum, the wall time of the same call (``do_bench``, median) and their
difference (time the GPU is idle: launches and host work). The main attention kernels
are what the tuning tables tune; everything else is the op's fixed cost, which ACP's
efficiency ``t_dense * (1 - pruned) / t_acp`` pays in full.

    python scripts/profile_fox_op.py --shapes 4096x64 16384x64 --out profile.json
"""

# ruff: noqa: B023 (each closure over loop variables runs inside its own iteration)
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile
from tune_fox_fwd import _dump, _issue2, _ms  # the same workload, timer, output (scripts/ on the path)

from lapse.ops.forgetting import forgetting_attention, set_value_checks


def _kernels(fn, reps: int = 5) -> dict[str, float]:
    """Device ms per call of each kernel ``fn`` launches, by kernel name."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name[:90]] += ev.device_time / 1e3 / reps
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x64", "8192x64", "16384x64", "4096x128"],
                    help="T x D; heads 24 at D 64, 12 at D 128, B = 32768 / T")
    ap.add_argument("--out", default="fox_op_profile.json")
    args = ap.parse_args()
    set_value_checks(False)
    rows = []
    for shape in args.shapes:
        t, d, h, b, (q, k, v, lg) = _issue2(shape)
        q, k, v, lg = (x.requires_grad_() for x in (q, k, v, lg))
        do = torch.randn_like(q)
        for acp in (None, "auto"):
            def fwd(acp=acp):
                with torch.no_grad():
                    return forgetting_attention(q, k, v, lg, acp=acp, backend="triton")

            def fwd_bwd(acp=acp):
                o = forgetting_attention(q, k, v, lg, acp=acp, backend="triton")
                torch.autograd.grad(o, (q, k, v, lg), do)

            for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                kern = _kernels(fn)
                total = sum(kern.values())
                wall = _ms(fn)
                rows.append(dict(T=t, D=d, H=h, B=b, acp=acp is not None, mode=mode, wall_ms=wall,
                                 kernel_ms=total, kernels=kern))
                print(f"\n## T {t} D {d} {'ACP' if acp else 'dense'} {mode}: wall {wall:.3f} ms, "
                      f"kernels {total:.3f} ms, idle {wall - total:.3f} ms")
                for name, ms in kern.items():
                    print(f"  {ms:8.4f}  {name}")
    _dump(args.out, rows)


if __name__ == "__main__":
    main()
