"""Host time of FoX's backward on FlashAttention-4 (fa4_bwd.py) against the Triton backward:
eager forward+backward calls on a small problem (the GPU's part is short, so the wall time a
call is the host's), and a profile of the FlashAttention-4 calls. Issue 16, thirtieth session.

    python scripts/diag_fa4_host.py --out $OUT/fa4-host.json     # on the GPU, flash-attn-4 installed
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from lapse.ops.forgetting import fa4_bwd, forgetting_attention, set_value_checks


def _ms_per_call(fn, n=50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    a = ap.parse_args()
    set_value_checks(False)
    res: dict = {"rows": []}
    for d in (64, 128):
        g = torch.Generator(device="cuda").manual_seed(d)
        xs = [torch.randn(1, 256, 4, d, device="cuda", generator=g).bfloat16().requires_grad_()
              for _ in range(3)]
        logits = torch.randn(1, 256, 4, device="cuda", generator=g) - 1
        xs.append(torch.nn.functional.logsigmoid(logits).requires_grad_())
        do = torch.randn_like(xs[0])

        def step(acp, xs=xs, do=do):
            o = forgetting_attention(*xs, acp=acp)
            torch.autograd.grad(o, xs, do)

        row = {"D": d}
        for acp in (None, "auto"):
            for on in (True, False):
                fa4_bwd.ENABLED = on
                name = f"{'acp' if acp else 'dense'}, {'fa4' if on else 'triton'} backward, ms a call"
                row[name] = _ms_per_call(lambda acp=acp: step(acp))
        fa4_bwd.ENABLED = True
        for acp in (None, "auto"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                step(acp)
            torch.cuda.synchronize()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
            name = f"profile {'acp' if acp else 'dense'} (20 calls, by own time)"
            row[name] = s.getvalue().splitlines()[-30:]
        print(json.dumps({k_: v_ for k_, v_ in row.items() if not k_.startswith("profile")}), flush=True)
        for k_, v_ in row.items():
            if k_.startswith("profile"):
                print(k_)
                print("\n".join(line[:150] for line in v_))
        res["rows"].append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
