#!/usr/bin/env bash
# Installs lapse (editable, from this clone) with its test tools on a Python 3.11 machine.
#
# torch is installed first and pinned: `torch==2.13.0` is the CPU build these machines
# get; an unpinned resolve would pull several GB of CUDA packages. Then the package with
# its `test` extra (pytest, hypothesis, triton 3.6.0 for the kernel interpreter tests, the
# serve extra's uvicorn, starlette, prometheus-client, pydantic and the openai client).
# Idempotent: when everything is already in place it returns in about a second.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
TRITON_VERSION="3.6.0"

installed() {
    "$PY" - "$TORCH_VERSION" "$TRITON_VERSION" "$PWD/src" <<'PYEOF' 2>/dev/null
import importlib.metadata as md
import pathlib
import sys

torch_v, triton_v, src = sys.argv[1:]
assert md.version("torch").split("+")[0] == torch_v
assert md.version("triton") == triton_v
for dist in ("tyro", "tqdm", "numpy", "tokenizers", "safetensors", "matplotlib", "transformers",
             "pytest", "hypothesis", "lm_eval", "import-linter",
             "uvicorn", "starlette", "prometheus-client", "pydantic", "openai"):
    md.version(dist)
# Triton 3.6's interpreter needs numpy < 2.4 (pyproject.toml, test extra)
assert tuple(int(x) for x in md.version("numpy").split(".")[:2]) < (2, 4)
import lapse  # noqa: E402

# the editable install must point at this clone, not another checkout
assert pathlib.Path(lapse.__file__).resolve().is_relative_to(pathlib.Path(src).resolve())
PYEOF
}

if installed; then
    echo "setup: lapse, torch $TORCH_VERSION and the test tools are already installed"
    exit 0
fi
"$PY" -m pip install "torch==$TORCH_VERSION"
"$PY" -m pip install -e ".[test]"
installed || { echo "setup: installation finished but the check failed" >&2; exit 1; }
echo "setup: done"
