#!/usr/bin/env bash
# Downloads, on a machine with a package index, the pure-Python wheels that the lent GPU
# (Python 3.12, torch 2.11 + Triton 3.6 preinstalled, no index) lacks, into .whl/
# (git-ignored; carry it to the GPU, where scripts/gpu.sh installs it):
#   fla-core   flash-linear-attention's kernels, `fla.ops.forgetting_attn` (needs einops,
#              which the GPU image has). The `flash-linear-attention` wheel itself only adds
#              fla.layers/fla.models and requires transformers>=5.6.2: not carried.
#   tyro (+ docstring-parser, typeguard)  the `lapse` command line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -q '^/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
    fla-core==0.6.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.0
