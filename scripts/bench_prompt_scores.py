"""Where an H2O prefill's extra time per layer goes (issue 15): the prompt's key scores
(`lapse.ops.attention_key_scores`) with and without the rows' log-sum-exp given, against
the attention itself, one layer of the SmolLM2-135M shape (9 query heads, 3 kv heads, D 64),
4 x 4096, bf16. Times are CUDA-event medians of 20 after a warm-up, ms.

    bash scripts/gpu.sh python3 scripts/bench_prompt_scores.py --out scores.json

``--sweep`` times the key-score kernels' tiles instead (``scores_triton.tile_config``; both
kernels take the same tiles), each checked against the default tiles' scores, at head
dims 64 and 128.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

from lapse.ops import attention_key_scores, scores_triton
from lapse.ops.forgetting import forgetting_attention


def _ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", default="prompt-scores.json")
    ap.add_argument("--sweep", action="store_true", help="time the key-score kernels' tiles instead")
    args = ap.parse_args()
    if args.sweep:
        sweep(args)
        return
    b, t, hq, h, d = args.batch, args.seq, 9, 3, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, t, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for n in (hq, h, h))
    zeros = torch.zeros(b, t, hq, device="cuda")
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, heads, T, D]
    _, lse = forgetting_attention(q, k, v, zeros, return_lse=True)
    rows = {
        "sdpa (default backend, GQA)": lambda: F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, enable_gqa=True
        ),
        "lapse forgetting_attention, log_fgate 0, lse": lambda: forgetting_attention(
            q, k, v, zeros, return_lse=True
        ),
        "key scores, lse computed": lambda: attention_key_scores(q, k),
        "key scores, lse given": lambda: attention_key_scores(q, k, lse=lse),
    }
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": [b, t, hq, h, d],
        "ms": {},
    }
    for name, fn in rows.items():
        result["ms"][name] = _ms(fn)
        print(f"{name}: {result['ms'][name]:.3f} ms", flush=True)
    full, given = attention_key_scores(q, k), attention_key_scores(q, k, lse=lse)
    result["max_rel_diff_lse_given"] = float(((full - given).abs().max() / full.abs().max()).item())
    print("scores with lse given vs computed, max relative difference:", result["max_rel_diff_lse_given"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def sweep(args) -> None:
    default = scores_triton.tile_config
    rows = []
    for d in (64, 128):
        b, t, hq, h = args.batch, args.seq, 9, 3
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (torch.randn(b, t, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for n in (hq, h))
        reference = attention_key_scores(q, k)
        lse = forgetting_attention(q, k, k, torch.zeros(b, t, hq, device="cuda"), return_lse=True)[1]
        tiles = [default(d)] + [
            dict(BM=bm, BN=bn, num_warps=w, num_stages=st)
            for bm, bn, w, st in itertools.product((32, 64, 128), (64, 128), (4, 8), (1, 2, 3))
        ]
        for cfg in tiles:
            scores_triton.tile_config = lambda _d, cfg=cfg: dict(cfg)
            row = dict(d=d, **cfg)
            try:
                got = attention_key_scores(q, k)
                row["rel_err"] = float(((got - reference).abs().max() / reference.abs().max()).item())
                row["ms"] = _ms(lambda: attention_key_scores(q, k))  # noqa: B023
                row["ms_lse_given"] = _ms(lambda: attention_key_scores(q, k, lse=lse))  # noqa: B023
            except Exception as e:  # noqa: BLE001 - out of resources: report and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
            finally:
                scores_triton.tile_config = default
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
