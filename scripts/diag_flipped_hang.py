"""Which kernel stops in ``test_other_load_options_gpu`` (issue 16, twenty-fourth session: the
op's GPU tests stopped there three times, in the D 64 or D 96 case with ACP). Runs one of the
test's cases with the test's flipped options, plus JSON overrides of the forward's, the dK/dV
kernel's and the dQ kernel's configs, every launch blocking (``CUDA_LAUNCH_BLOCKING=1``), and
prints the Python stack of a call that has not returned after ``--after`` seconds.

    CUDA_LAUNCH_BLOCKING=1 python scripts/diag_flipped_hang.py --case 1 --kv '{"BM": 32}'
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time

import pytest

sys.path.insert(0, "tests/ops")
import test_forgetting_triton as t  # noqa: E402

from lapse.ops.forgetting import triton_bwd, triton_fwd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", type=int, default=1, help="index into the tests' GPU_CASES")
    ap.add_argument("--fwd", type=json.loads, default={})
    ap.add_argument("--kv", type=json.loads, default={})
    ap.add_argument("--q", type=json.loads, default={})
    ap.add_argument("--no-flip", action="store_true", help="the tables' own options (with the overrides)")
    ap.add_argument("--after", type=float, default=45.0)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.after, exit=True)
    with pytest.MonkeyPatch.context() as mp:
        if not args.no_flip:
            t._flip_load_options(mp)
        fwd, bwd = triton_fwd.fwd_config, triton_bwd.bwd_config
        mp.setattr(triton_fwd, "fwd_config", lambda *a, **k: dict(fwd(*a, **k), **args.fwd))

        def bwd_over(*a, **k):
            kv, q = bwd(*a, **k)
            return dict(kv, **args.kv), dict(q, **args.q)

        mp.setattr(triton_bwd, "bwd_config", bwd_over)
        case = t.GPU_CASES[args.case]
        start = time.time()
        t._check_gpu(case)
        print(f"case {args.case} {t._id(case)} passed in {time.time() - start:.1f} s "
              f"(fwd {args.fwd}, kv {args.kv}, q {args.q})", flush=True)


if __name__ == "__main__":
    main()
