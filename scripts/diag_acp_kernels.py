"""Where FoX's forward+backward spends its GPU time, kernel by kernel, dense against ACP (issue 16:
ACP's efficiency): torch.profiler over a few steps of ``lapse`` and ``lapse-acp`` on the bench's
workload (bf16, B x T = 32768, 24 heads), each kernel's mean time per step.

    source scripts/fa4_env.sh && python3 scripts/diag_acp_kernels.py --out $OUT/acp-kernels.json
"""

from __future__ import annotations

import argparse
import collections
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--dims", nargs="*", type=int, default=[64, 128])
    ap.add_argument("--seq-lens", nargs="*", type=int, default=[4096, 16384])
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from lapse.bench import attention as bench
    from lapse.bench.workloads import WorkloadSpec, make_workload
    from lapse.ops.forgetting import set_value_checks

    set_value_checks(False)
    cfg = bench.AttentionBenchConfig()
    res: dict = {"env": bench.environment(), "rows": []}
    for d in a.dims:
        for t in a.seq_lens:
            spec = WorkloadSpec(seq_len=t, tokens=32768, heads=24, kv_heads=24, head_dim=d)
            wl = make_workload(spec, device="cuda")
            do = torch.randn_like(wl.q)
            for name in ("lapse", "lapse-acp"):
                r = bench.build_runner(name, wl, cfg)
                dout = r.from_bthd(do)

                def both(r=r, dout=dout):
                    with r.context():
                        return torch.autograd.grad(r.forward(), r.grad_inputs, dout)

                for _ in range(3):
                    both()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(a.steps):
                        both()
                    torch.cuda.synchronize()
                per = collections.defaultdict(float)
                for ev in prof.events():
                    if ev.device_type == torch.autograd.DeviceType.CUDA:
                        per[ev.name[:90]] += ev.device_time / 1000 / a.steps  # ms a step
                total = sum(per.values())
                row = {"D": d, "T": t, "provider": name, "total ms": round(total, 4),
                       "kernels": {k: round(v, 4) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}}
                print(json.dumps(row), flush=True)
                res["rows"].append(row)
                bench._free()
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
