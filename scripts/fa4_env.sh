# Sourced by the GPU scripts that use FlashAttention-4 (issue 16): installs it into /tmp/site
# from the two carried parts (an earlier call on the same warm machine left the first in
# /tmp/fa4parts; this call carries .fa4b/, made here by scripts/fetch_fa4.sh), once a machine,
# and sets PYTHONPATH and its compile cache.
mkdir -p /tmp/fa4parts
if [[ ! -d /tmp/site/flash_attn ]]; then
    cp .fa4b/part.* /tmp/fa4parts/ 2> /dev/null
    [[ -d .fa4a ]] && cp .fa4a/part.* /tmp/fa4parts/
    cat /tmp/fa4parts/part.* > /tmp/cu13.tar.xz
    echo "$(cut -d' ' -f1 .fa4b/cu13.sha256)  /tmp/cu13.tar.xz" | sha256sum -c || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .fa4b/*.whl || exit 1
    tar xJf /tmp/cu13.tar.xz -C /tmp/site || exit 1
fi
# the .pth of nvidia-cutlass-dsl, which PYTHONPATH does not read, puts its dsl_packages on the path
export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/src"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
