"""What the fastest block-sparse Hopper attention reaches on ACP's kept tiles (issue 16: ACP's
efficiency target, 0.85): FlashAttention-4's own kernels, plain softmax (no FoX gate, no score
hook), causal, dense against block-sparse on exactly the tiles lapse's ACP visits, on the bench's
workload (bf16, B x T = 32768, 24 heads; ``acp="auto"``, eps e^-10). GPU time replayed from CUDA
graphs, ms. Efficiency as the bench defines it: ``t_dense * (1 - pruned) / t_sparse``, with
``pruned`` the share of the causal 64 x 64 blocks ACP skips; ``own`` uses instead the share of the
kernel's own causal tiles it visits (its overhead within its tiles alone).

Beside them, in the same process: lapse dense and ``lapse-acp`` forward+backward, and (``--tiles``)
the backward at D 64 on 64 x 128 tiles (FlashAttention-4's D 96 configuration) instead of its
128 x 128, plain and with FoX's hooks, the gradients checked against the default tiles'.

    source scripts/fa4_env.sh && python3 scripts/diag_sparse_ceiling.py --out $OUT/sparse-ceiling.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="the rows as JSON, written after each")
    ap.add_argument("--dims", nargs="*", type=int, default=[64, 128])
    ap.add_argument("--seq-lens", nargs="*", type=int, default=[4096, 8192, 16384])
    ap.add_argument("--tiles", action="store_true", help="D 64: also the backward on 64 x 128 tiles")
    return ap.parse_args()


def main() -> None:
    a = _args()
    from lapse.bench import attention as bench
    from lapse.files import write_json_atomic
    from lapse.ops.forgetting import set_value_checks

    set_value_checks(False)
    res: dict = {"env": bench.environment(), "rows": []}
    for d, t in itertools.product(a.dims, a.seq_lens):
        res["rows"].append(measure(d, t, a.tiles and d == 64))
        print(json.dumps(res["rows"][-1]), flush=True)
        bench._free()
        if a.out:  # after every row: a call cut by its time limit keeps what it measured
            write_json_atomic(a.out, res, indent=1)


def measure(d: int, t: int, tiles_too: bool) -> dict:
    """One row: FlashAttention-4 dense and block-sparse, forward and backward, and lapse's."""
    import torch
    from flash_attn.cute import interface
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    from lapse.bench import attention as bench
    from lapse.bench.workloads import WorkloadSpec, make_workload
    from lapse.ops.forgetting import common, fa4_fwd, fa4_prep
    from lapse.ops.forgetting.common import ACP_BLOCK
    from lapse.ops.forgetting.pruning import triton_acp_block_start
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    cfg = bench.AttentionBenchConfig()
    eps = math.exp(-10)
    default_bwd_tiles = interface._tile_size_bwd_sm90

    def d96_tiles(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
        return default_bwd_tiles(96, 96, causal, local, sparse_block_size_q)  # 64 x 128, D 96's

    def graphed(fn) -> float:
        return round(bench._time_graphed(fn, cfg), 4)

    spec = WorkloadSpec(seq_len=t, tokens=32768, heads=24, kv_heads=24, head_dim=d)
    wl = make_workload(spec, device="cuda")
    q, k, v = wl.q, wl.k, wl.v
    p = common.validate(q, k, v, wl.log_fgate, None, None, "triton")
    block_start = triton_acp_block_start("auto", eps, q, k, *triton_gate_cumsum(wl.log_fgate, p), p)
    block_start = block_start.to(torch.int32).contiguous()
    pruned = bench._pruned_fraction(wl, "auto", eps)
    scale = d**-0.5
    do = torch.randn_like(q)
    row: dict = {"D": d, "T": t, "pruned": round(pruned, 4)}

    # forward: dense, and the key tiles ACP's forward visits, as "mask" tiles (lapse's choice)
    tm, tn = fa4_fwd.tiles(d)
    count, index = fa4_prep.acp_key_tiles(block_start, t, tm, tn, ACP_BLOCK)
    zeros = count.new_zeros(count.shape), count.new_zeros(*count.shape, 1)
    fwd_sparse = BlockSparseTensorsTorch(count, index, *zeros, block_size=(tm, tn))
    dense_tiles = sum(-(-min(t, (m + 1) * tm) // tn) for m in range(-(-t // tm)))
    row["fwd tiles"] = [tm, tn]
    row["fwd own kept"] = round(count.double().sum().item() / (dense_tiles * count[..., 0].numel()), 4)

    def fwd(sparse=None):
        extra = {"block_sparse_tensors": sparse} if sparse is not None else {}
        return interface._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True,
                                         **extra)[:2]

    o, lse = fwd()
    o_s, lse_s = fwd(fwd_sparse)
    row["fwd dense ms"] = graphed(fwd)
    row["fwd sparse ms"] = graphed(lambda: fwd(fwd_sparse))

    def bwd(out, lse_, sparse=None):
        extra = {"block_sparse_tensors": sparse} if sparse is not None else {}
        return interface._flash_attn_bwd(q, k, v, out, do, lse_, softmax_scale=scale, causal=True,
                                         **extra)[:3]

    variants = [("", default_bwd_tiles)] + ([("64x128 ", d96_tiles)] if tiles_too else [])
    for tag, tiles in variants:
        interface._tile_size_bwd_sm90 = tiles
        try:
            c = tiles(d, d, True, False)
            bm, bn = c.m_block_size, c.n_block_size
            cnt, idx = fa4_prep.acp_blocks(block_start, t, bm, bn, ACP_BLOCK)
            sparse = BlockSparseTensorsTorch(cnt, idx, block_size=(bm, bn))
            dense_n = sum(-(-(t - j * bn) // bm) for j in range(-(-t // bn)))
            row[f"{tag}bwd tiles"] = [bm, bn]
            row[f"{tag}bwd own kept"] = round(cnt.double().sum().item() / (dense_n * cnt[..., 0].numel()), 4)
            row[f"{tag}bwd dense ms"] = graphed(lambda: bwd(o, lse))
            row[f"{tag}bwd sparse ms"] = graphed(lambda sp=sparse: bwd(o_s, lse_s, sp))
        except Exception as e:  # a configuration the kernel refuses
            row[f"{tag}bwd error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            interface._tile_size_bwd_sm90 = default_bwd_tiles

    for tag in [tag for tag, _ in variants]:
        for part in ("fwd", f"{tag}bwd"):
            if f"{part} sparse ms" in row:
                dn, sp = row[f"{part} dense ms"], row[f"{part} sparse ms"]
                row[f"{part} efficiency"] = round(dn * (1 - pruned) / sp, 3)
                row[f"{part} efficiency own"] = round(dn * row[f"{part} own kept"] / sp, 3)
        if f"{tag}bwd sparse ms" in row:
            dn = row["fwd dense ms"] + row[f"{tag}bwd dense ms"]
            sp = row["fwd sparse ms"] + row[f"{tag}bwd sparse ms"]
            row[f"{tag}fwd+bwd efficiency"] = round(dn * (1 - pruned) / sp, 3)

    # lapse in the same process, and (tiles_too) its backward on 64 x 128 tiles
    grads = {}
    for tag, tiles in variants:
        interface._tile_size_bwd_sm90 = tiles
        try:
            for name in ("lapse", "lapse-acp"):
                r = bench.build_runner(name, wl, cfg)
                with r.context():
                    got = torch.autograd.grad(r.forward(), r.grad_inputs, r.from_bthd(do))
                if tag:
                    row[f"{tag}{name} grad error"] = max(
                        round(((x.float() - y.float()).norm() / y.float().norm()).item(), 6)
                        for x, y in zip(got, grads[name], strict=True))
                else:
                    grads[name] = got
                row[f"{tag}{name} fwd+bwd ms"] = bench._graph_ms(r, "fwd+bwd", do, cfg).get("graph_ms")
                bench._free()
        except Exception as e:
            row[f"{tag}lapse error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            interface._tile_size_bwd_sm90 = default_bwd_tiles
        dn, ac = row.get(f"{tag}lapse fwd+bwd ms"), row.get(f"{tag}lapse-acp fwd+bwd ms")
        if dn and ac:
            row[f"{tag}lapse efficiency"] = round(dn * (1 - pruned) / ac, 3)
    return row


if __name__ == "__main__":
    main()
