"""FoX's forward on FlashAttention-4 (fa4_fwd.py) against the Triton forward, in one process (issue 16,
thirty-first session): graph times (ms) of the forward and of forward+backward, dense and ACP, with
the forward on each kernel (the backward on FlashAttention-4's either way), beside FlashAttention-4
and SDPA's default backend (cuDNN), on the bench's workload (bf16, 24 heads, B x T = 32768).

    source scripts/fa4_env.sh && python3 scripts/diag_fa4_fwd.py --out $OUT/fa4-fwd.json
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--dims", nargs="*", type=int, default=[128, 64])
    ap.add_argument("--seq-lens", nargs="*", type=int, default=[4096, 8192, 16384])
    ap.add_argument("--forwards", nargs="*", default=["fa4", "triton"], help="lapse's forwards to time")
    a = ap.parse_args()

    import torch

    from lapse.bench import attention as bench
    from lapse.bench.workloads import WorkloadSpec, make_workload
    from lapse.ops.forgetting import fa4_fwd, set_value_checks

    set_value_checks(False)
    cfg = bench.AttentionBenchConfig()
    fa4_fwd.ENABLED = True  # for the environment's label; each run below sets its own
    res: dict = {"env": bench.environment(), "timing": []}
    forward, calls = fa4_fwd.forward, []
    fa4_fwd.forward = lambda *args, **kw: calls.append(1) or forward(*args, **kw)  # where each "fwd fa4" ran
    for d in a.dims:
        for t in a.seq_lens:
            wl = make_workload(WorkloadSpec(seq_len=t, tokens=32768, heads=24, kv_heads=24, head_dim=d),
                               device="cuda")
            do = torch.randn_like(wl.q)
            row: dict = {"D": d, "T": t}
            for name in ("sdpa-default", "flash-attn-4", "lapse", "lapse-acp"):
                runs = [("", True)] if name not in ("lapse", "lapse-acp") else [
                    (f" fwd {f}", f == "fa4") for f in a.forwards]
                for label, on in runs:
                    fa4_fwd.ENABLED = on
                    r = bench.build_runner(name, wl, cfg)
                    dout = r.from_bthd(do)

                    def fwd(r=r):
                        with r.context(), torch.no_grad():
                            return r.forward()

                    def both(r=r, dout=dout):
                        with r.context():
                            return torch.autograd.grad(r.forward(), r.grad_inputs, dout)

                    for mode, fn in (("fwd", fwd), ("fwd+bwd", both)):
                        calls.clear()
                        try:
                            fn()
                            row[f"{name}{label} {mode}"] = bench._time_graphed(fn, cfg)
                        except Exception as e:
                            row[f"{name}{label} {mode}"] = bench._short(e)
                        if label:  # the forward FlashAttention-4's (no fallback) where the label says so
                            ran = bool(calls) and fa4_fwd.ENABLED
                            row[f"{name}{label} {mode} forward on flash-attn-4"] = ran
                        bench._free()
            fa4_fwd.ENABLED = True
            res["timing"].append(row)
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
