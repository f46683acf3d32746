#!/usr/bin/env bash
# Downloads, on a machine with a package index, the wheels that the lent GPU (Python 3.12,
# torch 2.11 + Triton 3.6 preinstalled, no index) lacks, into .whl/ (git-ignored; carry it
# to the GPU, where scripts/gpu.sh installs .whl/*.whl, not its subfolders):
#   fla-core   flash-linear-attention's kernels, `fla.ops.forgetting_attn` (needs einops,
#              which the GPU image has). The `flash-linear-attention` wheel itself only adds
#              fla.layers/fla.models and requires transformers>=5.6.2: not carried.
#   tyro (+ docstring-parser, typeguard)  the `lapse` command line.
#
# .whl/kvpress/: the kvpress side of scripts/gpu_kvpress.sh, installed --no-deps only into
# the venv that script makes on the GPU (in front of the image's packages, whose torch it
# uses), never into the image's own environment. About 17 MiB:
#   kvpress 0.5.5          the presses compared (its metadata pins transformers<5.3).
#   transformers 4.57.6    kvpress's range; the image's 5.17 is outside it.
#   huggingface_hub 0.36.2 transformers 4.57 requires <1.0 (checked at import); image: 1.33.
#   tokenizers 0.22.2      transformers 4.57 requires >=0.22,<=0.23.0 (checked at import);
#                          image: 0.23.2. abi3 build (cp39-abi3, manylinux2014 x86_64).
#   datasets 5.0.1, dill 0.4.1, multiprocess 0.70.19 (the py312 build: multiprocess ships
#                          one wheel per Python version)  `import kvpress` imports datasets
#                          (kvpress.presses.duo_attention_press); dill and multiprocess are
#                          datasets' imports that the image lacks (its other ones, pyarrow,
#                          pandas, fsspec, xxhash, httpx, are there).
#   cachetools 5.5.2       imported by kvpress's duo_attention and lukv presses (<6 pinned).
#   fire 0.6.0 (+ termcolor)  imported by kvpress.presses.expected_attention_with_stats;
#                          fire has no wheel on the index: built here from its sdist
#                          (pure Python); it imports termcolor (and six: the image has it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -q '^/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
    fla-core==0.6.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.0
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 -d .whl/kvpress \
    kvpress==0.5.5 transformers==4.57.6 huggingface_hub==0.36.2 tokenizers==0.22.2 \
    datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19 cachetools==5.5.2 termcolor==3.3.0
[[ -f .whl/kvpress/fire-0.6.0-py2.py3-none-any.whl ]] \
    || python3 -m pip wheel --no-deps --no-binary fire -w .whl/kvpress fire==0.6.0
