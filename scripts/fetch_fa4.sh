#!/usr/bin/env bash
# Prepares, on a machine with a package index, FlashAttention-4 for the lent GPU (Python 3.12,
# torch 2.11+cu130, no index), where one call carries at most 64 MiB with the source tree: its
# CuTe DSL compiler's CUDA 13 wheel alone is 92 MB. So the compiler travels unpacked and
# xz-compressed (66 MB), split in two:
#   .fa4a/part.aa    the first 40,000,000 bytes (one call: `mkdir -p /tmp/fa4parts && cp
#                    .fa4a/part.* /tmp/fa4parts/`, carry .fa4a)
#   .fa4b/part.ab    the rest, its sha256, and the small wheels: flash-attn-4 4.0.0b36,
#                    nvidia-cutlass-dsl{,-libs-base,-libs-core} 4.8.1, apache-tvm-ffi,
#                    torch-c-dlpack-ext, quack-kernels, einops, and tyro with its two needs
#                    (the `lapse` command line) so that this call needs no .whl
# The second call follows the first at once (the machine goes back after 30 s idle) and runs
# scripts/gpu_issue16_s28_fa4.sh, carry .fa4b, which joins the parts, checks the sum and
# installs everything into /tmp/site (BENCHMARKS.md, "Twenty-eighth session").
# Both folders are git-ignored (.git/info/exclude). Takes a minute or two (xz on 227 MB).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for d in .fa4a .fa4b; do
    grep -q "^/$d/" .git/info/exclude 2> /dev/null || echo "/$d/" >> .git/info/exclude
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
get() {  # binary wheels for the GPU's Python and platform, no dependencies
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
rm -rf .fa4a .fa4b
mkdir -p .fa4a .fa4b "$work/cu13"
get .fa4b flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 \
    quack-kernels==0.6.5 einops==0.8.2 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.0
get "$work" nvidia-cutlass-dsl-libs-cu13==4.8.1
python3 -m zipfile -e "$work"/nvidia_cutlass_dsl_libs_cu13-*.whl "$work/cu13"
tar -C "$work/cu13" -cf - . | xz -T0 -6 > "$work/cu13.tar.xz"
(cd "$work" && sha256sum cu13.tar.xz) > .fa4b/cu13.sha256
split -b 40000000 "$work/cu13.tar.xz" "$work/part."
mv "$work/part.aa" .fa4a/
mv "$work"/part.a[b-z] .fa4b/
du -sh .fa4a .fa4b
