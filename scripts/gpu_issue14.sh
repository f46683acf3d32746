#!/usr/bin/env bash
# Issue 14's decode target in one GPU call (under 10 minutes): "Decode with DCP at 50%
# dropped: KV bytes at most 55% of dense, tokens/s at least dense", on a DCP model that has
# learnt to drop, decoding text (windows of its validation data, not random tokens).
#
#   1. base:       a transformer-llama at the gpu-20m shapes (5 x 512, 8 heads of 64), byte
#                  tokens, context SEQ, PRE_STEPS of PRE_BATCH x SEQ (PRE_MINUTES at most), on
#                  the Python sources of the machine (as scripts/study_dcp.sh, at SEQ 2048);
#   2. fine-tunes: --init-from the base, --model.attention dcp, whole model, alpha 1 -> 8, one
#                  run per gamma in GAMMAS, concurrently (the DCP study at context 1024: gamma
#                  0.1 dropped 59% of the context on average, 70% at the last position; 0.01
#                  dropped 32% / 39%; 0.03, untried, is a guess at about 50%);
#   3. lapse bench decode --prompts validation at WORKLOADS (B x T, T + the steps within
#                  SEQ): the base over the dense store (lapse-compile: the dense reference)
#                  and over the paged store keeping everything (paged-dense), then each DCP
#                  run over the paged store under DCPDrop (paged-dcp, evicting every EVERY
#                  steps, the evictions timed): ms/step, tokens/s, the KV held against dense;
#   4. lapse eval dcp on the fine-tunes: loss and the share dropped on validation windows
#      (after the first gamma's benchmark, before the others').
#
# Usage, from the repo root (about 8 minutes: data ~30 s, base <= PRE_MINUTES + ~20 s,
# fine-tunes <= FT_MINUTES + ~25 s, benchmarks ~3 min of compiling and timing, eval ~30 s;
# every phase after the training is cut at what is left of BUDGET seconds):
#   bash scripts/gpu.sh bash scripts/gpu_issue14.sh COMMIT   (the tree's commit, if the copy has no .git)
# It leaves in $OUT: summary.json / summary.md (the target's figures per workload and
# gamma), bench-base/ and bench-dcp-g<gamma>/ (results.json, results.md), eval/ (lapse eval
# dcp's report), the logs, and runs.tar.gz (the run folders without checkpoints). Every
# knob below is an environment variable. SMOKE=1 shrinks every size to a CPU dry run of the
# whole pipeline (about 2 minutes on 2 cores, OMP_NUM_THREADS=1):
#   SMOKE=1 OUT=/tmp/issue14-out bash scripts/gpu_issue14.sh
set -euo pipefail
export PYTHONUNBUFFERED=1
if [[ "${SMOKE:-0}" == 1 ]]; then
    : "${PRESET:=cpu-tiny}" "${SEQ:=128}" "${BYTES:=400000}" "${PRE_STEPS:=30}" "${PRE_BATCH:=8}"
    : "${PRE_MINUTES:=1}" "${PRE_EXTRA:=--device cpu --no-compile}" "${FT_STEPS:=6}" "${FT_BATCH:=4}"
    : "${FT_MINUTES:=1}" "${FT_EXTRA:=--device cpu --no-compile --model.dcp-r 16 --model.dcp-beta-init 0.02}"
    : "${WORKLOADS:=2x96 4x96}" "${STEPS:=8}" "${WARMUP:=1}" "${EVERY:=4}" "${NSEQ:=4}"
    : "${BENCH_EXTRA:=--device cpu --dtype float32 --compile-backend aot_eager}" "${EVAL_EXTRA:=--device cpu}"
    : "${OUT:=/tmp/issue14-smoke-out}" "${RUNS:=/tmp/issue14-smoke/runs}" "${DATA:=/tmp/issue14-smoke/data}"
fi
: "${PRESET:=gpu-20m}" "${SEQ:=2048}" "${BYTES:=100000000}" "${MODEL:=--model.vocab-size 512}"
: "${PRE_STEPS:=2500}" "${PRE_BATCH:=16}" "${PRE_LR:=2e-3}" "${PRE_MINUTES:=1.5}" "${PRE_EXTRA:=}"
: "${GAMMAS:=0.1 0.03}"  # the first is benchmarked first
: "${FT_STEPS:=150}" "${FT_BATCH:=8}" "${FT_LR:=5e-4}" "${FT_MINUTES:=1.75}"
: "${FT_EXTRA:=--no-compile}"  # as the study: the DCP mask runs eager anyway
: "${WORKLOADS:=8x1920 64x1920}" "${STEPS:=96}" "${WARMUP:=4}" "${EVERY:=16}" "${BENCH_EXTRA:=}"
: "${NSEQ:=16}" "${EVAL_EXTRA:=}"
: "${OUT:=runs/issue14}" "${RUNS:=/tmp/i14/runs}" "${DATA:=/tmp/i14/data}"
: "${BUDGET:=500}"  # seconds for the whole script
source "$(dirname "${BASH_SOURCE[0]}")/study_lib.sh"
COMMIT="${1:-${COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo unknown)}}"
mkdir -p "$OUT" "$RUNS"
rm -rf "${RUNS:?}"/*
date -u +"start %FT%TZ, commit $COMMIT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null || true

dcp_trainings
pack && mv "$OUT/study.tar.gz" "$OUT/runs.tar.gz"  # the training logs come back even if the rest is cut

bench=(--prompts validation --workloads $WORKLOADS --steps "$STEPS" --warmup "$WARMUP" --every "$EVERY"
       --commit "$COMMIT" $BENCH_EXTRA)
phase "bench decode: the base, dense store and paged store keeping everything"
run $L bench decode --run "$RUNS/base" --providers lapse-compile --policies dense "${bench[@]}" \
    --out-dir "$OUT/bench-base" > "$OUT/bench-base.log" 2>&1
grep -v Warning "$OUT/bench-base.log" | tail -n 8 || true
bench_dcp() {
    local name; name="$(basename "$1")"
    phase "bench decode: $name over the paged store under DCPDrop"
    run $L bench decode --run "$1" --providers --policies dcp "${bench[@]}" --out-dir "$OUT/bench-$name" \
        > "$OUT/bench-$name.log" 2>&1
    grep -v Warning "$OUT/bench-$name.log" | tail -n 6 || true
}
eval_dcp() {
    phase "lapse eval dcp: loss and the share dropped on validation windows of $SEQ"
    run $L eval dcp "${DCP_RUNS[@]}" --base "$RUNS/base" --out-dir "$OUT/eval" --num-sequences "$NSEQ" \
        --snippets 1 --commit "$COMMIT" --command "bash scripts/gpu_issue14.sh" \
        --title "Issue 14 decode: DCP fine-tunes of a Transformer (LLaMA), context $SEQ" $EVAL_EXTRA \
        > "$OUT/eval.log" 2>&1
    tail -n 4 "$OUT/eval.log"
}
bench_dcp "${DCP_RUNS[0]}"
eval_dcp  # cheap, and before the other gammas' benchmarks, which the budget may cut
for r in "${DCP_RUNS[@]:1}"; do bench_dcp "$r"; done

phase "summary"
python3 - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
def load(path):
    return json.loads(path.read_text()) if path.exists() else None

base = load(out / "bench-base" / "results.json")
evals = load(out / "eval" / "results.json")
rows, dense = [], {}
for r in (base or {}).get("rows", []):
    dense[r["workload"]] = r
for path in sorted(out.glob("bench-dcp-*/results.json")):
    run = path.parent.name.removeprefix("bench-")
    for r in load(path)["rows"]:
        d = dense.get(r["workload"], {})
        row = {"run": run, "workload": r["workload"], "batch": r["batch"]}
        row["dense_ms"], row["paged_dense_ms"] = d.get("lapse-compile"), d.get("paged-dense")
        row["dcp_ms"], row["evict_ms"] = r.get("paged-dcp"), r.get("evict-dcp")
        for key in ("dense", "dcp"):
            ms = row[f"{key}_ms"]
            row[f"{key}_tokens_per_s"] = None if ms is None else r["batch"] * 1e3 / ms
        row["kv_share_same_pools"], row["kv_share_vs_softmax"] = r.get("kv-dcp"), r.get("kv-vs-softmax-dcp")
        if row["dense_ms"] and row["dcp_ms"]:
            row["tokens_per_s_vs_dense"] = row["dense_ms"] / row["dcp_ms"]
        rows.append(row)
keys = ("name", "gamma", "steps_done", "steps_planned", "status", "alpha_final", "loss", "ppl", "dropped",
        "dropped_last", "dropped_per_layer")
fits = [{k: e.get(k) for k in keys} for e in (evals or {}).get("runs", [])]
summary = {"env": (base or {}).get("env"), "rows": rows, "eval_dcp": fits}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
fmt = lambda x, f: "" if x is None else format(x, f)
lines = [
    "| run | workload | dense ms/step | dense tok/s | paged, nothing dropped | DCP ms/step (evicting) "
    "| DCP tok/s | vs dense | KV held vs softmax K,V | vs the same pools |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
]
for r in rows:
    lines.append(
        f"| {r['run']} | {r['workload']} | {fmt(r['dense_ms'], '.3f')} | {fmt(r['dense_tokens_per_s'], '.0f')} "
        f"| {fmt(r['paged_dense_ms'], '.3f')} | {fmt(r['dcp_ms'], '.3f')} ({fmt(r['evict_ms'], '.3f')}) | {fmt(r['dcp_tokens_per_s'], '.0f')} "
        f"| {fmt(r.get('tokens_per_s_vs_dense'), '.2f')}x | {fmt(r['kv_share_vs_softmax'], '.1%')} "
        f"| {fmt(r['kv_share_same_pools'], '.1%')} |"
    )
lines += ["", "| run | gamma | steps | alpha at the end | loss | dropped (mean) | at the last position |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
for e in fits:
    lines.append(
        f"| {e['name']} | {e['gamma']} | {e['steps_done']} / {e['steps_planned']} ({e['status']}) "
        f"| {fmt(e['alpha_final'], '.2f')} | {fmt(e['loss'], '.4f')} | {fmt(e['dropped'], '.1%')} "
        f"| {fmt(e['dropped_last'], '.1%')} |"
    )
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
pack && mv "$OUT/study.tar.gz" "$OUT/runs.tar.gz"
phase "done"
ls -la "$OUT"
