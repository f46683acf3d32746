#!/usr/bin/env bash
# The test suite (CPU): set-up, then pytest. pyproject.toml deselects the `gpu` and
# `slow` markers; extra arguments go to pytest (e.g. `bash scripts/test.sh -x tests/bench`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest "$@"
