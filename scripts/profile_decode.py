"""Where a compiled decode step spends its GPU time (issue 12): a random-init model of a
preset's shapes, a prompt prefilled into a DenseStore, then steps of the step compiled
without CUDA graphs (``mode=None``: the profiler sees every kernel) under the PyTorch
profiler; prints the top kernels by device time and the device time per step.

    python scripts/profile_decode.py --preset 125m --arch fox-pro --batch 8 --prompt 4096
"""

from __future__ import annotations

import argparse

import torch

from lapse.generation import compiled_decode_one_token, prefill
from lapse.kv import DenseStore
from lapse.models import Decoder, preset


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--arch", nargs="+", default=["fox-pro"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=12, help="kernels listed")
    ap.add_argument("--separate", action="store_true",
                    help="FoX without its fused step (ForgettingAttention._fused_step off)")
    ap.add_argument("--sequence", type=int, default=0,
                    help="also list the first N kernels of one step in launch order (name, us)")
    args = ap.parse_args()
    for arch in args.arch:
        profile(args, arch)


def profile(args, arch: str) -> None:
    torch.manual_seed(0)
    cfg = preset(args.preset, arch, max_seq_len=args.prompt)
    model = Decoder(cfg).cuda().to(torch.bfloat16).eval()
    if args.separate:
        for block in model.blocks:
            block.attn._fused_step = lambda *a, **k: None
    store = DenseStore(cfg.n_layers, capacity=args.prompt + 2 * args.steps + 8)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), device="cuda")
    step = compiled_decode_one_token(mode=None)
    with torch.no_grad(), model.fused_projections(keep=True):
        tok = prefill(model, ids, store).argmax(-1, keepdim=True)
        for _ in range(3):
            tok = step(model, tok, store).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                tok = step(model, tok, store).argmax(-1, keepdim=True)
            torch.cuda.synchronize()
    ka = prof.key_averages()
    total = sum(e.self_device_time_total for e in ka) / args.steps / 1e3
    print(
        f"{arch} {args.batch}x{args.prompt}: device time {total:.3f} ms per step, "
        f"{sum(e.count for e in ka) / args.steps:.0f} kernels per step"
    )
    print(ka.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=90))
    if args.sequence:
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                         key=lambda e: e.time_range.start)
        per_step = len(kernels) // args.steps
        print(f"the first {args.sequence} of a step's {per_step} kernels, in order (us):")
        for e in kernels[per_step:per_step + args.sequence]:  # the second profiled step
            print(f"  {e.time_range.elapsed_us():7.2f}  {e.name[:150]}")


if __name__ == "__main__":
    main()
