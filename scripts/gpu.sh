#!/usr/bin/env bash
# Runs a command on the lent GPU from the source tree: installs the carried wheels in
# .whl/ (scripts/fetch_wheels.sh) whose distribution is missing or at another version,
# puts src/ on PYTHONPATH, then runs the command. Examples:
#   bash scripts/gpu.sh python3 -m pytest -m gpu
#   bash scripts/gpu.sh python3 -m lapse.cli bench attention
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
shopt -s nullglob
for wheel in .whl/*.whl; do
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
exec "$@"
