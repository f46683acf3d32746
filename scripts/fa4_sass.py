"""FlashAttention-4's Hopper kernels compiled on this machine (no GPU), beside lapse's: how
many instructions each thread issues per tile step, per score, and how the registers are
split between warps (issue 16).

FlashAttention-4 compiles its CuTe DSL kernels under torch's ``FakeTensorMode`` with
``FLASH_ATTENTION_ARCH`` / ``CUTE_DSL_ARCH`` set (its own route to compiling without a GPU);
``CUTE_DSL_KEEP_CUBIN`` keeps the cubin, which Triton's bundled ``nvdisasm`` reads. Install
it for this Python first, outside the project's environment::

    python -m pip install --no-deps --target /tmp/cutedsl flash-attn-4==4.0.0b36 \\
        nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \\
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu12==4.8.1 \\
        "cuda-bindings>=12.8,<13" cuda-pathfinder quack-kernels==0.6.5 einops \\
        apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
    python scripts/fa4_sass.py --site /tmp/cutedsl --head-dim 64

Per kernel it prints the registers (``cuobjdump -res-usage``), the ``setmaxnreg`` values
(a producer warpgroup giving registers to the consumers), and the loops of 20 or more
instructions (a backward branch and its target, disassembly order; FlashAttention-4's
persistent scheduler and its barriers' waits also make long "loops" that span the kernel).
Per score = a loop's instructions x the threads that run it / the scores of its tile.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

import triton

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def _loops(cubin: str, at_least: int = 20) -> list[tuple[int, int, int]]:
    """(instructions, HGMMA, MUFU) of each loop of ``cubin`` of ``at_least`` instructions."""
    import re

    text = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True,
                          text=True, check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2)) for line in text.splitlines()
           if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line))]
    index = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, op) in enumerate(ins):
        if (m := re.search(r"BRA.*?0x([0-9a-f]+)", op)) and (t := int(m.group(1), 16)) < a and t in index:
            body = [x for _, x in ins[index[t]: i + 1]]
            if len(body) >= at_least:
                out.append((len(body), sum("HGMMA" in x for x in body), sum("MUFU" in x for x in body)))
    return out


def _describe(cubin: str) -> str:
    usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                           text=True).stdout
    regs = next((w for line in usage.splitlines() for w in line.split() if w.startswith("REG:")), "REG:?")
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True,
                          text=True).stdout
    maxnreg = [line.split("USETMAXREG")[1].split(";")[0].strip()
               for line in sass.splitlines() if "USETMAXREG" in line]
    loops = ", ".join(f"{n} ({h} HGMMA, {m} MUFU)" for n, h, m in _loops(cubin))
    return f"{regs}; setmaxnreg {maxnreg or 'none'}; loops: {loops}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site", default="/tmp/cutedsl", help="flash-attn-4 and the CuTe DSL's folder")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as dump:  # the CuTe DSL reads its settings at import
        os.environ.update(FLASH_ATTENTION_ARCH="sm_90a", CUTE_DSL_ARCH="sm_90a",
                          FLASH_ATTENTION_NUM_SMS="132", CUTE_DSL_KEEP_PTX="1", CUTE_DSL_KEEP_CUBIN="1",
                          CUTE_DSL_DUMP_DIR=dump)
        sys.path[:0] = [args.site, os.path.join(args.site, "nvidia_cutlass_dsl", "dsl_packages")]
        import torch
        from flash_attn.cute import interface
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():  # shapes and dtypes only: compiles, launches nothing
            q = torch.empty(2, args.seq_len, 8, args.head_dim, dtype=torch.bfloat16, device="cuda")
            k, v, o, do = (torch.empty_like(q) for _ in range(4))
            lse = torch.empty(2, 8, args.seq_len, dtype=torch.float32, device="cuda")
            interface.flash_attn_func(q, k, v, causal=True)
            # the backward called directly: autograd needs a CUDA device guard, which a CPU build lacks
            interface._flash_attn_bwd(q, k, v, o, do, lse, causal=True)
        for cubin in sorted(glob.glob(os.path.join(dump, "*.cubin"))):
            name = os.path.basename(cubin).split("_object_at")[0]
            name = name.removeprefix("cutlass___call___flash_attncute")
            print(f"{name}: {_describe(cubin)}")


if __name__ == "__main__":
    main()
