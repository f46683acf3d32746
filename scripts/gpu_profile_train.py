"""On the GPU: where one training step of a model goes (torch.profiler, CUDA time by op).

python3 scripts/gpu_profile_train.py --preset 125m --arch fox-pro --seq-len 16384 [--compile] [--acp]
"""

import argparse
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from lapse.models import Decoder, optimizer_groups, preset
from lapse.models.decoder import prepare_blocks
from lapse.ops.forgetting import set_value_checks
from lapse.train.trainer import train_step

parser = argparse.ArgumentParser()
parser.add_argument("--preset", default="125m")
parser.add_argument("--arch", default="fox-pro")
parser.add_argument("--seq-len", type=int, default=16384)
parser.add_argument("--rows", type=int, default=1)
parser.add_argument("--compile", action="store_true")
parser.add_argument("--top", type=int, default=30)
parser.add_argument("--acp", action="store_true", help="FoX with adaptive computation pruning")
args = parser.parse_args()

set_value_checks(False)
device = torch.device("cuda")
model = Decoder(replace(preset(args.preset, args.arch, max_seq_len=args.seq_len), acp=args.acp)).to(device)
prepare_blocks(model, compile=args.compile)  # as the trainer and lapse bench train do
opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-4, fused=True)
ids = torch.randint(0, model.config.vocab_size, (args.rows, args.seq_len + 1))
x, y = ids[:, :-1], ids[:, 1:]
for _ in range(3):
    train_step(model, opt, x, y, 1, device, torch.bfloat16, 1.0)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    train_step(model, opt, x, y, 1, device, torch.bfloat16, 1.0)
    torch.cuda.synchronize()
print(f"== {args.arch} {args.preset} T={args.seq_len} rows={args.rows} compile={args.compile} acp={args.acp}")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
