#!/usr/bin/env bash
# Downloads, on a machine with a package index, the wheels that a GPU machine without one
# lacks, into .whl/ (git-ignored); carry .whl/ to the GPU machine, where scripts/gpu.sh
# installs .whl/*.whl. The GPU machine is assumed to have torch and Triton already.
#
#   bash scripts/fetch_wheels.sh                        fla-core and tyro (below)
#   bash scripts/fetch_wheels.sh --fa4                  also FlashAttention-4 and its compiler
#   bash scripts/fetch_wheels.sh --fa4 --python 3.12    for a GPU machine whose Python is 3.12
#   bash scripts/fetch_wheels.sh --kvpress              also .whl/kvpress/ (the kvpress comparison)
#   bash scripts/fetch_wheels.sh --serve                also lapse serve's packages and the openai client
#   bash scripts/fetch_wheels.sh --fa4 --split 40       parts of at most 40 MB (see --split)
#
# Options:
#   --python X.Y   the GPU machine's Python (default: this one's); binary wheels are fetched
#                  for it, CPython, manylinux on this machine's architecture
#   --fa4          FlashAttention-4 (`flash-attn-4`, the `flash-attn-4` and `flash-attn-4-acp`
#                  providers of `lapse bench attention`, and the FoX backward on its Hopper
#                  kernel, lapse/ops/forgetting/fa4_bwd.py) with the CuTe DSL compiler it needs
#                  (nvidia-cutlass-dsl, its CUDA 13 libraries alone about 92 MB) and their needs
#   --serve        uvicorn, starlette, prometheus-client, pydantic and the openai client (the
#                  `serve-h2o` item of scripts/gpu_check.sh), with what they need, about 6 MB
#   --kvpress      .whl/kvpress/: kvpress and the transformers range it pins, installed into a
#                  venv of their own, never beside lapse (docs/study/eviction/kvpress/README.md)
#   --split MB     for a transfer that carries at most so much: every wheel in .whl/ larger
#                  than MB megabytes is cut into parts of MB, one a folder (.whl-parts/1/,
#                  .whl-parts/2/, ...), each with the wheel's SHA-256 and part count, and
#                  taken out of .whl/. Carry each folder in a transfer of its own to the same
#                  machine: scripts/gpu.sh collects the parts there (LAPSE_WHEEL_PARTS, default
#                  /tmp/lapse-wheel-parts) and installs the wheel once all have arrived.
#
# What --kvpress fetches, and why (kvpress 0.5.5 pins transformers < 5.3):
#   kvpress 0.5.5, transformers 4.57.6, huggingface_hub 0.36.2 (transformers 4.57 checks < 1.0),
#   tokenizers 0.22.2 (>= 0.22, <= 0.23.0), datasets 5.0.1 with dill and multiprocess (`import
#   kvpress` imports datasets), cachetools 5.5.2 and fire 0.6.0 + termcolor (imported by some
#   presses; fire has no wheel on the index and is built here from its pure-Python sdist).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
PYV="$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
FA4=0 KVPRESS=0 SERVE=0 SPLIT=""
while (($#)); do
    case "$1" in
        --python) PYV="${2:?--python takes X.Y}"; shift ;;
        --fa4) FA4=1 ;;
        --kvpress) KVPRESS=1 ;;
        --serve) SERVE=1 ;;
        --split) SPLIT="${2:-}"; [[ "$SPLIT" =~ ^[1-9][0-9]*$ ]] || { echo "--split takes megabytes" >&2; exit 2; }
                 shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "fetch_wheels: unknown option $1 (--help lists them)" >&2; exit 2 ;;
    esac
    shift
done
for d in .whl .whl-parts; do
    grep -q "^/$d/" .git/info/exclude 2> /dev/null || echo "/$d/" >> .git/info/exclude
done
ARCH="$(uname -m)"
get() {  # binary wheels for the GPU machine's Python and platform, no dependencies: get DIR SPEC...
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYV" \
        --implementation cp --platform "manylinux_2_28_$ARCH" --platform "manylinux_2_27_$ARCH" \
        --platform "manylinux_2_24_$ARCH" --platform "manylinux_2_17_$ARCH" \
        --platform "manylinux2014_$ARCH" -d "$1" "${@:2}"
}
# fla-core: flash-linear-attention's kernels (`fla.ops.forgetting_attn`, the `fla` provider;
# needs einops). The `flash-linear-attention` wheel only adds fla.layers and fla.models.
# tyro (+ docstring-parser, typeguard): the `lapse` command line.
get .whl fla-core==0.6.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.0
if ((FA4)); then
    get .whl flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
        apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5 einops==0.8.2
fi
if ((SERVE)); then
    get .whl uvicorn==0.54.0 click==8.5.1 h11==0.16.0 starlette==1.10.0 anyio==4.16.0 sniffio==1.3.1 \
        idna==3.20 typing-extensions==4.16.0 prometheus-client==0.26.0 pydantic==2.13.4 \
        pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 openai==3.57.0 \
        httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
fi
if ((KVPRESS)); then
    get .whl/kvpress kvpress==0.5.5 transformers==4.57.6 huggingface_hub==0.36.2 tokenizers==0.22.2 \
        datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19 cachetools==5.5.2 termcolor==3.3.0
    [[ -f .whl/kvpress/fire-0.6.0-py2.py3-none-any.whl ]] \
        || python3 -m pip wheel --quiet --no-deps --no-binary fire -w .whl/kvpress fire==0.6.0
fi
if [[ -n "$SPLIT" ]]; then
    bytes=$((SPLIT * 1000000))
    rm -rf .whl-parts
    for wheel in .whl/*.whl; do
        (($(stat -c %s "$wheel") > bytes)) || continue
        name="$(basename "$wheel")"
        sum="$(sha256sum "$wheel" | cut -d' ' -f1)"
        work="$(mktemp -d)"
        split -b "$bytes" -d -a 2 "$wheel" "$work/$name.part-"
        parts=("$work/$name".part-*)
        for i in "${!parts[@]}"; do
            mkdir -p ".whl-parts/$((i + 1))"
            mv "${parts[$i]}" ".whl-parts/$((i + 1))/"
            echo "$sum $name ${#parts[@]}" > ".whl-parts/$((i + 1))/$name.sha256"
        done
        rmdir "$work"
        rm "$wheel"
        echo "fetch_wheels: $name in ${#parts[@]} parts under .whl-parts/"
    done
fi
du -sh .whl .whl-parts 2> /dev/null || true
