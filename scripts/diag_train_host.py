"""On the GPU: whether a compiled training step waits on the host (issue 16, item 4).

For one model (default the 125M FoX Pro with ACP, T 16384, one row a forward) it times
steps three ways: wall time per step, the GPU's busy time in the same step (the sum of the
kernels' CUDA time in a profile), and the host time of one ``forgetting_attention`` forward
and backward at the model's layer shape, with its hottest Python functions (cProfile).

    python3 scripts/diag_train_host.py --out host.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from lapse.models import Decoder, optimizer_groups, preset
from lapse.models.decoder import prepare_blocks
from lapse.ops.forgetting import forgetting_attention, set_value_checks
from lapse.train.trainer import train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--arch", default="fox-pro")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=1, help="rows a forward")
    ap.add_argument("--no-acp", action="store_true")
    ap.add_argument("--mode", default=None,
                    help="torch.compile mode of each block, e.g. reduce-overhead (CUDA graphs)")
    ap.add_argument("--out", default="host.txt")
    args = ap.parse_args()
    set_value_checks(False)
    dev = torch.device("cuda")
    cfg = preset(args.preset, args.arch, max_seq_len=args.seq_len)
    if cfg.attention == "forgetting":
        cfg = replace(cfg, acp=not args.no_acp)
    model = Decoder(cfg).to(dev)
    prepare_blocks(model, compile=args.mode or True)  # as the trainer and lapse bench train do
    opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-5, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (args.rows, args.seq_len + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    acp = getattr(cfg, "acp", None)
    lines = [f"== {cfg.name} T={args.seq_len} rows={args.rows} acp={acp} mode={args.mode}"]

    def step():
        train_step(model, opt, x, y, args.rows, dev, torch.bfloat16, 1.0)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    wall = sorted(walls)[len(walls) // 2]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    lines.append(f"step wall {wall * 1e3:.1f} ms, GPU busy {busy * 1e3:.1f} ms ({busy / wall:.0%})")

    # host time of the op alone, at one layer's shape
    if cfg.attention == "forgetting":
        h, d = cfg.n_heads, cfg.d_model // cfg.n_heads
        q, k, v = (F.rms_norm(torch.randn(args.rows, args.seq_len, h, d, device=dev), (d,)).bfloat16()
                   .requires_grad_() for _ in range(3))
        lg = F.logsigmoid(4 + torch.randn(args.rows, args.seq_len, h, device=dev)).requires_grad_()
        acp = "auto" if getattr(cfg, "acp", False) else None

        def op():
            forgetting_attention(q, k, v, lg, acp=acp, backend="triton").sum().backward()

        for _ in range(3):
            op()
        torch.cuda.synchronize()
        n = 20
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        host = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        gpu = (time.perf_counter() - t0) / n
        lines.append(f"op fwd+bwd [{args.rows}, {args.seq_len}, {h}, {d}]: host {host * 1e3:.2f} ms a call "
                     f"(queued), {gpu * 1e3:.2f} ms with the GPU's finish")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            op()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        lines.append(s.getvalue())
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
