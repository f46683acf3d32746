"""FoX on FlashAttention-4's Hopper forward: what does the gate cost there? Issue 16, twenty-ninth
and thirtieth sessions (an experiment; BENCHMARKS.md, "Twenty-ninth session", "Thirtieth session").

FlashAttention-4's ``FlashAttentionForwardSm90`` applies a ``score_mod`` to each score tile
through ``apply_score_mod``; with its generic path (per-element indices, divisions, loads) FoX
took 2.9-3.0x lapse's forward (``flex-flash``, twenty-eighth session). Here a subclass overrides
that method with the FoX bias made the cheap way, and the rest of the kernel (warp-specialised
TMA loads, consumer warpgroups, intra-warpgroup overlap) is FlashAttention-4's own:

- the row term is left out: a row's constant cancels in its softmax. Each query tile uses
  ``c_ref``, the gate sum at its last row, and the lse gets ``c_i - c_ref`` back on the host;
- the column term of key ``j`` is ``c_ref - c_j = (c_ref - c_kref) + (c_kref - c_j)``, with
  ``c_kref`` the gate sum at the last key of ``j``'s key tile: the first part is one number a
  tile (from the double-float ``c_hi, c_lo``), the second ``d_j``, made once on the host in
  float64 and stored in float32 (small: the decay within one tile), padded to whole key tiles
  so the loads need no clamp;
- a column costs a load and an add, a score a multiply-add (``s * scale + bias_j``).

The backward is lapse's own on FlashAttention-4's backward kernel (``lapse/ops/forgetting/
fa4_bwd.py``, which grew out of this script: the twenty-ninth session's variants with the query
sums made by shuffles, or left out, are in its tree, 3f8f324, and the thirtieth's at a10801d).
Equal query and key lengths, one key head per query head, no packing.

    python scripts/fa4_fox.py --out $OUT/fa4-fox.json             # on the GPU, with FlashAttention-4
    python scripts/fa4_fox.py --compile-only --site /tmp/cutedsl  # here: sm_90a compiles, loop counts
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys


def build(site: str | None):
    """Imports FlashAttention-4 and returns ``(interface, fox_forward)``."""
    if site:
        sys.path[:0] = [site, os.path.join(site, "nvidia_cutlass_dsl", "dsl_packages")]
    import cutlass
    import cutlass.cute as cute
    import torch
    from flash_attn.cute import interface
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from quack import layout_utils

    # the CuTe DSL compiles the methods from their source, and looks their names up in this module
    globals().update(cutlass=cutlass, cute=cute, layout_utils=layout_utils)

    class FoxForwardSm90(FlashAttentionForwardSm90):
        @cute.jit
        def apply_score_mod(self, thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block, softmax_scale,
                            seqlen, aux_data=None, fastdiv_mods=None):
            m_d, m_chi, m_clo = aux_data.tensors
            last_q = cutlass.min(m_block * self.tile_m + self.tile_m - 1, seqlen.seqlen_q - 1)
            last_k = cutlass.min(n_block * self.tile_n + self.tile_n - 1, seqlen.seqlen_k - 1)
            tile_bias = ((m_chi[batch_idx, head_idx, last_q] - m_chi[batch_idx, head_idx, last_k])
                         + (m_clo[batch_idx, head_idx, last_q] - m_clo[batch_idx, head_idx, last_k]))
            acc_mn = layout_utils.reshape_acc_to_mn(acc_S)
            cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
            t_mn = layout_utils.reshape_acc_to_mn(thr_mma_qk.partition_C(cS))
            t0_mn = layout_utils.reshape_acc_to_mn(thr_mma_qk.get_slice(0).partition_C(cS))
            # this thread's columns of d, from a pointer made once: each load then takes a constant offset
            g_d = cute.domain_offset((n_block * self.tile_n + t_mn[0][1],), m_d[batch_idx, head_idx, None])
            # the next key tile's lines into L1 (n_block - 1: the loop walks down the keys)
            if cutlass.const_expr(self.score_mod is marker):
                for line in cutlass.range_constexpr(self.tile_n // 32):
                    cute.arch.prefetch((g_d.iterator + (32 * line - self.tile_n)).llvm_ptr, cache_level="L1")
            for c in cutlass.range(cute.size(acc_mn.shape[1]), unroll_full=True):
                bias = tile_bias
                if cutlass.const_expr(self.score_mod is not no_loads):
                    bias = tile_bias + g_d[t0_mn[0, c][1]]
                for r in cutlass.range(cute.size(acc_mn.shape[0]), unroll_full=True):
                    acc_mn[r, c] = acc_mn[r, c] * softmax_scale + bias

    interface.FlashAttentionForwardSm90 = FoxForwardSm90  # the interface builds its kernel from this name


    @cute.jit
    def marker(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):  # never called: it selects the path
        return scores

    @cute.jit
    def no_prefetch(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):  # the same, without the prefetch
        return scores + 0.0

    @cute.jit
    def no_loads(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):  # timing only: no column term
        return scores + 1.0

    # read by apply_score_mod as it compiles
    globals().update(marker=marker, no_prefetch=no_prefetch, no_loads=no_loads)

    def tiles(d: int) -> tuple[int, int]:
        cfg = interface._tile_size_fwd_sm90(d, d, True, False)
        return cfg.m_block_size, cfg.n_block_size

    def prepare(log_fgate, d):
        """``aux = [d, c_hi, c_lo]`` for the kernel, what its lse lacks (``c_i - c_ref``), and ``c``
        (float64 ``[B, H, T]``)."""
        b, t, h = log_fgate.shape
        tm, tn = tiles(d)
        c = torch.cumsum(log_fgate.double().clamp_min(-1000.0), dim=1).transpose(1, 2)  # [B, H, T] float64
        c_hi = c.float()
        c_lo = (c - c_hi.double()).float()
        t_pad = -(-t // tn) * tn
        kref = torch.clamp(torch.arange(t_pad, device=c.device) // tn * tn + tn - 1, max=t - 1)
        d_col = torch.zeros(b, h, t_pad, dtype=torch.float64, device=c.device)
        d_col[..., :t] = c[..., kref[:t]] - c
        aux = [d_col.float().contiguous(), c_hi.contiguous(), c_lo.contiguous()]
        return aux, _ref_shift(c, tm), c

    def _ref_shift(c, tm):
        """``c_i - c_ref``: ``c_ref`` the gate sum at the last row of query ``i``'s tile of ``tm``."""
        t = c.shape[-1]
        qref = torch.clamp(torch.arange(t, device=c.device) // tm * tm + tm - 1, max=t - 1)
        return (c - c[..., qref]).float()

    def fox_forward(q, k, v, log_fgate, scale):
        """``q, k, v [B, T, H, D]`` bf16, ``log_fgate [B, T, H]`` float32: ``(o, lse)``, the lse
        natural-log ``[B, H, T]``, as lapse's op returns them."""
        aux, shift, _ = prepare(log_fgate, q.shape[-1])
        o, lse = fox_call(q, k, v, aux, scale)
        return o, lse + shift

    def fox_call(q, k, v, aux, scale, variant=None):
        """The kernel alone, on ``aux = [d, c_hi, c_lo]``: ``(o, lse less c_i - c_ref)``. ``variant``:
        ``"no prefetch"``, or ``"no loads"`` (for timing: the tile's term only, no column loads)."""
        mod = {None: marker, "no prefetch": no_prefetch, "no loads": no_loads}[variant]
        o, lse, *_ = interface._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True,
                                               score_mod=mod, aux_tensors=aux)
        return o, lse

    def fox_forward_backward(q, k, v, log_fgate, scale, do):
        """This forward, then lapse's backward on FlashAttention-4's kernel (fa4_bwd.py): ``(o, dq, dk,
        dv, d log f)`` (the gate's gradient ``[B, T, H]``)."""
        from lapse.ops.backend import LN2
        from lapse.ops.forgetting import fa4_bwd
        from lapse.ops.forgetting.common import LOG_GATE_FLOOR, validate
        from lapse.ops.forgetting.gate_scan import gate_grad
        from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

        aux, shift, _ = prepare(log_fgate, q.shape[-1])
        o, lse = fox_call(q, k, v, aux, scale)
        p = validate(q, k, v, log_fgate, scale, None, "triton")
        c_hi, c_lo = triton_gate_cumsum(log_fgate, p)
        dq, dk, dv, dcc, dcr = fa4_bwd.backward(q, k, v, o, do, (lse + shift) / LN2, None, c_hi, c_lo, p)
        return o, dq, dk, dv, gate_grad(dcc, dcr, log_fgate, p, LOG_GATE_FLOOR)

    fox_forward.forward_backward = fox_forward_backward
    fox_forward.call = fox_call
    fox_forward.prepare = prepare
    return interface, fox_forward


def _compile_only(site: str, dims: list[int]) -> None:
    """Compiles FlashAttention-4's forward and this one for sm_90a (no GPU) and prints each cubin's
    registers and loops (``fa4_sass.py``'s reading: instructions, HGMMA, MUFU a loop)."""
    import glob
    import tempfile

    dump = tempfile.mkdtemp()
    os.environ.update(FLASH_ATTENTION_ARCH="sm_90a", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
                      CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_DUMP_DIR=dump)
    interface, fox_forward = build(site)
    import torch
    from fa4_sass import _describe
    from torch._subclasses.fake_tensor import FakeTensorMode

    for d in dims:
        for fox in (False, True):
            before = {f: os.path.getmtime(f) for f in glob.glob(os.path.join(dump, "*.cubin"))}
            scale = 1 / math.sqrt(d)
            with FakeTensorMode():
                q = torch.empty(2, 4096, 8, d, dtype=torch.bfloat16, device="cuda")
                k, v = torch.empty_like(q), torch.empty_like(q)
                lse = torch.empty(2, 8, 4096, dtype=torch.float32, device="cuda")
                if fox:
                    aux = [torch.empty(2, 8, 4096, dtype=torch.float32, device="cuda") for _ in range(5)]
                    for variant in (None, "no prefetch", "no loads"):
                        fox_forward.call(q, k, v, aux[:3], scale, variant=variant)
                else:
                    interface._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True)
                    interface._flash_attn_bwd(q, k, v, q, q, lse, softmax_scale=scale, causal=True)
            new = [f for f in sorted(glob.glob(os.path.join(dump, "*.cubin")))
                   if before.get(f) != os.path.getmtime(f)]
            for i, cubin in enumerate(new):
                name = os.path.basename(cubin).split("_object_at")[0].removeprefix("cutlass___call___")[:60]
                print(f"D {d} {'fa4-fox' if fox else 'flash-attn-4'} {name}: {_describe(cubin)}", flush=True)
                if os.environ.get("FOX_SASS_DIR"):
                    import shutil

                    shutil.copy(cubin, os.path.join(os.environ["FOX_SASS_DIR"], f"d{d}-{int(fox)}-{i}.cubin"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--site", default=None, help="where flash-attn-4 and the CuTe DSL are, if not importable")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--dims", nargs="*", type=int, default=[128, 64])
    ap.add_argument("--seq-lens", nargs="*", type=int, default=[4096, 8192, 16384])
    a = ap.parse_args()
    if a.compile_only:
        _compile_only(a.site, a.dims)
        return
    run(a)


def run(a) -> None:
    from lapse.bench import attention as bench
    from lapse.ops.forgetting import set_value_checks

    interface, fox_forward = build(a.site)
    set_value_checks(False)
    cfg = bench.AttentionBenchConfig()
    res: dict = {"env": bench.environment(), "check": [], "timing": []}

    def save():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)

    for d in a.dims:  # a head dim's errors against float64 (beside lapse's kernels), then its times
        for t in (1000, 4096):
            res["check"].append(_check_one(d, t, fox_forward))
            print(json.dumps(res["check"][-1]), flush=True)
            save()
            bench._free()
        for t in a.seq_lens:
            res["timing"].append(_time_one(d, t, interface, fox_forward, cfg))
            print(json.dumps(res["timing"][-1]), flush=True)
            save()


def _check_one(d: int, t: int, fox_forward) -> dict:
    """Errors against the float64 reference (largest difference over the reference's largest
    magnitude; the lse's largest difference), FoX on FlashAttention-4 beside lapse's kernels."""
    import torch

    from lapse.bench.workloads import WorkloadSpec, make_workload
    from lapse.ops.forgetting import fa4_bwd, forgetting_attention, naive_forgetting_attention

    wl = make_workload(WorkloadSpec(seq_len=t, tokens=2 * t, heads=8, kv_heads=8, head_dim=d), device="cuda")
    scale = 1 / math.sqrt(d)
    do = torch.randn_like(wl.q)
    ref_in = [x.detach().double().requires_grad_() for x in (wl.q, wl.k, wl.v, wl.log_fgate)]
    o_ref, lse_ref = naive_forgetting_attention(*ref_in, scale)
    want = [o_ref.detach(), *torch.autograd.grad(o_ref, ref_in, do.double())]
    names = ("o", "dq", "dk", "dv", "dlogf")

    def errs(got):
        return {n: float((g.double() - w).abs().max() / w.abs().max()) for n, g, w in zip(names, got, want,
                                                                                        strict=True)}

    row: dict = {"D": d, "T": t}
    _, lse = fox_forward(wl.q, wl.k, wl.v, wl.log_fgate, scale)
    row["fa4-fox"] = errs(fox_forward.forward_backward(wl.q, wl.k, wl.v, wl.log_fgate, scale, do))
    row["fa4-fox"]["lse"] = float((lse.detach() - lse_ref.detach()).abs().max())
    for name, on in (("lapse, backward on FlashAttention-4", True), ("lapse, Triton backward", False)):
        fa4_bwd.ENABLED = on
        ins = [x.detach().clone().requires_grad_() for x in (wl.q, wl.k, wl.v, wl.log_fgate)]
        o, lse = forgetting_attention(*ins, return_lse=True, backend="triton")
        row[name] = errs([o.detach(), *torch.autograd.grad(o, ins, do)])
        row[name]["lse"] = float((lse.detach() - lse_ref.detach()).abs().max())
    fa4_bwd.ENABLED = True
    return row


def _time_one(d: int, t: int, interface, fox_forward, cfg) -> dict:
    """Forward times (eager and CUDA graph, ms) on the bench's workload: 32768 tokens, 24 heads."""
    import torch

    from lapse.bench import attention as bench
    from lapse.bench.workloads import WorkloadSpec, make_workload
    from lapse.ops.forgetting import fa4_bwd, forgetting_attention

    spec = WorkloadSpec(seq_len=t, tokens=32768, heads=24, kv_heads=24, head_dim=d)
    wl = make_workload(spec, device="cuda")
    q, k, v, g = wl.q, wl.k, wl.v, wl.log_fgate
    scale = 1 / math.sqrt(d)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    aux, _, _ = fox_forward.prepare(g, d)
    fns = {
        "sdpa-default": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
        "flash-attn-4": lambda: interface._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True)[0],
        "fa4-fox kernel": lambda: fox_forward.call(q, k, v, aux, scale)[0],
        "lapse": lambda: forgetting_attention(q, k, v, g, backend="triton"),
    }
    do = torch.randn_like(q)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    lt = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]

    def fa4_both():
        o, lse = interface._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)[:2]
        return interface._flash_attn_bwd(q, k, v, o, do, lse, softmax_scale=scale, causal=True)

    def lapse_both(on_fa4):
        fa4_bwd.ENABLED = on_fa4
        return torch.autograd.grad(forgetting_attention(*leaves, backend="triton"), leaves, do)

    def sdpa_both():
        o = torch.nn.functional.scaled_dot_product_attention(*lt, is_causal=True)
        return torch.autograd.grad(o, lt, do.transpose(1, 2))

    both = {
        "sdpa-default fwd+bwd": sdpa_both,
        "flash-attn-4 fwd+bwd": fa4_both,
        "fa4-fox fwd, lapse's bwd on FlashAttention-4": lambda: fox_forward.forward_backward(
            q, k, v, g, scale, do),
        "lapse fwd+bwd, bwd on FlashAttention-4": lambda: lapse_both(True),
        "lapse fwd+bwd, Triton bwd": lambda: lapse_both(False),
    }
    row: dict = {"D": d, "T": t}
    for name, fn in [*fns.items(), *both.items()]:
        try:
            with torch.no_grad() if name in fns else contextlib.nullcontext():
                fn()
                row[name] = {"ms": bench._time(fn, cfg), "graph_ms": bench._time_graphed(fn, cfg)}
        except Exception as e:
            row[name] = {"error": bench._short(e)}
        bench._free()
    fa4_bwd.ENABLED = True
    return row


if __name__ == "__main__":
    main()
