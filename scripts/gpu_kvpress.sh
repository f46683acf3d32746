#!/usr/bin/env bash
# lapse against kvpress 0.5.5 on the lent GPU, in one device call (issue 15, item 4):
#
#   bash scripts/gpu.sh bash scripts/gpu_kvpress.sh      (the device tool: carry [".whl"])
#
# kvpress 0.5.5 needs transformers < 5.3 and the image has 5.17, so the kvpress side runs in
# a venv made here, in /tmp: no pip of its own (the image's pip installs into it with
# --target), the image's site-packages reached through a .pth file (the image's python3 is
# itself a venv, whose packages --system-site-packages alone would not show), and the
# wheels of .whl/kvpress/ (scripts/fetch_wheels.sh) installed --no-deps in front of them:
# transformers 4.57.6 shadows the image's 5.17. Torch is the image's on both sides.
#
# Then, for each configuration (model shape x prompt length) in order, while the deadline
# allows: the lapse side (the image's python, lapse from src/ as gpu.sh puts it), the
# kvpress side (the venv's python), both on the same random-weight LlamaForCausalLM
# (scripts/kvpress_compare.py --random-llama: timing only, the losses mean nothing), and
# their table. Everything goes under $OUT (the device tool's folder that comes back) or
# ./gpu-kvpress: per configuration windows.json, lapse.json, kvpress.json, table.md and
# both sides' logs; summary.md gathers the tables and is printed at the end.
#
# Settings (environment): SHAPES, PROMPTS, NUM (batch), STEPS, BUDGETS, MODES (lapse's), PREFILL_REPEATS
# (prefills timed alone after each run, kvpress_compare.py --prefill-repeats), DEVICE, DEADLINE
# (seconds after the start past which no configuration starts), STOP (seconds after the
# start at which a running side is killed), KV_VENV, PYTHON (the image's python3). The CPU
# dry run (a venv with httpx, which the image has, standing in for the image's python):
#   python3 -m venv --system-site-packages /tmp/kvimg && /tmp/kvimg/bin/pip install httpx
#   PYTHON=/tmp/kvimg/bin/python PYTHONPATH=src OUT=/tmp/kv-dry DEVICE=cpu SHAPES=tiny \
#       PROMPTS="256 128" NUM=2 STEPS=8 OMP_NUM_THREADS=1 bash scripts/gpu_kvpress.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
SHAPES="${SHAPES:-smollm2-135m llama-1b}"
PROMPTS="${PROMPTS:-4096 512}"
NUM="${NUM:-4}"
STEPS="${STEPS:-64}"
BUDGETS="${BUDGETS:-0.1,0.2,0.5}"
MODES="${MODES:-once,per-step,compiled}"
DEADLINE="${DEADLINE:-420}"
STOP="${STOP:-560}"
VENV="${KV_VENV:-/tmp/kvpress-venv}"
if [[ -z "${OUT:-}" ]]; then
    OUT="$PWD/gpu-kvpress"
    grep -q '^/gpu-kvpress/' .git/info/exclude 2>/dev/null || echo /gpu-kvpress/ >> .git/info/exclude
fi
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1  # no network there
LOG="$OUT/gpu_kvpress.log"
say() { echo "gpu_kvpress [$SECONDS s]: $*" | tee -a "$LOG"; }

# -- the environment --------------------------------------------------------------------------
{
    date -u
    git log -1 --format='commit %h %s' 2>/dev/null || true
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
    "$PY" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__,
"transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
} >> "$LOG" 2>&1
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv --without-pip --system-site-packages "$VENV" || { say "venv failed"; exit 1; }
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PY" -c 'import site, sys; print("\n".join([*site.getsitepackages(), site.getusersitepackages()]))' \
    > "$SITE/zz_image_site.pth"
# the carried wheels that this Python can install (multiprocess is built per Python version)
mapfile -t WHEELS < <("$VENV/bin/python" - .whl/kvpress/*.whl <<'EOF'
import sys
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename
ours = set(sys_tags())
for path in sys.argv[1:]:
    if set(parse_wheel_filename(path.rsplit("/", 1)[-1])[3]) & ours:
        print(path)
    else:
        print(f"gpu_kvpress: skipping {path}: not for this Python", file=sys.stderr)
EOF
)
say "installing ${#WHEELS[@]} wheels into $SITE"
"$PY" -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" "${WHEELS[@]}" >> "$LOG" 2>&1 \
    || { say "pip install failed (see $LOG)"; tail -20 "$LOG"; exit 1; }
KVPY="$VENV/bin/python"
if ! "$KVPY" -c 'import kvpress, transformers, torch, tokenizers, huggingface_hub as h
print("kvpress venv:", "transformers", transformers.__version__, "torch", torch.__version__,
      "tokenizers", tokenizers.__version__, "huggingface_hub", h.__version__, "cuda", torch.cuda.is_available())
assert transformers.__version__ == "4.57.6", "the image transformers is not shadowed"' 2>&1 | tee -a "$LOG"
then
    say "the kvpress venv does not import"
    exit 1
fi

# -- the runs ------------------------------------------------------------------------------------
COMMON=(--device "$DEVICE" --num "$NUM" --steps "$STEPS" --budgets "$BUDGETS" --prefill-repeats "${PREFILL_REPEATS:-0}")
SUMMARY="$OUT/summary.md"
echo "# lapse and kvpress on $DEVICE (scripts/gpu_kvpress.sh)" > "$SUMMARY"
left() { local s=$((STOP - SECONDS)); echo $((s > 240 ? 240 : s < 1 ? 1 : s)); }  # a side's timeout
for prompt in $PROMPTS; do
    for shape in $SHAPES; do
        # order: every shape at the first prompt length before any at the next
        dir="$OUT/$shape-p$prompt"
        if ((SECONDS > DEADLINE)); then
            say "skipping $shape at $prompt: past the deadline ($DEADLINE s)"
            echo -e "\n## $shape, prompt $prompt: skipped (deadline)" >> "$SUMMARY"
            continue
        fi
        mkdir -p "$dir"
        say "$shape, prompt $prompt: lapse side"
        timeout "$(left)" "$PY" scripts/kvpress_compare.py lapse --out "$dir" --random-llama "$shape" \
            --prompt "$prompt" "${COMMON[@]}" --lapse-methods window,h2o --modes "$MODES" \
            > "$dir/lapse.log" 2>&1 || say "lapse side failed or cut off (rc $?): $(tail -1 "$dir/lapse.log")"
        if [[ -f "$dir/windows.json" ]] && (( $(left) > 10 )); then
            say "$shape, prompt $prompt: kvpress side"
            timeout "$(left)" "$KVPY" scripts/kvpress_compare.py kvpress --out "$dir" --random-llama "$shape" \
                "${COMMON[@]}" --presses StreamingLLM,SnapKV,ObservedAttention \
                > "$dir/kvpress.log" 2>&1 || say "kvpress side failed or cut off (rc $?): $(tail -1 "$dir/kvpress.log")"
        else
            say "$shape, prompt $prompt: kvpress side skipped (no windows.json, or no time left)"
        fi
        echo -e "\n## $shape, prompt $prompt\n" >> "$SUMMARY"
        if [[ -f "$dir/lapse.json" && -f "$dir/kvpress.json" ]] \
            && "$PY" scripts/kvpress_compare.py table --out "$dir" > "$dir/table.log" 2>&1; then
            tail -n +3 "$dir/table.md" >> "$SUMMARY"
        else
            echo "no table: see $shape-p$prompt/*.log" >> "$SUMMARY"
        fi
    done
done
say "done"
cat "$SUMMARY"
