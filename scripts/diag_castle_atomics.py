"""Diagnostic, not a result: how much of CASTLE's key-major backward do its atomic adds
cost? Times the backward as is and a copy whose atomic adds are plain stores (racy, wrong
gradients: timing only), D 64 and 128, T 4096, B x T = 16k, 8 heads, bf16, each at its
tile table's entry. The copy is written beside ``triton_parallel.py`` (Triton reads a
kernel's source from its file) and removed at the end.

    bash scripts/gpu.sh python3 scripts/diag_castle_atomics.py atomics.json
"""

# ruff: noqa: B023 (each closure is timed inside its own iteration)
import importlib
import json
import pathlib
import re
import sys

import torch
import triton.testing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import lapse.ops.castle.triton_parallel as tp

src = pathlib.Path(tp.__file__).read_text()
src2 = re.sub(r',\s*sem="relaxed"\)', ")", src.replace("tl.atomic_add(", "tl.store("))
assert "atomic_add" not in src2
path = pathlib.Path(tp.__file__).with_name("_exp_noatomic.py")
path.write_text(src2)
na = importlib.import_module("lapse.ops.castle._exp_noatomic")
from tune_castle_parallel import _inputs  # noqa: E402

rows = []
for d in (64, 128):
    for window in (None, 512):
        xs, do = _inputs(4096, 8, d)
        b, t, h, _ = xs[0].shape
        f32 = dict(dtype=torch.float32, device="cuda")
        m2, den = torch.empty(b, h, t, **f32), torch.zeros(b, h, t, **f32)
        acc, u = torch.zeros(b, h, t, d, **f32), torch.empty(b, h, t, d, **f32)
        scale = d ** -0.5
        tp.launch_parallel_fwd(*xs, scale, window, m2, acc, den, u, tp.parallel_config(d, False))
        lse2 = m2 + torch.log2(den)
        o = (acc / den[..., None]).transpose(1, 2).bfloat16().contiguous()
        delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()
        grads = [torch.zeros(b, h, t, d, **f32) for _ in range(6)]
        cfg = tp.parallel_config(d, False, backward=True, window=window)
        row = dict(d=d, window=window, **cfg)
        for name, mod in (("atomic", tp), ("store", na)):
            row[name] = triton.testing.do_bench(
                lambda mod=mod: mod.launch_parallel_bwd(*xs, do, lse2, delta, u, grads, scale, window, cfg),
                rep=200, return_mode="median")
        print(json.dumps(row), flush=True)
        rows.append(row)
out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "atomics.json")
out.write_text(json.dumps(rows, indent=1))
path.unlink()
