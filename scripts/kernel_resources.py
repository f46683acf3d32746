"""Registers, spills, stack and shared memory of lapse's FoX attention kernels as compiled
for a Hopper GPU (sm_90), on this machine: no GPU needed (Triton compiles to PTX, its
bundled ptxas reports the resources).

METHOD.md's "read what costs no device time": a kernel that spills registers to local
memory in its hot loop (``spill stores``/``loads`` below) runs slower than its tiles
promise, whatever the timing says about its configuration.

    python scripts/kernel_resources.py                 # the default configs
    python scripts/kernel_resources.py --sweep          # and the options of tune_fox_fwd.py
    python scripts/kernel_resources.py --gluon          # gluon_fwd.py's options, and its MMA waits
    python scripts/kernel_resources.py --loops          # and each loop's instructions (nvdisasm)
    python scripts/kernel_resources.py --fused          # the fused backward's options, both dQ adds

``serialized`` flags ptxas's warning C7515: it waits for each warpgroup product before the
next (non-product instructions write a product's accumulator inside the pipeline stage),
which a kernel can trigger by an unrelated change. ``--loops`` counts the instructions one
thread issues per step of each loop in the disassembly (innermost first; a masked loop
against the interior one shows what its mask costs).

The integer arguments are marked divisible by 16 (strides, lengths), as Triton
specializes them at a real launch of the issue-2 workload.
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lapse.ops.forgetting import triton_bwd, triton_fwd

PTRS_FWD = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "CHI": "*fp32", "CLO": "*fp32", "BSTART": "*i32",
            "O": "*bf16", "LSE": "*fp32", "CU": "*i32"}
PTRS_BWD = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "LSE": "*fp32",
            "DLSE": "*fp32", "ROWS": "*fp32",
            "CHI": "*fp32", "CLO": "*fp32", "BSTART": "*i32", "BEND": "*i32", "CU": "*i32", "DK": "*bf16",
            "DV": "*bf16", "DQ": "*bf16", "DCC": "*fp32", "DCR": "*fp32", "DQA": "*fp32", "DCRA": "*fp32"}
PTRS_CASTLE = {**{n: "*bf16" for n in ("QC", "KC", "VC", "QU", "KU", "VU", "DO")},
               **{n: "*fp32" for n in ("M2", "ACC", "DEN", "UEND", "LSE2", "DELTA", "DQC", "DKC", "DVC",
                                       "DQU", "DKU", "DVU")}}
FLOATS = ("qk_scale", "scale")


LOOPS = False  # --loops: also each loop's instruction count


def resources(kernel, ptrs: dict, const: dict, warps: int, stages: int, arch: int = 90,
              maxnreg: int | None = None) -> str:
    """``ptxas -v``'s summary of ``kernel`` compiled with ``const`` for sm_``arch`` (registers
    capped at ``maxnreg`` a thread where given)."""
    names = list(inspect.signature(kernel.fn).parameters)
    # a group size the kernel takes as a compile-time constant: 1 (no GQA), unless given;
    # compile-time switches with defaults (BIAS, ROWS4, PAIRS, ...) at their defaults, unless
    # given (left out, they would become run-time arguments and both branches would compile)
    defaults = {x.name: x.default for x in kernel.params
                if x.is_constexpr and x.default is not inspect.Parameter.empty}
    const = {**({"GROUP": 1} if any(x.name == "GROUP" and x.is_constexpr for x in kernel.params) else {}),
             **defaults, **const}
    sig = {n: ptrs.get(n, "constexpr" if n in const else ("fp32" if n in FLOATS else "i32")) for n in names}
    aligned = [i for i, n in enumerate(names)
               if n in ptrs or n.startswith("stride") or n in ("TQ", "TK", "TC", "T")]
    src = ASTSource(fn=kernel, signature=sig, constexprs=const,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg))
    out = f"{_ptxas(k.asm['ptx'], arch)}; shared {k.metadata.shared} B"
    return f"{out}; loops {loop_sizes(k.asm['cubin'])}" if LOOPS else out


def _ptxas(ptx: str, arch: int) -> str:
    """Registers and spills of ``ptx`` by Triton's bundled ``ptxas -v``."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
    lines = [x.split("info    : ")[-1].strip() for x in (out.stdout + out.stderr).splitlines()]
    used = next((x for x in lines if x.startswith("Used")), "?").split(",")[0]
    spill = next((x for x in lines if "spill" in x), "?")
    serial = "; serialized (C7515)" if any("C7515" in x for x in lines) else ""
    return f"{used}; {spill}{serial}"


def loop_sizes(cubin: bytes) -> str:
    """Instructions in each loop of ``cubin`` (a backward branch and its target, in the order
    of the disassembly; loops of 3 or fewer, a barrier's spin, left out)."""
    import re

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout
    addr, labels, pending, branches = [], {}, [], []
    for line in text.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line):
            a = int(m.group(1), 16)
            labels.update((x, a) for x in pending)
            pending = []
            addr.append(a)
            if b := re.search(r"BRA.*?(\.L_x_\d+)", m.group(2)):
                branches.append((a, b.group(1)))
    index = {a: i for i, a in enumerate(addr)}
    sizes = [index[a] - index[labels[t]] + 1 for a, t in branches if labels.get(t, a) < a]
    return " ".join(str(n) for n in sizes if n > 3) or "none"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also the forward options tune_fox_fwd.py times")
    ap.add_argument("--bwd-sweep", action="store_true", help="also dK/dV and dQ tiles, warps and stages")
    ap.add_argument("--castle", action="store_true", help="CASTLE's key-major kernels instead")
    ap.add_argument("--gluon", action="store_true", help="gluon_fwd.py's Hopper forward instead")
    ap.add_argument("--loops", action="store_true", help="also each loop's instructions a step")
    ap.add_argument("--fused", action="store_true", help="the fused backward's options (tune_fox_bwd.py's)")
    args = ap.parse_args()
    global LOOPS
    LOOPS = args.loops
    if args.fused:
        fused()
        return
    if args.castle:
        castle()
        return
    if args.gluon:
        gluon()
        return
    for d in (64, 128):
        for acp in (False, True):
            f = triton_fwd.fwd_config(d, 2, acp)
            kv, q = triton_bwd.bwd_config(d, 1, acp)
            base = dict(D=d, BD=d, G=64, IS_VARLEN=False, USE_ACP=acp, DOT_PREC="tf32")
            # TMA="host" (descriptors made on the host) compiles here as descriptors made by
            # the program: the same loop; the host's need a descriptor type in the signature
            opts = [(f["BM"], f["BN"], f["num_warps"], f["num_stages"], 1 if f.get("TMA") else 0, "default")]
            if args.sweep:
                opts += [(128, bn, w, st, tma, "") for bn in (64, 128) for w in (4, 8) for st in (2, 3)
                         for tma in (False, True) if not (acp and bn > 64)]
            for bm, bn, w, st, tma, tag in opts:
                const = dict(base, BM=bm, BN=bn, USE_TMA=tma, PAIRS=f.get("PAIRS", False),
                             ROW_BIAS=f.get("ROW_BIAS", False), FIXED_MAX=f.get("FIXED_MAX", False),
                             LOOPS=f.get("LOOPS", 0) if tag else 0)
                info = resources(triton_fwd._fwd_kernel, PTRS_FWD, const, w, st, maxnreg=f.get("maxnreg"))
                print(f"fwd D {d} acp {int(acp)} BM {bm} BN {bn} warps {w} stages {st} tma {int(tma)} "
                      f"{tag}: {info}", flush=True)
            kernels = (("dkdv", triton_bwd._bwd_dkdv_kernel, kv), ("dq", triton_bwd._bwd_dq_kernel, q))
            for name, kernel, cfg in kernels:
                opts = [(cfg["BM"], cfg["BN"], cfg["num_warps"], cfg["num_stages"], "default")]
                if args.bwd_sweep:
                    # dK/dV: BM (queries per step) divides the ACP block; dQ: BN does
                    tiles = [(bm, bn) for bm in (16, 32, 64) for bn in (32, 64, 128)] if name == "dkdv" \
                        else [(bm, bn) for bm in (32, 64, 128) for bn in (32, 64)]
                    opts += [(bm, bn, w, st, "") for bm, bn in tiles for w in (4, 8) for st in (2, 3)]
                switches = dict(FUSE_DQ=False, ROWS4=cfg.get("ROWS4", False)) if name == "dkdv" \
                    else dict(PAIRS=cfg.get("PAIRS", False), MAKE_ROWS=cfg.get("MAKE_ROWS", False))
                switches["LOOPS"] = cfg.get("LOOPS", 0)
                for bm, bn, w, st, tag in opts:
                    try:
                        info = resources(kernel, PTRS_BWD, dict(base, BM=bm, BN=bn, **switches), w, st,
                                         maxnreg=cfg.get("maxnreg") if tag else None)
                    except Exception as e:  # noqa: BLE001 - a shape the compiler refuses: say so
                        info = f"{type(e).__name__}: {str(e)[:80]}"
                    print(f"{name} D {d} acp {int(acp)} BM {bm} BN {bn} warps {w} stages {st} {tag}: {info}",
                          flush=True)

def fused() -> None:
    """The fused backward (dK/dV kernel with ``FUSE_DQ``) at ``tune_fox_bwd.py``'s options,
    dQ added a thread an element (1) and by the tensor-memory engine (2, a descriptor over
    ``[B * Tq, HQ * D]`` float32 in the signature)."""
    import torch
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor
    from tune_fox_bwd import FUSED

    x = torch.empty(64, 512, dtype=torch.float32)  # only the descriptor's type matters
    for d in (64, 128):
        for acp in (False, True):
            base = dict(D=d, BD=d, G=64, IS_VARLEN=False, USE_ACP=acp, DOT_PREC="tf32", ROWS4=True,
                        LOOPS=1 if acp else 0)
            for bm, bn, w, st in FUSED[d]:
                if acp and (64 % bm or 64 % bn):
                    continue
                for fuse in (1, 2):
                    ptrs = dict(PTRS_BWD)
                    if fuse == 2:
                        desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, d])
                        ptrs["DQA"] = mangle_type(desc)
                    const = dict(base, BM=bm, BN=bn, FUSE_DQ=fuse)
                    info = resources(triton_bwd._bwd_dkdv_kernel, ptrs, const, w, st)
                    print(f"fused D {d} acp {int(acp)} BM {bm} BN {bn} warps {w} stages {st} FUSE_DQ {fuse}: "
                          f"{info}", flush=True)


def gluon() -> None:
    """``gluon_fwd.py``'s forward at the options ``tune_fox_fwd.py --only-gluon`` times: its
    resources and the ``wgmma.wait_group`` counts in program order (2 and 1 in the loop:
    the next tile's ``Q K^T`` and this tile's ``P V`` stay in flight)."""
    import re

    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from lapse.ops.forgetting import gluon_fwd

    kernel = gluon_fwd._fwd_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    x = torch.empty(64, 512, dtype=torch.bfloat16)  # only the descriptors' types matter

    def desc(rows, d):
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)
        return mangle_type(TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, d], layout))

    for d in (64, 128):
        for bn in (64, 128):
            for warps, split in ((8, False), (4, True)):
                for stages in (2, 3):
                    const = dict(D=d, BM=128, BN=bn, STAGES=stages, SPLIT=split,
                                 COMPUTE_REGS=232 if split else 0, num_warps=warps)
                    types = dict(q_desc=desc(128, d), k_desc=desc(bn, d), v_desc=desc(bn, d), CHI="*fp32",
                                 CLO="*fp32", O="*bf16", LSE="*fp32", qk_scale="fp32")
                    sig = {n: types.get(n, "constexpr" if n in const else "i32") for n in names}
                    aligned = [i for i, n in enumerate(names) if n in ("CHI", "CLO", "O", "LSE", "T", "TC")]
                    src = GluonASTSource(fn=kernel, signature=sig, constexprs=const,
                                         attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
                    tag = f"gluon D {d} BN {bn} warps {warps} split {int(split)} stages {stages}"
                    try:
                        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                           options=dict(num_warps=warps))
                    except Exception as e:  # noqa: BLE001 - a shape the compiler refuses: say so
                        print(f"{tag}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                        continue
                    waits = re.findall(r"wgmma.wait_group.sync.aligned\s+(\d+)", k.asm["ptx"])
                    print(f"{tag}: {_ptxas(k.asm['ptx'], 90)}; shared {k.metadata.shared} B; waits "
                          f"{' '.join(waits)}", flush=True)


def castle() -> None:
    """CASTLE's key-major forward and backward (``ops/castle/triton_parallel.py``) at their
    default options and a few others, D 64 and 128, without and with a window."""
    from lapse.ops.castle import triton_parallel as tp

    for d in (64, 128):
        for window in (False, True):
            base = dict(D=d, BD=d, USE_WINDOW=window, DOT_PREC="tf32")
            for name, kernel, backward in (("fwd", tp._fwd_kernel, False), ("bwd", tp._bwd_kernel, True)):
                cfg = tp.parallel_config(d, False, backward, 512 if window else None)
                opts = [(cfg["BT"], cfg["num_warps"], cfg["num_stages"], "default")]
                opts += [(bt, w, st, "") for bt in (16, 32, 64) for w in (4, 8) for st in (1, 2)]
                for bt, w, st, tag in opts:
                    try:
                        info = resources(kernel, PTRS_CASTLE, dict(base, BT=bt), w, st)
                    except Exception as e:  # noqa: BLE001 - a shape the compiler refuses: say so
                        info = f"{type(e).__name__}: {str(e)[:80]}"
                    print(f"castle {name} D {d} window {int(window)} BT {bt} warps {w} stages {st} "
                          f"{tag}: {info}", flush=True)


if __name__ == "__main__":
    main()
