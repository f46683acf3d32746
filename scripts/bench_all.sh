#!/usr/bin/env bash
# Reproduces the tables of BENCHMARKS.md: the `lapse bench` commands (and the trainings some
# of them time) that make each table, one command a line under a comment naming its table.
# Every `lapse bench` command writes results.json and results.md to OUT/<name>/; a command's
# output goes to OUT/<name>.log; one ok / FAIL line is printed per command. Hours of GPU time
# for everything: pick groups with --only.
#
#   bash scripts/bench_all.sh                          every one-GPU group
#   bash scripts/bench_all.sh --only attention,decode  some groups
#   bash scripts/bench_all.sh --list                   the commands, run nothing (works on a CPU)
#   bash scripts/gpu.sh bash scripts/bench_all.sh      a machine without a package index (.whl/;
#                                                      `fetch_wheels.sh --fa4` for FlashAttention-4)
#
# Groups: attention, train, decode, castle, dcp (one GPU; the default), fsdp (two GPUs),
# kvpress (CPU; KVPRESS_PYTHON is a Python with the wheels of `fetch_wheels.sh --kvpress`,
# GGUF the SmolLM2-135M-Instruct GGUF file: docs/study/eviction/kvpress/README.md).
#
# Options:
#   --only G1,G2   these groups
#   --list         print the chosen commands
#   --out DIR      where results and logs go (default runs/bench-all)
#   --commit SHA   the commit `lapse bench` records (a copy of the tree without .git)
# Python is $PYTHON (default python3). The script exits 1 when a command failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
ONLY="attention,train,decode,castle,dcp" LIST=0 OUT=runs/bench-all COMMIT=""
usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while (($#)); do
    case "$1" in
        --only) ONLY="${2:?--only takes groups}"; shift ;;
        --list) LIST=1 ;;
        --out) OUT="${2:?--out takes a folder}"; shift ;;
        --commit) COMMIT="${2:?--commit takes a commit}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "bench_all: unknown option $1 (--help lists them)" >&2; exit 2 ;;
    esac
    shift
done
for g in ${ONLY//,/ }; do
    [[ " attention train decode castle dcp fsdp kvpress " == *" $g "* ]] || { echo "bench_all: no group $g" >&2; exit 2; }
done
L="$PY -m lapse.cli"
O="$OUT"
DCP="$O/dcp-models/runs"
failed=0
# table GROUP NAME COMMAND: runs COMMAND when GROUP is chosen; a `lapse bench` command gets
# --out-dir OUT/NAME (and --commit) appended
table() {
    [[ ",$ONLY," == *",$1,"* ]] || return 0
    local cmd="$3"
    [[ "$cmd" == "$L bench "* ]] && cmd+=" --out-dir $O/$2${COMMIT:+ --commit $COMMIT}"
    if ((LIST)); then echo "$cmd"; return 0; fi
    mkdir -p "$O"
    local t0=$SECONDS
    if (eval "$cmd") > "$O/$2.log" 2>&1; then
        echo "ok    $((SECONDS - t0)) s  $2"
    else
        echo "FAIL  $((SECONDS - t0)) s  $2 (log: $O/$2.log)"; tail -n 5 "$O/$2.log"; failed=1
    fi
}

# The latest figures: D 64, every provider (FlashAttention-4 and cuDNN the baselines), GPU times from CUDA graphs
table attention attention-d64 "$L bench attention --heads 24 --head-dim 64 --graph-times"
# The latest figures: D 128
table attention attention-d128 "$L bench attention --heads 24 --head-dim 128 --graph-times"
# GQA: 24 query heads over 6 key/value heads, D 64
table attention attention-gqa "$L bench attention --heads 24 --kv-heads 6 --head-dim 64 --graph-times"
# varlen: 8 packed sequences, 32768 tokens
table attention attention-varlen "$L bench attention --varlen --heads 24 --head-dim 64"
# The ACP bound from the QK-norm gains (no pass over the data), T 16384
table attention attention-qk-norm "$L bench attention --seq-lens 16384 --acp-bound qk-norm --providers lapse lapse-acp sdpa-default flash-attn-4"
# The op in eager use: eager against CUDA-graph times, and the kernels and host time of each call (profile.md)
table attention attention-eager "$L bench attention --providers lapse lapse-acp --graph-times --profile"

# Training: FoX against the Transformer at 125M and 760M, T 4k and 16k, compiled blocks replayed as CUDA graphs
table train train-125m-4k "$L bench train --preset 125m --arch fox-pro --seq-len 4096 --batch-size 8 --micro-batch-size 4 --steps 4 --warmup 2 --variants dense-cudagraphs acp-cudagraphs transformer-cudagraphs"
table train train-125m-16k "$L bench train --preset 125m --arch fox-pro --seq-len 16384 --batch-size 8 --micro-batch-size 1 --steps 4 --warmup 2 --variants dense-cudagraphs acp-cudagraphs transformer-cudagraphs"
table train train-760m-4k "$L bench train --preset 760m --arch fox-pro --seq-len 4096 --batch-size 8 --micro-batch-size 4 --steps 4 --warmup 2 --variants dense-cudagraphs acp-cudagraphs transformer-cudagraphs"
table train train-760m-16k "$L bench train --preset 760m --arch fox-pro --seq-len 16384 --batch-size 8 --micro-batch-size 1 --steps 4 --warmup 2 --variants dense-cudagraphs acp-cudagraphs transformer-cudagraphs"
# Training without CUDA graphs: compiled blocks launched one by one against replayed as graphs
table train train-125m-4k-graphs "$L bench train --preset 125m --arch fox-pro --seq-len 4096 --batch-size 8 --steps 4 --warmup 2 --variants acp-compile acp-cudagraphs transformer-compile"
table train train-125m-16k-graphs "$L bench train --preset 125m --arch fox-pro --seq-len 16384 --batch-size 8 --steps 4 --warmup 2 --variants acp-compile acp-cudagraphs transformer-compile"

# Two GPUs: one GPU, FSDP2 and DDP on the same global batch (125m-16k, 30 steps), gathered by lapse report
FSDP="--steps 30 --batch-size 8 --micro-batch-size 1 --warmup-steps 10 --lr 2e-3 --log-every 5 --val-every 0 --acp-stats-every 0 --checkpoint-every 0 --corpus.max-bytes 100000000 --data-dir $O/fsdp-data --no-progress"
table fsdp fsdp-one-gpu "$L train 125m-16k --run-dir $O/fsdp-one-gpu/run $FSDP"
table fsdp fsdp-fsdp2 "NCCL_NVLS_ENABLE=0 $PY -m torch.distributed.run --standalone --nproc-per-node 2 -m lapse.cli train 125m-16k --parallel fsdp --run-dir $O/fsdp-fsdp2/run $FSDP"
table fsdp fsdp-ddp "NCCL_NVLS_ENABLE=0 $PY -m torch.distributed.run --standalone --nproc-per-node 2 -m lapse.cli train 125m-16k --parallel ddp --run-dir $O/fsdp-ddp/run $FSDP"
table fsdp fsdp-report "$L report $O/fsdp-one-gpu/run $O/fsdp-fsdp2/run $O/fsdp-ddp/run --out $O/fsdp-report/report.md"

# Decoding: lapse's compiled step against Hugging Face's compiled Llama with a StaticCache
table decode decode-hf "$L bench decode --archs fox-pro transformer-llama --workloads 8x4096 4x16384 2x32768 --providers lapse-compile hf-llama-compile --steps 32"
# Decode grid: batch 1 and 32
table decode decode-grid "$L bench decode --archs fox-pro transformer-llama --workloads 1x4096 32x4096 1x32768 32x32768 --providers lapse-compile hf-llama-compile --steps 32"
# Decoding under each eviction policy at 4 x 32768 (fresh 125M FoX Pro)
table decode decode-policies "$L bench decode --workloads 4x32768 --archs fox-pro --providers lapse-compile --policies acp window h2o a2sf --every 64 --steps 64 --warmup 4"

# CASTLE: the attention op, D 64 and D 128, against SDPA's default backend
table castle castle-attention-d64 "$L bench attention --seq-lens 2048 4096 8192 --tokens 16384 --heads 8 --head-dim 64 --providers sdpa-default castle-triton castle-triton-parallel castle-swl-triton castle-swl-triton-parallel"
table castle castle-attention-d128 "$L bench attention --seq-lens 2048 4096 8192 --tokens 16384 --heads 8 --head-dim 128 --providers sdpa-default castle-triton castle-triton-parallel castle-swl-triton castle-swl-triton-parallel"
# CASTLE: the decode step against the Transformer of the same size
table castle castle-decode "$L bench decode --archs castle castle-swl transformer-llama --workloads 8x4096 --providers lapse-compile"

# DCP: the fine-tuning step against the Transformer's, 125M at context 1024
table dcp dcp-train "$L bench train --preset 125m --arch transformer-llama --seq-len 1024 --batch-size 8 --micro-batch-size 8 --steps 6 --warmup 2 --variants transformer transformer-compile dcp dcp-compile"
# DCP decoding on trained models: a Transformer (LLaMA) base and its DCP fine-tunes at gamma 0.1 and 0.03, context 2048
table dcp dcp-models "SEQ=2048 GAMMAS='0.1 0.03' PRE_BATCH=16 PRE_MINUTES=1.5 FT_STEPS=150 FT_MINUTES=1.75 OUT=$O/dcp-models RUNS=$DCP DATA=$O/dcp-models/data bash scripts/study_dcp.sh"
# DCP decoding: the base over the dense store and the paged store, then each fine-tune under DCPDrop, on validation text
table dcp dcp-decode-base "$L bench decode --run $DCP/base --prompts validation --providers lapse-compile --policies dense --workloads 8x1536 64x1536 256x1536 --steps 256"
table dcp dcp-decode-g0.1 "$L bench decode --run $DCP/dcp-g0.1 --prompts validation --providers --policies dcp --workloads 8x1536 64x1536 256x1536 --steps 256 --every 128"
table dcp dcp-decode-g0.03 "$L bench decode --run $DCP/dcp-g0.03 --prompts validation --providers --policies dcp --workloads 8x1536 64x1536 256x1536 --steps 256 --every 128"

# Eviction on a pretrained model against kvpress, on the CPU: lapse's side, kvpress's side, the table
table kvpress kvpress-lapse "OMP_NUM_THREADS=1 $PY scripts/kvpress_compare.py lapse --out $O/kvpress"
table kvpress kvpress-kvpress "OMP_NUM_THREADS=1 \${KVPRESS_PYTHON:?a Python with kvpress} scripts/kvpress_compare.py kvpress --out $O/kvpress --gguf \${GGUF:?the SmolLM2 GGUF file}"
table kvpress kvpress-table "$PY scripts/kvpress_compare.py table --out $O/kvpress"

exit "$failed"
