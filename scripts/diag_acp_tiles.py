"""How much of ACP's saving FlashAttention-4's backward tiles can keep, and what the order of its key
tiles costs in a model of the kernel (issue 16, thirty-second session; CPU only, no GPU).

On the CPU twin of ``lapse bench attention``'s workload (its gates drawn by a CPU generator: the same
law, not the GPU's tensors; q and k unit RMS, so U = sqrt(D)):

- the area of the backward's visited tiles (``fa4_bwd.acp_blocks``, 128 x 128 at D 64, 64 x 128 at
  D 128) over the area ACP keeps in its 64 x 64 blocks: the backward's ceiling is 1 / that;
- a list-scheduling model of the backward (each key tile a program, one a multiprocessor, 132 of
  them, taken in launch order; a program costs its visited query tiles + ``--overhead``): the time
  over the ideal (total / 132) with FlashAttention-4's default order (each head's key tiles in turn)
  and with its longest-first ``SingleTileLPTBwdScheduler`` (key tile 0 first within groups of heads
  sized to a 50 MB L2).

    python scripts/diag_acp_tiles.py
"""

from __future__ import annotations

import argparse
import heapq
import math


def makespan(costs: list[float], slots: int) -> float:
    """Each cost to the earliest free slot, in order; the last slot's finish."""
    free = [0.0] * slots
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def lpt_order(b: int, h: int, n: int, d: int, t: int) -> list[tuple[int, int, int]]:
    """``(batch, head, key tile)`` in the launch order of FlashAttention-4's SingleTileLPTBwdScheduler
    (4.0.0b36, not deterministic: no reversal), bf16."""
    size_head = t * 2 * d * 2 + t * d * 4  # q and dO, and dQ's float32 buffer
    l2 = 50 * 1024 * 1024
    swizzle = 1 if l2 < size_head else 1 << int(math.log2(l2 // size_head))
    quotient, residual = divmod(b * h, swizzle)
    order = []
    for idx in range(n * b * h):
        section, within = divmod(idx, swizzle * n)
        tile, rest = divmod(within, swizzle if section < quotient else max(residual, 1))
        order.append((*divmod(section * swizzle + rest, h), tile))
    return order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", nargs="*", type=int, default=[4096, 8192, 16384])
    ap.add_argument("--overhead", type=float, default=2.0, help="a program's fixed cost, in query tiles")
    a = ap.parse_args()

    import torch

    from lapse.bench.workloads import gate_logits
    from lapse.ops.forgetting import fa4_bwd
    from lapse.ops.forgetting.common import ACP_BLOCK

    sms, tokens, heads = 132, 32768, 24
    for d, (tm, tn) in ((64, (128, 128)), (128, (64, 128))):
        for t in a.seq_lens:
            b = tokens // t
            logits, _ = gate_logits(b, t, heads, generator=torch.Generator().manual_seed(0), device="cpu")
            c = torch.nn.functional.logsigmoid(logits).double().cumsum(1).transpose(1, 2)  # [B, H, T]
            delta = -2 * math.sqrt(d) - math.log(t) - 10  # SPEC section 3, eps = e^-10
            m = t // ACP_BLOCK
            idx = torch.arange(m)
            first, last = c[..., idx * ACP_BLOCK], c[..., idx * ACP_BLOCK + ACP_BLOCK - 1]
            top = first[..., :, None] - last[..., None, :]  # a block pair's largest bias
            keep = (top >= delta) | (idx[None, :] >= idx[:, None])  # the diagonal always kept
            block_start = keep.int().argmax(-1).int()  # [B, H, M]
            kept = (idx[None, None, None, :] >= block_start[..., None]) & (idx[None, :] <= idx[:, None])
            count, _ = fa4_bwd.acp_blocks(block_start, t, tm, tn)  # visited query tiles a key tile
            visited = count.sum().item() * tm * tn / (kept.sum().item() * ACP_BLOCK**2)
            n = count.shape[-1]
            dense = torch.tensor([-(-(t - j * tn) // tm) for j in range(n)], dtype=torch.float64)
            order = lpt_order(b, heads, n, d, t)
            line = [f"D {d} T {t}: visited / kept area {visited:.3f}"]
            for name, cnt in (("dense", dense.expand(b, heads, n)), ("ACP", count.double())):
                cost = cnt + a.overhead
                ideal = cost.sum().item() / sms
                default = makespan(cost.flatten().tolist(), sms) / ideal
                longest = makespan([cost[i, j, k].item() for i, j, k in order], sms) / ideal
                line.append(f"{name} time / ideal: default order {default:.3f}, longest first {longest:.3f}")
            print("; ".join(line), flush=True)


if __name__ == "__main__":
    main()
