#!/usr/bin/env bash
# Runs a command from this source tree on a GPU machine without a package index: installs
# the wheels of .whl/ (fetched by scripts/fetch_wheels.sh on a networked machine) whose
# distribution is missing or at another version, puts src/ first on PYTHONPATH, then runs
# the command. The machine needs Python with pip, torch and Triton; lapse itself is not
# installed. Examples:
#   bash scripts/gpu.sh python3 -m pytest -m gpu
#   bash scripts/gpu.sh python3 -m lapse.cli bench attention
#   bash scripts/gpu.sh bash scripts/bench_all.sh --only attention
#
# Wheels cut into parts (fetch_wheels.sh --split, for transfers of limited size): the parts
# under .whl-parts/*/ are collected in LAPSE_WHEEL_PARTS (default /tmp/lapse-wheel-parts, so
# on the machine they outlive the call); a wheel whose parts have all arrived is joined there,
# its SHA-256 checked, and installed like the others. `bash scripts/gpu.sh true` stages a part
# and installs nothing else. FlashAttention-4's compile cache goes to LAPSE_FA4_CACHE (default
# /tmp/lapse-fa4-cache) unless FLASH_ATTENTION_CUTE_DSL_CACHE_DIR is set.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
PARTS="${LAPSE_WHEEL_PARTS:-/tmp/lapse-wheel-parts}"
shopt -s nullglob
joined=()
if compgen -G ".whl-parts/*/*.part-*" > /dev/null; then
    mkdir -p "$PARTS"
    for dir in .whl-parts/*/; do cp "$dir"* "$PARTS/"; done
fi
for manifest in "$PARTS"/*.sha256; do
    read -r sum name count < "$manifest"
    parts=("$PARTS/$name".part-*)
    if ((${#parts[@]} < count)); then
        echo "gpu.sh: $name: ${#parts[@]} of $count parts here; carry the others"
        continue
    fi
    if [[ ! -f "$PARTS/$name" ]]; then
        cat "${parts[@]}" > "$PARTS/$name.tmp"
        echo "$sum  $PARTS/$name.tmp" | sha256sum --check --quiet || { echo "gpu.sh: $name: bad sum"; exit 1; }
        mv "$PARTS/$name.tmp" "$PARTS/$name"
    fi
    joined+=("$PARTS/$name")
done
for wheel in .whl/*.whl "${joined[@]}"; do
    file="$(basename "$wheel")"
    dist="${file%%-*}"
    version="$(echo "$file" | cut -d- -f2)"
    have="$("$PY" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print("")' "$dist")"
    if [[ "$have" != "$version" ]]; then
        echo "gpu.sh: installing $file (found: ${have:-none})"
        "$PY" -m pip install --quiet --no-index --no-deps "$wheel"
    fi
done
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-}" ]]; then  # each process would compile again
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="${LAPSE_FA4_CACHE:-/tmp/lapse-fa4-cache}"
fi
exec "$@"
