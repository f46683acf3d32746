#!/usr/bin/env bash
# On a 2-GPU machine (nvidia-h200-x2): FoX (Pro) 125M + ACP at T=16384 trained for the same
# steps on one GPU and on two with FSDP2 (torchrun), same global batch; prints the two loss
# curves side by side and the throughput ratio. Usage, from the repo root:
#   bash scripts/gpu.sh bash scripts/gpu_fsdp.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT="${OUT:-runs/gpu-fsdp}"
STEPS="${STEPS:-30}"
EXTRA="${EXTRA:-}"
mkdir -p "$OUT"
rm -rf /tmp/one /tmp/two /tmp/ddp  # runs of an earlier call on a still-warm machine (the data cache stays)
nvidia-smi --query-gpu=name --format=csv,noheader
common="--data-dir /tmp/data --batch-size 8 --micro-batch-size 1 --steps $STEPS --warmup-steps 10 --lr 2e-3
        --log-every 5 --val-every 0 --acp-stats-every 0 --checkpoint-every 0 --corpus.max-bytes 100000000
        --no-progress $EXTRA"
echo "== one GPU"
python3 -m lapse.cli train 125m-16k --run-dir /tmp/one $common || exit 1
echo "== two GPUs, FSDP2"
python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m lapse.cli train 125m-16k \
    --run-dir /tmp/two --parallel fsdp $common || exit 1
runs="one two"
for variant in ${FSDP_VARIANTS:-}; do  # e.g. "noreshard:--no-fsdp-reshard-after-forward bf16:--fsdp-param-dtype=bfloat16"
    name="${variant%%:*}"; flags="${variant#*:}"
    echo "== two GPUs, FSDP2 $name ($flags)"
    rm -rf "/tmp/$name"
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m lapse.cli train 125m-16k \
        --run-dir "/tmp/$name" --parallel fsdp $common ${flags//,/ } && runs="$runs $name"
done
if [[ "${DDP:-0}" == 1 ]]; then
    echo "== two GPUs, DDP"
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m lapse.cli train 125m-16k \
        --run-dir /tmp/ddp --parallel ddp $common && runs="one two ddp"
fi
for r in $runs; do mkdir -p "$OUT/$r"; cp /tmp/$r/{metrics.jsonl,report.md,config.json} "$OUT/$r/"; done
python3 - "$OUT" $runs <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def train(run):
    return [json.loads(l) for l in (out / run / "metrics.jsonl").read_text().splitlines()
            if json.loads(l)["kind"] == "train"]
a, b = train("one"), train("two")
for extra in sys.argv[4:]:
    c = train(extra)
    tc = statistics.median(r["tokens_per_s"] for r in c[2:])
    print(f"{extra}: median tokens/s {tc:,.0f}; losses {[round(r['loss'], 4) for r in c]}")
lines = ["| step | loss 1 GPU | loss 2 GPUs FSDP2 | diff | tok/s 1 GPU | tok/s 2 GPUs |", "|---|---|---|---|---|---|"]
for ra, rb in zip(a, b):
    lines.append(f"| {ra['step']} | {ra['loss']:.4f} | {rb['loss']:.4f} | {rb['loss'] - ra['loss']:+.4f} | "
                 f"{ra['tokens_per_s']:,.0f} | {rb['tokens_per_s']:,.0f} |")
# throughput after compilation and warm-up: the intervals past the first two
ta = statistics.median(r["tokens_per_s"] for r in a[2:])
tb = statistics.median(r["tokens_per_s"] for r in b[2:])
lines.append(f"\nmedian tokens/s past the first two intervals: 1 GPU {ta:,.0f}, 2 GPUs {tb:,.0f}, "
             f"ratio {tb / ta:.2f}x; max |loss diff| {max(abs(x['loss'] - y['loss']) for x, y in zip(a, b)):.4f}")
text = "\n".join(lines)
print(text)
(out / "compare.md").write_text(text + "\n")
PY
